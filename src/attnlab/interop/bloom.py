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
from .base import CONVERTERS, StateDict
from .decoders import Fit, HFConfig, confirmed, special_tokens
from .layouts import (
    add_prefix,
    check_consumed,
    fuse,
    merge_qkv,
    move,
    split_qkv,
    strip,
    swap,
    unfuse,
)

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


class BloomConverter:
    model_type = "bloom"
    hf_class = "BloomForCausalLM"

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig("bloom", data, DEFAULTS, ALIASES)
        hf.require("apply_residual_connection_post_layernorm", (False,))
        hf.done()
        return ModelConfig(
            arch="decoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["n_layer"],
            n_heads=hf["n_head"],
            positional=ALiBi(),
            attention=AttentionConfig(qkv_bias=True, o_bias=True, dropout=hf["attention_dropout"]),
            norm=LayerNormConfig(eps=hf["layer_norm_epsilon"]),
            ffn=DenseFFN(activation="gelu-tanh", bias=True),
            embedding_norm=True,
            dropout=hf["hidden_dropout"],
            tie_embeddings=hf["tie_word_embeddings"],
            pad_token_id=hf.pad_token_id(hf["vocab_size"]),
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
            ("attention.sliding_window", None),
            ("norm.kind", "layernorm"),
            ("norm.bias", True),
            ("ffn.kind", "dense"),
            ("ffn_dim", 4 * cfg.d_model),
            ("residual", "sequential"),
            ("embedding_norm", True),
        ):
            fit.need(field, value)
        if isinstance(cfg.ffn, DenseFFN):
            fit.need("ffn.activation", "gelu-tanh")
            fit.need("ffn.bias", True)
        fit.done()
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

    def _pairs(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        return PAIRS + ([] if cfg.tie_embeddings else [("lm_head", "lm_head")])

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd, n, hd = strip(sd, "transformer.", cfg.tie_embeddings), cfg.n_layers, cfg.attn_head_dim
        out = move(sd, swap(self._pairs(cfg)), n)
        out.update(unfuse(sd, QKV, n, lambda w: split_qkv(w, cfg.n_heads, 1, hd)))
        check_consumed(sd, "bloom")
        return out

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd, n, hd = dict(sd), cfg.n_layers, cfg.attn_head_dim
        out = move(sd, self._pairs(cfg), n)
        out.update(fuse(sd, QKV, n, lambda q, k, v: merge_qkv(q, k, v, cfg.n_heads, hd)))
        check_consumed(sd, "bloom (attnlab side)")
        return add_prefix(out, "transformer.")


CONVERTERS.register("bloom")(BloomConverter())
