"""BERT and RoBERTa <-> attnlab encoder-only models.

BERT: Devlin et al. 2019, arXiv:1810.04805 (post-norm encoder, learned positions, token types,
MLM head with the tied embedding as decoder, pooler = dense + tanh on [CLS]). RoBERTa: Liu et al.
2019, arXiv:1907.11692 (the same network; position ids start at padding_idx + 1, which is
LearnedPositions offset pad_token_id + 1 = 2 for real tokens of a right-padded batch).

Heads, chosen by `architectures` in config.json (from_hf passes the class it was given):
  *ForMaskedLM / BertForPreTraining -> mlm_head (the NSP head of ForPreTraining is dropped)
  *ForSequenceClassification        -> ClassificationHead: BERT's pooler.dense and classifier
                                       become dense and out_proj (RoBERTa's classifier maps 1:1)
  *Model (bare)                     -> no head. The pooler is dropped on import (attnlab's
                                       output is last_hidden_state; sentence embeddings pool the
                                       hidden states, not the pooler) and written as zeros on
                                       export, so transformers' pooler_output is 0, never random.
Dropout values are carried; classifier_dropout (training only) is not modelled.
"""

from __future__ import annotations

import torch

from ..config import AttentionConfig, DenseFFN, LayerNormConfig, LearnedPositions, ModelConfig
from ..errors import Problems
from .converter import CONVERTERS, ConversionError, StateDict
from .hf_config import ACT_TO_HF, Fit, HFConfig, common_sizes, confirmed
from .layouts import add_prefix, check_consumed, drop, move, rename_prefix, strip, swap

# configuration_bert.py / configuration_roberta.py defaults (transformers 5), for keys config.json omits
_DEFAULTS = dict(
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512,
    type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0, tie_word_embeddings=True,
)  # fmt: skip
_ROBERTA_DEFAULTS = {**_DEFAULTS, "vocab_size": 50265, "pad_token_id": 1}

_BODY = [  # (attnlab module, HF module under "bert." / "roberta.")
    ("embed_tokens", "embeddings.word_embeddings"),
    ("encoder.positional", "embeddings.position_embeddings"),
    ("token_type_embeddings", "embeddings.token_type_embeddings"),
    ("encoder.embedding_norm", "embeddings.LayerNorm"),
    ("encoder.blocks.{i}.self_attn.q_proj", "encoder.layer.{i}.attention.self.query"),
    ("encoder.blocks.{i}.self_attn.k_proj", "encoder.layer.{i}.attention.self.key"),
    ("encoder.blocks.{i}.self_attn.v_proj", "encoder.layer.{i}.attention.self.value"),
    ("encoder.blocks.{i}.self_attn.o_proj", "encoder.layer.{i}.attention.output.dense"),
    ("encoder.blocks.{i}.attn_norm", "encoder.layer.{i}.attention.output.LayerNorm"),
    ("encoder.blocks.{i}.ffn.up_proj", "encoder.layer.{i}.intermediate.dense"),
    ("encoder.blocks.{i}.ffn.down_proj", "encoder.layer.{i}.output.dense"),
    ("encoder.blocks.{i}.ffn_norm", "encoder.layer.{i}.output.LayerNorm"),
]
_HEADS = {  # family -> attnlab head -> (attnlab module, HF module); BERT's pooler is under "bert."
    "bert": {
        "mlm_head": [
            ("mlm_head.dense", "cls.predictions.transform.dense"),
            ("mlm_head.norm", "cls.predictions.transform.LayerNorm"),
            ("mlm_head", "cls.predictions"),  # its .bias
        ],
        "classifier": [("classifier.dense", "pooler.dense"), ("classifier.out_proj", "classifier")],
    },
    "roberta": {
        "mlm_head": [
            ("mlm_head.dense", "lm_head.dense"),
            ("mlm_head.norm", "lm_head.layer_norm"),
            ("mlm_head", "lm_head"),  # its .bias
        ],
        "classifier": [(f"classifier.{m}", f"classifier.{m}") for m in ("dense", "out_proj")],
    },
}
_TIED = {"bert": "cls.predictions.decoder.", "roberta": "lm_head.decoder."}
# what attnlab drops on import: buffers, the pooler of a model without classifier, BERT's NSP head
_UNUSED = (
    "embeddings.position_ids",
    "embeddings.token_type_ids",
    "pooler.",
    "cls.seq_relationship.",
)


