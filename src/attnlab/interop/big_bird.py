"""BigBird <-> attnlab encoder-only models.

BigBird: Zaheer et al. 2020, arXiv:2007.14062 — BERT's post-norm encoder (learned positions from
0, token types, MLM head tied to the word embeddings) with block-sparse attention
(`attention_type` "block_sparse", src/attnlab/nn/attention/block_sparse.py) or full attention
("original_full"). Tensor names are BERT's (src/attnlab/interop/bert.py), under "bert." in the
models with a head; the pooler is one Linear, `pooler`.

Heads, by `architectures`:
  BigBirdForMaskedLM / BigBirdForPreTraining -> mlm_head (the NSP head is dropped)
  BigBirdModel (bare)                        -> no head
Each builds BigBirdModel with its pooler, which attnlab does not model (its output is
last_hidden_state): dropped on import, written as zeros on export (pooler_output is then 0, never
random). BigBirdForSequenceClassification is refused: its head applies `hidden_act` where
attnlab's ClassificationHead applies tanh.

Training-only differences (eval outputs are equal): BigBirdEmbeddings applies dropout before its
LayerNorm, attnlab after; `classifier_dropout` is not modelled.
"""

from __future__ import annotations

import torch

from ..config import (
    AttentionConfig,
    BlockSparseAttentionConfig,
    DenseFFN,
    LayerNormConfig,
    LearnedPositions,
    ModelConfig,
)
from ..errors import Problems
from .bert import _BODY, _HEADS
from .converter import CONVERTERS, ConversionError, StateDict
from .hf_config import ACT_TO_HF, Fit, HFConfig, common_sizes, confirmed
from .layouts import add_prefix, check_consumed, drop, move, swap

# configuration_big_bird.py defaults (transformers 5), for keys config.json omits
_DEFAULTS = dict(
    vocab_size=50358, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu_new", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=4096,
    type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0, attention_type="block_sparse", use_bias=True,
    rescale_embeddings=False, block_size=64, num_random_blocks=3, tie_word_embeddings=True,
)  # fmt: skip
_MLM = _HEADS["bert"]["mlm_head"]  # cls.predictions..., as BERT
_TIED = "cls.predictions.decoder."
_UNUSED = (
    "embeddings.position_ids",
    "embeddings.token_type_ids",
    "pooler.",
    "cls.seq_relationship.",
)


