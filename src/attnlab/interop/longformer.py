"""Longformer <-> attnlab encoder-only models with `attention.kind` "longformer".

Beltagy et al. 2020, arXiv:2004.05150. transformers' Longformer is RoBERTa (bert.py: post-norm,
learned positions numbered from padding_idx + 1, the same embeddings, FFN and LM head) with
LongformerSelfAttention in place of self-attention: a sliding window of `attention_window`
tokens and global tokens with their own projections query_global / key_global / value_global
(attnlab: nn/attention/longformer.py, global_q_proj / global_k_proj / global_v_proj).

- `attention_window`: transformers keeps one even width per layer; attnlab has one per stack, so
  a list of different widths is refused (name the layers, the fix: retrain, or split the model).
- Global tokens are a run-time input in both: transformers' `global_attention_mask` is the
  `global_attention_mask` argument of attnlab's EncoderOnlyModel.forward.
- transformers pads each batch to a multiple of the window (pad tokens, masked); attnlab's mask
  needs no padding, and the outputs at real tokens are the same.
- Heads: LongformerModel (bare: no head; its pooler is dropped on import and written as zeros on
  export, as bert.py does) and LongformerForMaskedLM. LongformerForSequenceClassification is
  refused: it makes the first token global whenever no global_attention_mask is given, a
  behaviour of that class, not of the weights.
"""

from __future__ import annotations

import torch

from ..config import (
    DenseFFN,
    LayerNormConfig,
    LearnedPositions,
    LongformerAttentionConfig,
    ModelConfig,
)
from ..errors import Problems
from .bert import _BODY, _HEADS, _UNUSED
from .converter import CONVERTERS, ConversionError, StateDict
from .hf_config import ACT_TO_HF, Fit, HFConfig, common_sizes, confirmed
from .layouts import add_prefix, check_consumed, drop, move, strip, swap

# configuration_longformer.py defaults (transformers 5), for keys config.json omits
_DEFAULTS = dict(
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512,
    type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=1, tie_word_embeddings=True, attention_window=512,
)  # fmt: skip
_GLOBAL = [  # (attnlab module, HF module under "longformer.")
    (f"encoder.blocks.{{i}}.self_attn.global_{p}_proj", f"encoder.layer.{{i}}.attention.self.{n}")
    for p, n in (("q", "query_global"), ("k", "key_global"), ("v", "value_global"))
]
_PAIRS = _BODY + _GLOBAL
_MLM = _HEADS["roberta"]["mlm_head"]  # lm_head.dense / layer_norm / bias, as RoBERTa's
_TIED = "lm_head.decoder."
PREFIX = "longformer."


class LongformerConverter:
    model_type = "longformer"
    hf_class = "LongformerForMaskedLM"

    def _class(self, cfg: ModelConfig) -> str:
        return "LongformerForMaskedLM" if cfg.mlm_head else "LongformerModel"

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig(self.model_type, data, _DEFAULTS)
        arch = hf.architecture()
        mlm = arch.endswith("ForMaskedLM")
        if arch and not (mlm or arch == "LongformerModel"):
            hf.reject("architectures", arch, "only LongformerModel and LongformerForMaskedLM")
        windows = hf["attention_window"]
        windows = [windows] if isinstance(windows, int) else list(windows)
        if len(set(windows)) != 1:
            hf.reject(
                "attention_window",
                windows,
                "attnlab has one window per stack; per-layer widths are not modelled",
            )
        position = hf.get("position_embedding_type", "absolute")
        if position != "absolute":
            hf.reject("position_embedding_type", position, "only 'absolute'")
        act = hf.activation("hidden_act")
        if mlm and act != "gelu":
            hf.reject("hidden_act", hf["hidden_act"], "the LM head applies gelu whatever it is")
        if mlm and not hf["tie_word_embeddings"]:
            hf.reject("tie_word_embeddings", False, "attnlab's MLM decoder is the token embedding")
        if hf["pad_token_id"] is None:
            hf.reject("pad_token_id", None, "position ids start at pad_token_id + 1")
        hf.done()
        return ModelConfig(
            arch="encoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            d_ff=hf["intermediate_size"],
            positional=LearnedPositions(
                max_len=hf["max_position_embeddings"], offset=hf["pad_token_id"] + 1
            ),
            attention=LongformerAttentionConfig(
                attention_window=windows[0], dropout=hf["attention_probs_dropout_prob"]
            ),
            norm=LayerNormConfig(eps=hf["layer_norm_eps"]),
            ffn=DenseFFN(activation=act),
            norm_placement="post",
            final_norm=False,
            embedding_norm=True,
            dropout=hf["hidden_dropout_prob"],
            type_vocab_size=hf["type_vocab_size"],
            pad_token_id=hf["pad_token_id"],
            mlm_head=mlm,
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        needs = (("positional.kind", "learned"), ("ffn.kind", "dense"), ("num_labels", 0))
        fit = Fit(cfg, self.model_type, needs=needs, attention="longformer")
        if cfg.type_vocab_size == 0:
            fit.fail("type_vocab_size", 0, "transformers' longformer has token types")
        if cfg.pad_token_id is None:
            fit.fail("pad_token_id", None, "longformer numbers positions from pad_token_id + 1")
        fit.done()
        return confirmed(
            self,
            cfg,
            dict(
                architectures=[self._class(cfg)],
                **common_sizes(cfg),
                intermediate_size=cfg.ffn_dim,
                hidden_act=ACT_TO_HF[cfg.ffn.activation],
                hidden_dropout_prob=cfg.dropout,
                attention_probs_dropout_prob=cfg.attention.dropout,
                attention_window=[cfg.attention.attention_window] * cfg.n_layers,
                max_position_embeddings=cfg.positional.max_len,
                type_vocab_size=cfg.type_vocab_size,
                layer_norm_eps=cfg.norm.eps,
                pad_token_id=cfg.pad_token_id,
                tie_word_embeddings=True,
            ),
        )

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = strip(sd, PREFIX)
        problems = Problems()
        for k in [k for k in sd if k.startswith(_TIED)]:  # the MLM decoder: embedding, head bias
            twin = "embeddings.word_embeddings.weight" if k.endswith("weight") else "lm_head.bias"
            if not torch.equal(sd.pop(k), sd[twin]):
                problems.add(f"{k} differs from {twin}, the tensor it is tied to")
        problems.raise_as(ConversionError, "longformer checkpoint for an exact conversion")
        heads = _MLM if cfg.mlm_head else []
        out = move(sd, swap(_PAIRS + heads), cfg.n_layers)
        return {**out, **drop(sd, prefixes=_UNUSED)}  # what is left, _load_exact reports

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        src, sd, n = sd, dict(sd), cfg.n_layers
        if cfg.mlm_head:
            out = add_prefix(move(sd, _PAIRS, n), PREFIX)
            out.update(move(sd, _MLM, n))
            out[_TIED + "bias"] = src["mlm_head.bias"].clone()  # tied to lm_head.bias
        else:  # bare model: zero pooler (module docstring)
            out = move(sd, _PAIRS, n)
            w = src["embed_tokens.weight"]
            out["pooler.dense.weight"] = w.new_zeros(cfg.d_model, cfg.d_model)
            out["pooler.dense.bias"] = w.new_zeros(cfg.d_model)
        check_consumed(sd, "longformer (attnlab side)")
        return out


CONVERTERS.register("longformer")(LongformerConverter())
