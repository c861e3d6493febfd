"""Cohere Command R (Cohere For AI 2024, huggingface.co/CohereForAI/c4ai-command-r-v01) <->
attnlab.

Llama's tensor names (src/attnlab/interop/llama.py) in another block, each difference an attnlab
component:

- one LayerNorm feeds attention and the SwiGLU FFN side by side, x + attn(n(x)) + ffn(n(x)):
  `residual` "parallel-shared-norm" (src/attnlab/nn/block.py; GPT-J's and Falcon-7B's block);
- CohereLayerNorm has a weight and no bias and computes in fp32, rounding once at the end:
  `layernorm` with `bias` False and `upcast` True (src/attnlab/nn/norms.py);
- the rotary embedding pairs channels (2i, 2i + 1) (repeat_interleave of the frequencies, its own
  rotate_half): RoPE's "interleaved" layout, not Llama's "half";
- the logits are multiplied by `logit_scale` (0.0625 by default): `logit_multiplier`;
- the embeddings are tied by default (`tie_word_embeddings` True).

Refused: `use_qk_norm` (Command R+ 08-2024): CohereLayerNorm over (num_heads, head_dim) keeps one
weight per head, where attnlab's qk-norm shares one over the heads. `attention_bias` covers q, k,
v and o; the MLP has no biases.
"""

from __future__ import annotations

from ..config import GLUFFN, AttentionConfig, LayerNormConfig, ModelConfig, RoPE
from .converter import CONVERTERS, StateDict
from .hf_config import (
    ACT_TO_HF,
    DECODER_ONLY,
    Fit,
    HFConfig,
    common_sizes,
    confirmed,
    qkv_bias,
    special_tokens,
)
from .layouts import DecoderWeights, move, swap
from .llama import DENSE
from .rope_params import rope_from_hf, rope_to_hf

DEFAULTS = dict(
    vocab_size=256000, hidden_size=8192, intermediate_size=22528, logit_scale=0.0625,
    num_hidden_layers=40, num_attention_heads=64, num_key_value_heads=None, hidden_act="silu",
    max_position_embeddings=8192, layer_norm_eps=1e-5, pad_token_id=0, bos_token_id=5,
    eos_token_id=255001, tie_word_embeddings=True, attention_bias=False, attention_dropout=0.0,
    use_qk_norm=False,
)  # fmt: skip
DEFAULT_THETA = 500000.0  # CohereConfig.default_theta: the base when the config states none
PAIRS = [  # (attnlab module, HF module under "model."): one norm per block
    ("embed_tokens", "embed_tokens"),
    ("decoder.final_norm", "norm"),
    ("decoder.blocks.{i}.attn_norm", "layers.{i}.input_layernorm"),
] + [
    (f"decoder.blocks.{{i}}.self_attn.{p}", f"layers.{{i}}.self_attn.{p}")
    for p in ("q_proj", "k_proj", "v_proj", "o_proj")
]
NEEDS = (  # what config_to_hf requires besides the decoder-only basics
    ("residual", "parallel-shared-norm"),
    ("norm.kind", "layernorm"),
    ("norm.bias", False),
    ("norm.upcast", True),
    ("embedding_norm", False),
    ("embedding_multiplier", 1.0),
    ("residual_multiplier", 1.0),
    ("final_logit_softcap", None),
    ("attention.sliding_window", None),
    ("ffn.kind", "glu"),
)


class CohereConverter(DecoderWeights):
    model_type, hf_class = "cohere", "CohereForCausalLM"
    prefix, pairs, buffers = "model.", PAIRS, ("rotary_emb.inv_freq",)

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig("cohere", data, DEFAULTS)
        hf.require(
            "use_qk_norm", (False, None), "its qk LayerNorms keep one weight per head, unmodelled"
        )
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        kv = hf["num_key_value_heads"] or heads
        scale = hf["logit_scale"]
        if not isinstance(scale, int | float) or scale <= 0:
            hf.reject("logit_scale", scale, "a positive number multiplies the logits")
            scale = 1.0
        rope = rope_from_hf(hf, DEFAULT_THETA).merged(layout="interleaved")
        act = hf.activation("hidden_act")
        hf.done()
        bias = hf["attention_bias"]
        return ModelConfig(
            arch="decoder",
            **hf.vocabulary(),
            d_model=d,
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=None if kv == heads else kv,
            d_ff=hf["intermediate_size"],
            positional=rope,
            attention=AttentionConfig(qkv_bias=bias, o_bias=bias, dropout=hf["attention_dropout"]),
            norm=LayerNormConfig(eps=hf["layer_norm_eps"], bias=False, upcast=True),
            ffn=GLUFFN(activation=act, bias=False),
            residual="parallel-shared-norm",
            logit_multiplier=float(scale),
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, "cohere", DECODER_ONLY + NEEDS)
        fit.plain_heads()
        bias = qkv_bias(cfg)
        fit.need("attention.o_bias", bias, " (attention_bias covers q, k, v and o)")
        if isinstance(cfg.ffn, GLUFFN):
            fit.need("ffn.bias", False, " (CohereMLP has no biases)")
            fit.need("ffn.activation", tuple(ACT_TO_HF))
        pos = cfg.positional
        if isinstance(pos, RoPE):  # Llama's rope keys, in Cohere's interleaved pairs
            fit.need("positional.layout", "interleaved", " (Cohere pairs channels 2i, 2i + 1)")
            pos = pos.merged(layout="half")
        rope_fit = Fit(cfg.replace(positional=pos), "cohere", needs=())
        rope = rope_to_hf(rope_fit, DEFAULTS["max_position_embeddings"])
        for line in rope_fit.problems.lines:
            fit.problems.add(line)
        fit.done()  # before reading fields a misfit config may not have
        return confirmed(
            self,
            cfg,
            dict(
                rope,
                **common_sizes(cfg),
                intermediate_size=cfg.ffn_dim,
                num_key_value_heads=cfg.kv_heads,
                hidden_act=ACT_TO_HF[cfg.ffn.activation],
                layer_norm_eps=cfg.norm.eps,
                logit_scale=cfg.logit_multiplier,
                attention_bias=bias,
                attention_dropout=cfg.attention.dropout,
                tie_word_embeddings=cfg.tie_embeddings,
                use_qk_norm=False,
                **special_tokens(cfg, DEFAULTS),
            ),
        )

    def _more_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        return move(sd, swap(DENSE), cfg.n_layers)

    def _more_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        return move(sd, DENSE, cfg.n_layers)


CONVERTERS.register("cohere")(CohereConverter())
