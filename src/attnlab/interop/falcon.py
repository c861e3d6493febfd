"""Falcon (Almazrouei et al. 2023, "The Falcon Series of Open Language Models",
arXiv:2311.16867; huggingface.co/tiiuae/falcon-7b) <-> attnlab.

A pre-norm decoder with RoPE and LayerNorm. The 7B layout (`new_decoder_architecture` false)
is multi-query (`multi_query`) with one norm feeding attention and FFN in parallel
(`parallel_attn`; sequential with two norms otherwise); the 40B/180B layout is GQA with a
parallel block and one or two norms (`num_ln_in_parallel_attn`). Every layout's fused
`query_key_value` is [kv group][q_1..q_g, k, v][head_dim]: g = n_heads for multi-query,
g = 1 (per head [q, k, v]) for multi-head. Refused: `alibi` (Falcon scales the ALiBi bias by
1/sqrt(head_dim) and rounds its slopes to bf16, which attnlab's ALiBi does not).
"""

from __future__ import annotations

from ..config import AttentionConfig, DenseFFN, LayerNormConfig, ModelConfig
from .converter import CONVERTERS
from .hf_config import ACT_TO_HF, Fit, HFConfig, common_sizes, confirmed, qkv_bias, special_tokens
from .layouts import DecoderWeights, with_lm_head
from .rope_params import rope_from_hf, rope_to_hf

DEFAULTS = dict(
    vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
    num_ln_in_parallel_attn=None, layer_norm_epsilon=1e-5, hidden_dropout=0.0,
    attention_dropout=0.0, num_kv_heads=None, alibi=False, new_decoder_architecture=False, multi_query=True,
    parallel_attn=True, bias=False, max_position_embeddings=2048, ffn_hidden_size=None,
    activation="gelu", tie_word_embeddings=True, bos_token_id=11, eos_token_id=11,
)  # fmt: skip
PAIRS = [  # (attnlab module, HF module under "transformer.")
    ("embed_tokens", "word_embeddings"),
    ("decoder.final_norm", "ln_f"),
    ("decoder.blocks.{i}.self_attn.o_proj", "h.{i}.self_attention.dense"),
    ("decoder.blocks.{i}.ffn.up_proj", "h.{i}.mlp.dense_h_to_4h"),
    ("decoder.blocks.{i}.ffn.down_proj", "h.{i}.mlp.dense_4h_to_h"),
]
NORMS = {  # attnlab residual topology -> Falcon's norm names
    "sequential": [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")],
    "parallel-shared-norm": [("attn_norm", "input_layernorm")],
    "parallel": [("attn_norm", "ln_attn"), ("ffn_norm", "ln_mlp")],
}
QKV = "h.{i}.self_attention.query_key_value"


class FalconConverter(DecoderWeights):
    model_type = "falcon"
    hf_class = "FalconForCausalLM"
    prefix, pairs, qkv = "transformer.", PAIRS, QKV

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig("falcon", data, DEFAULTS, {"n_embed": "hidden_size"})
        hf.require(
            "alibi", (False,), "Falcon's ALiBi (bias scaled by 1/sqrt(head_dim)) is not attnlab's"
        )
        heads, n_ln = hf["num_attention_heads"], hf["num_ln_in_parallel_attn"]
        if hf["new_decoder_architecture"]:
            kv = hf["num_kv_heads"] or heads
            hf.require("parallel_attn", (True,), "the new decoder architecture is a parallel block")
            residual = "parallel" if n_ln in (None, 2) else "parallel-shared-norm"
        else:
            kv = 1 if hf["multi_query"] else heads
            if hf["parallel_attn"] and n_ln == 2:
                hf.reject(
                    "num_ln_in_parallel_attn", n_ln, "two norms need new_decoder_architecture"
                )
            residual = "parallel-shared-norm" if hf["parallel_attn"] else "sequential"
        rope = rope_from_hf(hf)
        act = hf.activation("activation")
        hf.done()
        d, bias = hf["hidden_size"], hf["bias"]
        return ModelConfig(
            arch="decoder",
            **hf.vocabulary(),
            d_model=d,
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=None if kv == heads else kv,
            d_ff=None if hf["ffn_hidden_size"] in (None, 4 * d) else hf["ffn_hidden_size"],
            positional=rope,
            attention=AttentionConfig(qkv_bias=bias, o_bias=bias, dropout=hf["attention_dropout"]),
            norm=LayerNormConfig(eps=hf["layer_norm_epsilon"]),
            ffn=DenseFFN(activation=act, bias=bias),
            residual=residual,
            dropout=hf["hidden_dropout"],
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, "falcon")
        fit.plain_heads()
        rope = rope_to_hf(fit, DEFAULTS["max_position_embeddings"])
        bias = qkv_bias(cfg)
        one_flag = " (one `bias` flag for every linear layer)"
        fit.need("attention.o_bias", bias, one_flag)
        fit.need("embedding_norm", False)
        fit.dense_layernorm(ffn_bias=bias, ffn_bias_why=one_flag)
        kv, heads = cfg.kv_heads, cfg.n_heads
        legacy = kv in (1, heads) and cfg.residual != "parallel"  # the 7B layout
        if not legacy:
            fit.need(
                "residual",
                ("parallel", "parallel-shared-norm"),
                " (GQA needs the new decoder architecture)",
            )
        fit.done()  # before reading fields a misfit config may not have
        layout = (
            dict(new_decoder_architecture=False, multi_query=kv == 1, num_kv_heads=kv,
                 parallel_attn=cfg.residual == "parallel-shared-norm")
            if legacy
            else dict(new_decoder_architecture=True, num_kv_heads=kv, parallel_attn=True,
                      num_ln_in_parallel_attn=2 if cfg.residual == "parallel" else 1)
        )  # fmt: skip
        return confirmed(
            self,
            cfg,
            dict(
                rope,
                **layout,
                **common_sizes(cfg),
                ffn_hidden_size=cfg.ffn_dim,
                activation=ACT_TO_HF[cfg.ffn.activation],
                bias=bias,
                layer_norm_epsilon=cfg.norm.eps,
                hidden_dropout=cfg.dropout,
                attention_dropout=cfg.attention.dropout,
                tie_word_embeddings=cfg.tie_embeddings,
                **special_tokens(cfg, DEFAULTS),
            ),
        )

    def _pairs(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        norms = [(f"decoder.blocks.{{i}}.{a}", f"h.{{i}}.{b}") for a, b in NORMS[cfg.residual]]
        return with_lm_head(PAIRS + norms, cfg)


CONVERTERS.register("falcon")(FalconConverter())