class BertConverter:
    def __init__(self, model_type: str) -> None:
        self.model_type = model_type
        self.prefix = model_type + "."
        self.hf_class = "BertForMaskedLM" if model_type == "bert" else "RobertaForMaskedLM"

    def _class(self, cfg: ModelConfig) -> str:
        head = (
            "ForMaskedLM"
            if cfg.mlm_head
            else "ForSequenceClassification"
            if cfg.num_labels
            else "Model"
        )
        return ("Bert" if self.model_type == "bert" else "Roberta") + head

    def _heads(self, cfg: ModelConfig) -> list[tuple[str, str]]:
        heads = _HEADS[self.model_type]
        return heads["mlm_head"] if cfg.mlm_head else heads["classifier"] if cfg.num_labels else []

    def config_from_hf(self, data: dict) -> ModelConfig:
        roberta = self.model_type == "roberta"
        hf = HFConfig(self.model_type, data, _ROBERTA_DEFAULTS if roberta else _DEFAULTS)
        arch = hf.architecture()
        mlm = arch.endswith(("ForMaskedLM", "ForPreTraining"))
        classify = arch.endswith("ForSequenceClassification")
        if arch and not (mlm or classify or arch.endswith("Model")):
            hf.reject(
                "architectures",
                arch,
                "only *Model, *ForMaskedLM, *ForPreTraining, *ForSequenceClassification",
            )
        position = hf.get("position_embedding_type", "absolute")
        if position != "absolute":
            hf.reject("position_embedding_type", position, "only 'absolute'")
        for key in ("is_decoder", "add_cross_attention"):
            if hf.get(key):
                hf.reject(key, True, "attnlab's encoder is bidirectional without cross-attention")
        act = hf.activation("hidden_act")
        if mlm and not hf["tie_word_embeddings"]:
            hf.reject("tie_word_embeddings", False, "attnlab's MLM decoder is the token embedding")
        if roberta and mlm and act != "gelu":
            hf.reject(
                "hidden_act",
                hf["hidden_act"],
                "RoBERTa's LM head applies gelu whatever hidden_act is",
            )
        if roberta and hf["pad_token_id"] is None:
            hf.reject("pad_token_id", None, "RoBERTa's position ids start at pad_token_id + 1")
        hf.done()
        labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2
        return ModelConfig(
            arch="encoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            d_ff=hf["intermediate_size"],
            positional=LearnedPositions(
                max_len=hf["max_position_embeddings"],
                offset=hf["pad_token_id"] + 1 if roberta else 0,
            ),
            attention=AttentionConfig(
                qkv_bias=True, o_bias=True, dropout=hf["attention_probs_dropout_prob"]
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
            num_labels=labels if classify else 0,
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(
            cfg, self.model_type, needs=(("positional.kind", "learned"), ("ffn.kind", "dense"))
        )
        if cfg.type_vocab_size == 0:
            fit.fail("type_vocab_size", 0, f"transformers' {self.model_type} has token types")
        fit.done()
        hf = dict(
            architectures=[self._class(cfg)],
            **common_sizes(cfg),
            intermediate_size=cfg.ffn_dim,
            hidden_act=ACT_TO_HF[cfg.ffn.activation],
            hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.attention.dropout,
            max_position_embeddings=cfg.positional.max_len,
            type_vocab_size=cfg.type_vocab_size,
            layer_norm_eps=cfg.norm.eps,
            pad_token_id=cfg.pad_token_id,
            tie_word_embeddings=True,
        )
        if cfg.num_labels:
            hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
            hf["label2id"] = {f"LABEL_{i}": i for i in range(cfg.num_labels)}
        return confirmed(self, cfg, hf)

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd, tied = strip(sd, self.prefix), _TIED[self.model_type]
        problems = Problems()
        for k in [k for k in sd if k.startswith(tied)]:  # the MLM decoder: embedding, head bias
            twin = (
                "embeddings.word_embeddings.weight"
                if k.endswith("weight")
                else tied.removesuffix("decoder.") + "bias"
            )
            if not torch.equal(sd.pop(k), sd[twin]):
                problems.add(f"{k} differs from {twin}, the tensor it is tied to")
        problems.raise_as(ConversionError, f"{self.model_type} checkpoint for an exact conversion")
        out = move(sd, swap(_BODY + self._heads(cfg)), cfg.n_layers)
        return {**out, **drop(sd, prefixes=_UNUSED)}  # what is left, _load_exact reports

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        src, sd, n = sd, dict(sd), cfg.n_layers
        body = "" if self._class(cfg).endswith("Model") else self.prefix
        out = add_prefix(move(sd, _BODY, n), body)
        out.update(rename_prefix(move(sd, self._heads(cfg), n), "pooler.", body + "pooler."))
        check_consumed(sd, f"{self.model_type} (attnlab side)")
        if cfg.mlm_head:  # decoder.bias is tied to the head's bias; a copy keeps safetensors happy
            out[_TIED[self.model_type] + "bias"] = src["mlm_head.bias"].clone()
        if not cfg.mlm_head and not cfg.num_labels:  # bare model: zero pooler (module docstring)
            w = src["embed_tokens.weight"]
            out["pooler.dense.weight"] = w.new_zeros(cfg.d_model, cfg.d_model)
            out["pooler.dense.bias"] = w.new_zeros(cfg.d_model)
        return out


CONVERTERS.register("bert")(BertConverter("bert"))
CONVERTERS.register("roberta")(BertConverter("roberta"))