class BigBirdConverter:
    model_type = "big_bird"
    hf_class = "BigBirdForMaskedLM"

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig(self.model_type, data, _DEFAULTS)
        arch = hf.architecture()
        mlm = arch in ("BigBirdForMaskedLM", "BigBirdForPreTraining")
        if arch and not (mlm or arch == "BigBirdModel"):
            hf.reject(
                "architectures",
                arch,
                "only BigBirdModel, BigBirdForMaskedLM and BigBirdForPreTraining (the other "
                "heads differ from attnlab's: the classifier applies hidden_act, not tanh)",
            )
        for key in ("is_decoder", "add_cross_attention"):
            if hf.get(key):
                hf.reject(key, True, "attnlab's BigBird is an encoder without cross-attention")
        if mlm and not hf["tie_word_embeddings"]:
            hf.reject("tie_word_embeddings", False, "attnlab's MLM decoder is the token embedding")
        kind = hf.require("attention_type", ("block_sparse", "original_full"))
        act = hf.activation("hidden_act")
        hf.done()
        proj = dict(
            qkv_bias=hf["use_bias"], o_bias=True, dropout=hf["attention_probs_dropout_prob"]
        )
        attention = (
            BlockSparseAttentionConfig(
                block_size=hf["block_size"],
                num_random_blocks=hf["num_random_blocks"],
                legacy_plan_len=hf["max_position_embeddings"],
                **proj,
            )
            if kind == "block_sparse"
            else AttentionConfig(**proj)
        )
        return ModelConfig(
            arch="encoder",
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            d_ff=hf["intermediate_size"],
            positional=LearnedPositions(max_len=hf["max_position_embeddings"]),
            attention=attention,
            norm=LayerNormConfig(eps=hf["layer_norm_eps"]),
            ffn=DenseFFN(activation=act),
            norm_placement="post",
            final_norm=False,
            embedding_norm=True,
            scale_embeddings=hf["rescale_embeddings"],
            dropout=hf["hidden_dropout_prob"],
            type_vocab_size=hf["type_vocab_size"],
            pad_token_id=hf["pad_token_id"],
            mlm_head=mlm,
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        fit = Fit(
            cfg,
            self.model_type,
            needs=(
                ("arch", "encoder"),
                ("positional.kind", "learned"),
                ("positional.offset", 0),
                ("ffn.kind", "dense"),
                ("num_labels", 0),
            ),
            attention=("block-sparse", "softmax"),
        )
        a = cfg.attention
        fit.need("attention.o_bias", True)
        fit.need("attention.sliding_window", None)
        fit.need("attention.seed", (0, None), " (the layer index seeds its plan)")
        fit.plain_heads()
        fit.need("attention.qk_norm", False)
        if cfg.type_vocab_size == 0:
            fit.fail("type_vocab_size", 0, "transformers' big_bird has token types")
        fit.done()
        sparse = a.kind == "block-sparse"
        hf = dict(
            architectures=["BigBirdForMaskedLM" if cfg.mlm_head else "BigBirdModel"],
            **common_sizes(cfg),
            intermediate_size=cfg.ffn_dim,
            hidden_act=ACT_TO_HF[cfg.ffn.activation],
            hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=a.dropout,
            max_position_embeddings=cfg.positional.max_len,
            type_vocab_size=cfg.type_vocab_size,
            layer_norm_eps=cfg.norm.eps,
            pad_token_id=cfg.pad_token_id,
            attention_type="block_sparse" if sparse else "original_full",
            use_bias=a.qkv_bias,
            rescale_embeddings=cfg.scale_embeddings,
            block_size=a.block_size if sparse else _DEFAULTS["block_size"],
            num_random_blocks=a.num_random_blocks if sparse else _DEFAULTS["num_random_blocks"],
            tie_word_embeddings=True,
        )
        if sparse and a.legacy_plan_len != cfg.positional.max_len:
            raise ConversionError(
                f"attention.legacy_plan_len ({a.legacy_plan_len}) must equal positional.max_len "
                f"({cfg.positional.max_len}): transformers draws its plan from "
                f"max_position_embeddings"
            )
        return confirmed(self, cfg, hf)

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = {k.removeprefix("bert."): v for k, v in sd.items()}
        problems = Problems()
        for k in [k for k in sd if k.startswith(_TIED)]:  # the MLM decoder: embedding, head bias
            twin = (
                "embeddings.word_embeddings.weight"
                if k.endswith("weight")
                else "cls.predictions.bias"
            )
            if not torch.equal(sd.pop(k), sd[twin]):
                problems.add(f"{k} differs from {twin}, the tensor it is tied to")
        problems.raise_as(ConversionError, "big_bird checkpoint for an exact conversion")
        out = move(sd, swap(_BODY + (_MLM if cfg.mlm_head else [])), cfg.n_layers)
        return {**out, **drop(sd, prefixes=_UNUSED)}  # what is left, _load_exact reports

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        src, sd = sd, dict(sd)
        body = "bert." if cfg.mlm_head else ""
        out = add_prefix(move(sd, _BODY, cfg.n_layers), body)
        out.update(move(sd, _MLM if cfg.mlm_head else [], cfg.n_layers))
        check_consumed(sd, "big_bird (attnlab side)")
        if cfg.mlm_head:  # decoder.bias is tied to the head's bias; a copy keeps safetensors happy
            out[_TIED + "bias"] = src["mlm_head.bias"].clone()
        w = src["embed_tokens.weight"]  # the unmodelled pooler: zeros (module docstring)
        out[body + "pooler.weight"] = w.new_zeros(cfg.d_model, cfg.d_model)
        out[body + "pooler.bias"] = w.new_zeros(cfg.d_model)
        return out


CONVERTERS.register("big_bird")(BigBirdConverter())
