"""GPT-NeoX (Black et al. 2022, "GPT-NeoX-20B", arXiv:2204.06745; also Pythia, Biderman et al.
2023, arXiv:2304.01373) <-> attnlab.

A pre-norm decoder with rotary embeddings on the first `partial_rotary_factor` of each head
("half" layout; 25 % by default, and transformers' old key `rotary_pct`), a parallel residual
x + attn(ln1(x)) + mlp(ln2(x)) (`use_parallel_residual`; sequential otherwise), biases and
an untied output head (`lm_head`, once `embed_out`). Its fused `query_key_value` rows are per
head: [head][q, k, v][head_dim].
"""

from __future__ import annotations

from ..config import AttentionConfig, DenseFFN, LayerNormConfig, ModelConfig
from .converter import CONVERTERS, StateDict
from .hf_config import ACT_TO_HF, Fit, HFConfig, common_sizes, confirmed, qkv_bias, special_tokens
from .layouts import DecoderWeights, rename_prefix
from .rope_params import rope_from_hf, rope_to_hf

DEFAULTS = dict(
    vocab_size=50432, hidden_size=6144, num_hidden_layers=44, num_attention_heads=64,
    intermediate_size=24576, hidden_act="gelu", attention_dropout=0.0, hidden_dropout=0.0,
    max_position_embeddings=2048, layer_norm_eps=1e-5, tie_word_embeddings=False,
    use_parallel_residual=True, attention_bias=True, bos_token_id=0, eos_token_id=2,
)  # fmt: skip
PAIRS = [  # (attnlab module, HF module under "gpt_neox.")
    ("embed_tokens", "embed_in"),
    ("decoder.final_norm", "final_layer_norm"),
    ("decoder.blocks.{i}.attn_norm", "layers.{i}.input_layernorm"),
    ("decoder.blocks.{i}.ffn_norm", "layers.{i}.post_attention_layernorm"),
    ("decoder.blocks.{i}.self_attn.o_proj", "layers.{i}.attention.dense"),
    ("decoder.blocks.{i}.ffn.up_proj", "layers.{i}.mlp.dense_h_to_4h"),
    ("decoder.blocks.{i}.ffn.down_proj", "layers.{i}.mlp.dense_4h_to_h"),
]
QKV = "layers.{i}.attention.query_key_value"
BUFFERS = (".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")  # old checkpoints


class GPTNeoXConverter(DecoderWeights):
    model_type = "gpt_neox"
    hf_class = "GPTNeoXForCausalLM"
    prefix, pairs, qkv, buffers = "gpt_neox.", PAIRS, QKV, BUFFERS

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig("gpt_neox", data, DEFAULTS)
        rope = rope_from_hf(
            hf,
            theta_keys=("rotary_emb_base", "rope_theta"),
            fraction_keys=("rotary_pct", "partial_rotary_factor"),
            default_fraction=0.25,
            partial_ok=True,
        )
        act = hf.activation("hidden_act")
        hf.done()
        bias = hf["attention_bias"]
        return ModelConfig(
            arch="decoder",
            **hf.vocabulary(),
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            d_ff=None
            if hf["intermediate_size"] == 4 * hf["hidden_size"]
            else hf["intermediate_size"],
            positional=rope,
            attention=AttentionConfig(qkv_bias=bias, o_bias=bias, dropout=hf["attention_dropout"]),
            norm=LayerNormConfig(eps=hf["layer_norm_eps"]),
            ffn=DenseFFN(activation=act, bias=True),
            residual="parallel" if hf["use_parallel_residual"] else "sequential",
            dropout=hf["hidden_dropout"],
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, "gpt_neox")
        fit.mha()
        fit.plain_heads()
        rope = rope_to_hf(fit, DEFAULTS["max_position_embeddings"], partial_ok=True)
        fit.need("attention.o_bias", qkv_bias(cfg), " (attention_bias covers q, k, v and o)")
        fit.need("residual", ("parallel", "sequential"))
        fit.need("embedding_norm", False)
        fit.dense_layernorm()
        fit.done()  # before reading fields a misfit config may not have
        return confirmed(
            self,
            cfg,
            dict(
                rope,
                **common_sizes(cfg),
                intermediate_size=cfg.ffn_dim,
                hidden_act=ACT_TO_HF[cfg.ffn.activation],
                attention_bias=qkv_bias(cfg),
                attention_dropout=cfg.attention.dropout,
                hidden_dropout=cfg.dropout,
                layer_norm_eps=cfg.norm.eps,
                use_parallel_residual=cfg.residual == "parallel",
                tie_word_embeddings=cfg.tie_embeddings,
                **special_tokens(cfg, DEFAULTS),
            ),
        )

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        # old checkpoints call the output layer embed_out
        return super().weights_from_hf(rename_prefix(sd, "embed_out.", "lm_head."), cfg)


CONVERTERS.register("gpt_neox")(GPTNeoXConverter())
