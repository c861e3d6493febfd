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

import re

import torch

from ..config import AttentionConfig, DenseFFN, LayerNormConfig, LearnedPositions, ModelConfig
from .base import CONVERTERS, ConversionError, Renamer, StateDict, require_same, strip_prefix

HF_TO_ACT = {"gelu": "gelu", "gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "relu": "relu",
             "silu": "silu", "swish": "silu"}  # fmt: skip
ACT_TO_HF = {"gelu": "gelu", "gelu-tanh": "gelu_new", "relu": "relu", "silu": "silu"}

# configuration_bert.py / configuration_roberta.py defaults (transformers 5), for keys config.json omits
_DEFAULTS = dict(
    vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=512,
    type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0, tie_word_embeddings=True,
)  # fmt: skip
_ROBERTA_DEFAULTS = {**_DEFAULTS, "vocab_size": 50265, "pad_token_id": 1}

_LAYERS = Renamer(
    (
        ("encoder.layer.", "encoder.blocks."),
        (".attention.self.query.", ".self_attn.q_proj."),
        (".attention.self.key.", ".self_attn.k_proj."),
        (".attention.self.value.", ".self_attn.v_proj."),
        (".attention.output.dense.", ".self_attn.o_proj."),
        (".attention.output.LayerNorm.", ".attn_norm."),
        (".intermediate.dense.", ".ffn.up_proj."),
        (".output.dense.", ".ffn.down_proj."),
        (".output.LayerNorm.", ".ffn_norm."),
    )
)
_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": "embed_tokens.weight",
    "embeddings.position_embeddings.weight": "encoder.positional.weight",
    "embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
    "embeddings.LayerNorm.weight": "encoder.embedding_norm.weight",
    "embeddings.LayerNorm.bias": "encoder.embedding_norm.bias",
}
_HEADS = {  # family -> {hf name: attnlab name}; keys with no prefix
    "bert": {
        "cls.predictions.transform.dense.weight": "mlm_head.dense.weight",
        "cls.predictions.transform.dense.bias": "mlm_head.dense.bias",
        "cls.predictions.transform.LayerNorm.weight": "mlm_head.norm.weight",
        "cls.predictions.transform.LayerNorm.bias": "mlm_head.norm.bias",
        "cls.predictions.bias": "mlm_head.bias",
        "pooler.dense.weight": "classifier.dense.weight",
        "pooler.dense.bias": "classifier.dense.bias",
        "classifier.weight": "classifier.out_proj.weight",
        "classifier.bias": "classifier.out_proj.bias",
    },
    "roberta": {
        "lm_head.dense.weight": "mlm_head.dense.weight",
        "lm_head.dense.bias": "mlm_head.dense.bias",
        "lm_head.layer_norm.weight": "mlm_head.norm.weight",
        "lm_head.layer_norm.bias": "mlm_head.norm.bias",
        "lm_head.bias": "mlm_head.bias",
        **{
            f"classifier.{m}.{p}": f"classifier.{m}.{p}"
            for m in ("dense", "out_proj")
            for p in ("weight", "bias")
        },
    },
}
_TIED = {"bert": "cls.predictions.decoder.", "roberta": "lm_head.decoder."}


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

    def _heads(self, cfg: ModelConfig) -> dict[str, str]:
        ours = "mlm_head." if cfg.mlm_head else "classifier." if cfg.num_labels else "-"
        return {k: v for k, v in _HEADS[self.model_type].items() if v.startswith(ours)}

    def config_from_hf(self, hf: dict) -> ModelConfig:
        roberta = self.model_type == "roberta"
        d = {**(_ROBERTA_DEFAULTS if roberta else _DEFAULTS), **hf}
        arch = (hf.get("architectures") or [""])[0]
        mlm = arch.endswith(("ForMaskedLM", "ForPreTraining"))
        classify = arch.endswith("ForSequenceClassification")
        problems = []
        if arch and not (mlm or classify or arch.endswith("Model")):
            problems.append(
                f"architectures = {arch!r}: only *Model, *ForMaskedLM, *ForPreTraining, *ForSequenceClassification"
            )
        if d.get("position_embedding_type", "absolute") != "absolute":
            problems.append(
                f"position_embedding_type = {d['position_embedding_type']!r}: only 'absolute'"
            )
        for key in ("is_decoder", "add_cross_attention"):
            if d.get(key):
                problems.append(
                    f"{key} = True: attnlab's encoder is bidirectional without cross-attention"
                )
        if d["hidden_act"] not in HF_TO_ACT:
            problems.append(f"hidden_act = {d['hidden_act']!r}: supported {sorted(HF_TO_ACT)}")
        if mlm and not d["tie_word_embeddings"]:
            problems.append(
                "tie_word_embeddings = False: attnlab's MLM decoder is the token embedding"
            )
        if roberta and mlm and d["hidden_act"] != "gelu":
            problems.append(
                f"hidden_act = {d['hidden_act']!r}: RoBERTa's LM head applies gelu whatever hidden_act is"
            )
        if roberta and d["pad_token_id"] is None:
            problems.append("pad_token_id = None: RoBERTa's position ids start at pad_token_id + 1")
        if problems:
            raise ConversionError(f"{self.model_type} config:\n  - " + "\n  - ".join(problems))
        labels = d.get("num_labels") or len(d.get("id2label") or {}) or 2
        return ModelConfig(
            arch="encoder",
            vocab_size=d["vocab_size"],
            d_model=d["hidden_size"],
            n_layers=d["num_hidden_layers"],
            n_heads=d["num_attention_heads"],
            d_ff=d["intermediate_size"],
            positional=LearnedPositions(
                max_len=d["max_position_embeddings"], offset=d["pad_token_id"] + 1 if roberta else 0
            ),
            attention=AttentionConfig(
                qkv_bias=True, o_bias=True, dropout=d["attention_probs_dropout_prob"]
            ),
            norm=LayerNormConfig(eps=d["layer_norm_eps"]),
            ffn=DenseFFN(activation=HF_TO_ACT[d["hidden_act"]]),
            norm_placement="post",
            final_norm=False,
            embedding_norm=True,
            dropout=d["hidden_dropout_prob"],
            type_vocab_size=d["type_vocab_size"],
            pad_token_id=d["pad_token_id"],
            mlm_head=mlm,
            num_labels=labels if classify else 0,
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        if not isinstance(cfg.positional, LearnedPositions) or cfg.type_vocab_size == 0:
            raise ConversionError(
                f"{self.model_type} needs learned positions and token-type embeddings "
                f"(positional {cfg.positional.kind!r}, type_vocab_size {cfg.type_vocab_size})"
            )
        act = getattr(cfg.ffn, "activation", None)
        hf = dict(
            architectures=[self._class(cfg)],
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            intermediate_size=cfg.ffn_dim,
            hidden_act=ACT_TO_HF.get(act, act),
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
        require_same(cfg, self.config_from_hf(hf), self.model_type)
        return hf

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = strip_prefix(sd, (self.prefix,))
        heads, tied = self._heads(cfg), _TIED[self.model_type]
        out: StateDict = {}
        for k, v in sd.items():
            if k in _EMBEDDINGS:
                out[_EMBEDDINGS[k]] = v
            elif k.startswith("encoder.layer."):
                out[_LAYERS({k: v}).popitem()[0]] = v
            elif k in heads:
                out[heads[k]] = v
            elif k.startswith(tied):  # the MLM decoder: the tied embedding and the head's bias
                twin = (
                    "embeddings.word_embeddings.weight"
                    if k.endswith("weight")
                    else tied[:-8] + "bias"
                )
                if not torch.equal(v, sd[twin]):
                    raise ConversionError(
                        f"{self.model_type}: {k} differs from the weight it is tied to"
                    )
            elif not re.fullmatch(
                r"embeddings\.(position_ids|token_type_ids)|pooler\..*|cls\.seq_relationship\..*", k
            ):
                out[k] = v  # unknown: _load_exact reports it as unexpected
        return out

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        back = {v: k for k, v in {**_EMBEDDINGS, **self._heads(cfg)}.items()}
        body = "" if self._class(cfg).endswith("Model") else self.prefix
        out: StateDict = {}
        for k, v in sd.items():
            if k.startswith("encoder.blocks."):
                out[body + _LAYERS.inverse()({k: v}).popitem()[0]] = v
            elif k in _EMBEDDINGS.values():
                out[body + back[k]] = v
            else:
                hf = back[k]
                out[(body if hf.startswith("pooler.") else "") + hf] = v
        if cfg.mlm_head:  # decoder.bias is tied to the head's bias; a copy keeps safetensors happy
            out[_TIED[self.model_type] + "bias"] = sd["mlm_head.bias"].clone()
        if not cfg.mlm_head and not cfg.num_labels:  # bare model: zero pooler (module docstring)
            w = sd["embed_tokens.weight"]
            out["pooler.dense.weight"] = w.new_zeros(cfg.d_model, cfg.d_model)
            out["pooler.dense.bias"] = w.new_zeros(cfg.d_model)
        return out


CONVERTERS.register("bert")(BertConverter("bert"))
CONVERTERS.register("roberta")(BertConverter("roberta"))
