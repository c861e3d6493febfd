"""BLOOM (BigScience 2022, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model",
arXiv:2211.05100; huggingface.co/bigscience/bloom-560m) <-> attnlab.

A pre-norm decoder with ALiBi, a LayerNorm right after the embeddings, biases everywhere and a
tanh-GELU FFN 4·d_model wide. BLOOM adds slope·(key position) to the scores, which differs from
attnlab's slope·(key − query) by a per-row constant that softmax ignores. Its fused
`query_key_value` rows are per head: [head][q, k, v][head_dim]. Refused:
`apply_residual_connection_post_layernorm` (the residual taken after the norm).
"""

from __future__ import annotations

from ..config import ALiBi, AttentionConfig, DenseFFN, LayerNormConfig, ModelConfig
from .converter import CONVERTERS
from .hf_config import Fit, HFConfig, confirmed, special_tokens
from .layouts import DecoderWeights

DEFAULTS = dict(
    vocab_size=250880, hidden_size=64, n_layer=2, n_head=8, layer_norm_epsilon=1e-5,
    apply_residual_connection_post_layernorm=False, hidden_dropout=0.0, attention_dropout=0.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
ALIASES = {
    "n_embed": "hidden_size",
    "num_hidden_layers": "n_layer",
    "num_attention_heads": "n_head",
}
PAIRS = [  # (attnlab module, HF module under "transformer.")
    ("embed_tokens", "word_embeddings"),
    ("decoder.embedding_norm", "word_embeddings_layernorm"),
    ("decoder.final_norm", "ln_f"),
    ("decoder.blocks.{i}.attn_norm", "h.{i}.input_layernorm"),
    ("decoder.blocks.{i}.ffn_norm", "h.{i}.post_attention_layernorm"),
    ("decoder.blocks.{i}.self_attn.o_proj", "h.{i}.self_attention.dense"),
    ("decoder.blocks.{i}.ffn.up_proj", "h.{i}.mlp.dense_h_to_4h"),
    ("decoder.blocks.{i}.ffn.down_proj", "h.{i}.mlp.dense_4h_to_h"),
]
QKV = "h.{i}.self_attention.query_key_value"


class BloomConverter(DecoderWeights):
    model_type = "bloom"
    hf_class = "BloomForCausalLM"
    prefix, pairs, qkv = "transformer.", PAIRS, QKV

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig("bloom", data, DEFAULTS, ALIASES)
        hf.require("apply_residual_connection_post_layernorm", (False,))
        hf.done()
        return ModelConfig(
            arch="decoder",
            **hf.vocabulary(),
            d_model=hf["hidden_size"],
            n_layers=hf["n_layer"],
            n_heads=hf["n_head"],
            positional=ALiBi(),
            attention=AttentionConfig(qkv_bias=True, o_bias=True, dropout=hf["attention_dropout"]),
            norm=LayerNormConfig(eps=hf["layer_norm_epsilon"]),
            ffn=DenseFFN(activation="gelu-tanh", bias=True),
            embedding_norm=True,
            dropout=hf["hidden_dropout"],
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(cfg, "bloom")
        fit.mha()
        fit.plain_heads()
        for field, value in (
            ("positional.kind", "alibi"),
            ("attention.qkv_bias", True),
            ("attention.o_bias", True),
            ("ffn_dim", 4 * cfg.d_model),
            ("residual", "sequential"),
            ("embedding_norm", True),
        ):
            fit.need(field, value)
        fit.dense_layernorm(activation="gelu-tanh")
        fit.done()  # before reading fields a misfit config may not have
        return confirmed(
            self,
            cfg,
            dict(
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.d_model,
                n_layer=cfg.n_layers,
                n_head=cfg.n_heads,
                layer_norm_epsilon=cfg.norm.eps,
                hidden_dropout=cfg.dropout,
                attention_dropout=cfg.attention.dropout,
                tie_word_embeddings=cfg.tie_embeddings,
                **special_tokens(cfg, DEFAULTS),
            ),
        )


CONVERTERS.register("bloom")(BloomConverter())
