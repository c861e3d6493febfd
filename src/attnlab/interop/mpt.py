"""MPT (MosaicML 2023, "Introducing MPT-7B", www.mosaicml.com/blog/mpt-7b;
huggingface.co/mosaicml/mpt-7b) <-> attnlab.

A pre-norm decoder with ALiBi (Press et al. 2022, arXiv:2108.12409), no biases anywhere
(LayerNorm without shift), an exact-GELU FFN 4·d_model wide and a fused `Wqkv` whose rows are
[q; k; v]. MPT's bias is slope·(key − last key), a per-row constant away from attnlab's
slope·(key − query); its slopes for a head count that is not a power of two (odd then even slopes
of the next power of two) equal the paper's. Refused, because `transformers`' MPT (the reference)
or attnlab does not model them: `clip_qkv`, `qk_ln`, `prefix_lm`, sequence-id masking,
multi-query `attn_type`, `alibi_bias_max` other than 8, learned positions instead of ALiBi,
biases (`no_bias` false), `logit_scale`, a non-LayerNorm `norm_type`, `expansion_ratio` ≠ 4.
"""

from __future__ import annotations

from ..config import ALiBi, AttentionConfig, DenseFFN, LayerNormConfig, ModelConfig
from .converter import CONVERTERS
from .hf_config import Fit, HFConfig, confirmed, special_tokens
from .layouts import DecoderWeights

DEFAULTS = dict(
    d_model=2048, n_heads=16, n_layers=24, expansion_ratio=4, max_seq_len=2048, vocab_size=50368,
    resid_pdrop=0.0, layer_norm_epsilon=1e-5, attn_config=None, logit_scale=None, no_bias=True,
    norm_type="low_precision_layernorm", tie_word_embeddings=True, ffn_config=None,
)  # fmt: skip
ATTN_DEFAULTS = dict(
    attn_type="multihead_attention", attn_pdrop=0.0, clip_qkv=None, softmax_scale=None,
    prefix_lm=False, qk_ln=False, attn_uses_sequence_id=False, alibi=True, alibi_bias_max=8,
)  # fmt: skip
ALIASES = {
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "num_hidden_layers": "n_layers",
}
PAIRS = [  # (attnlab module, HF module under "transformer.")
    ("embed_tokens", "wte"),
    ("decoder.final_norm", "norm_f"),
    ("decoder.blocks.{i}.attn_norm", "blocks.{i}.norm_1"),
    ("decoder.blocks.{i}.ffn_norm", "blocks.{i}.norm_2"),
    ("decoder.blocks.{i}.self_attn.o_proj", "blocks.{i}.attn.out_proj"),
    ("decoder.blocks.{i}.ffn.up_proj", "blocks.{i}.ffn.up_proj"),
    ("decoder.blocks.{i}.ffn.down_proj", "blocks.{i}.ffn.down_proj"),
]
QKV = "blocks.{i}.attn.Wqkv"


class MptConverter(DecoderWeights):
    model_type = "mpt"
    hf_class = "MptForCausalLM"
    prefix, pairs = "transformer.", PAIRS
    qkv, qkv_rows = QKV, "stacked"

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig("mpt", data, DEFAULTS, ALIASES)
        attn = HFConfig("mpt attn_config", hf["attn_config"] or {}, ATTN_DEFAULTS)
        for key, ok in (
            ("attn_type", ("multihead_attention",)),
            ("clip_qkv", (None, 0)),
            ("qk_ln", (False,)),
            ("prefix_lm", (False,)),
            ("attn_uses_sequence_id", (False,)),
            ("alibi", (True,)),
            ("alibi_bias_max", (8,)),
        ):
            attn.require(key, ok)
        for line in attn.problems.lines:
            hf.problems.add(f"attn_config.{line}")
        hf.require("no_bias", (True,), "transformers' MPT has no biases")
        hf.require("logit_scale", (None,))
        hf.require("norm_type", ("low_precision_layernorm", "layernorm"))
        hf.require("expansion_ratio", (4,), "transformers' MptMLP is 4·d_model wide")
        ffn_type = (hf["ffn_config"] or {}).get("ffn_type", "mptmlp")
        if ffn_type != "mptmlp":
            hf.reject("ffn_config.ffn_type", ffn_type, "only the GELU MLP ('mptmlp') is modelled")
        hf.done()
        return ModelConfig(
            arch="decoder",
            **hf.vocabulary(),
            d_model=hf["d_model"],
            n_layers=hf["n_layers"],
            n_heads=hf["n_heads"],
            positional=ALiBi(),
            attention=AttentionConfig(scale=attn["softmax_scale"], dropout=attn["attn_pdrop"]),
            norm=LayerNormConfig(eps=hf["layer_norm_epsilon"], bias=False),
            ffn=DenseFFN(activation="gelu", bias=False),
            dropout=hf["resid_pdrop"],
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, "mpt")
        fit.mha()
        fit.need("attn_head_dim", cfg.d_model // cfg.n_heads, " (d_model / n_heads)")
        for field, value in (
            ("positional.kind", "alibi"),
            ("attention.qkv_bias", False),
            ("attention.o_bias", False),
            ("ffn_dim", 4 * cfg.d_model),
            ("residual", "sequential"),
            ("embedding_norm", False),
        ):
            fit.need(field, value)
        fit.dense_layernorm(norm_bias=False, ffn_bias=False, activation="gelu")
        fit.done()  # before reading fields a misfit config may not have
        return confirmed(
            self,
            cfg,
            dict(
                d_model=cfg.d_model,
                n_heads=cfg.n_heads,
                n_layers=cfg.n_layers,
                expansion_ratio=4,
                max_seq_len=DEFAULTS["max_seq_len"],  # ALiBi: context only, not the architecture
                vocab_size=cfg.vocab_size,
                layer_norm_epsilon=cfg.norm.eps,
                resid_pdrop=cfg.dropout,
                emb_pdrop=cfg.dropout,
                attn_config=dict(
                    softmax_scale=cfg.attention.scale, attn_pdrop=cfg.attention.dropout or 0
                ),  # int-typed there
                no_bias=True,
                tie_word_embeddings=cfg.tie_embeddings,
                **special_tokens(cfg, DEFAULTS),
            ),
        )


CONVERTERS.register("mpt")(MptConverter())
