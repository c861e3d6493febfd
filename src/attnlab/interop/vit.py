"""ViT <-> attnlab encoder-only models with the patch frontend.

ViT: Dosovitskiy et al. 2021, arXiv:2010.11929 (pre-norm encoder, final LayerNorm, GELU MLP,
biases everywhere; src/attnlab/nn/frontends/patches.py is its embedding).

Heads, chosen by `architectures` in config.json (from_hf passes the class it was given):
  ViTForImageClassification -> ClassificationHead without pooler (classifier_pooler False):
                               the final-normed class token through `classifier`. A bare
                               model's config says classifier_pooler False too, so
                               load_pretrained(folder, num_labels=N) adds ViT's head
  ViTModel (bare)           -> no head. Its pooler (dense + tanh on the class token, present
                               with add_pooling_layer, transformers' default) is dropped on
                               import, as the classifier never reads it, and written as zeros on
                               export, so pooler_output is 0, never random (bert.py does the same)
ViTForMaskedImageModeling (SimMIM's decoder and mask token) is refused.

Tensor names: transformers 5 names the layers `layers.{i}.attention.q_proj`, `mlp.fc1`, ...;
checkpoints on the Hub keep the older `encoder.layer.{i}.attention.attention.query`, ...
(transformers renames them on load: conversion_mapping.py, "ViTModel"). Both are read; the
current names are written.
"""

from __future__ import annotations

import re

from ..config import (
    AttentionConfig,
    DenseFFN,
    LayerNormConfig,
    ModelConfig,
    NoPositions,
    PatchFrontend,
)
from .converter import CONVERTERS, StateDict
from .hf_config import ACT_TO_HF, Fit, HFConfig, confirmed
from .layouts import add_prefix, check_consumed, drop, move, strip, swap

# configuration_vit.py defaults (transformers 5), for keys config.json omits
_DEFAULTS = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
    hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    layer_norm_eps=1e-12, image_size=224, patch_size=16, num_channels=3, qkv_bias=True,
)  # fmt: skip

_BODY = [  # (attnlab module, HF module under "vit.")
    ("frontend.proj", "embeddings.patch_embeddings.projection"),
    ("encoder.blocks.{i}.self_attn.q_proj", "layers.{i}.attention.q_proj"),
    ("encoder.blocks.{i}.self_attn.k_proj", "layers.{i}.attention.k_proj"),
    ("encoder.blocks.{i}.self_attn.v_proj", "layers.{i}.attention.v_proj"),
    ("encoder.blocks.{i}.self_attn.o_proj", "layers.{i}.attention.o_proj"),
    ("encoder.blocks.{i}.attn_norm", "layers.{i}.layernorm_before"),
    ("encoder.blocks.{i}.ffn.up_proj", "layers.{i}.mlp.fc1"),
    ("encoder.blocks.{i}.ffn.down_proj", "layers.{i}.mlp.fc2"),
    ("encoder.blocks.{i}.ffn_norm", "layers.{i}.layernorm_after"),
    ("encoder.final_norm", "layernorm"),
]
_PARAMETERS = [  # bare tensors (no .weight / .bias), (attnlab, HF under "vit.")
    ("frontend.cls_token", "embeddings.cls_token"),
    ("frontend.position_embeddings", "embeddings.position_embeddings"),
]
_CLASSIFIER = [("classifier.out_proj", "classifier")]
# Hub checkpoints' names -> transformers 5's (conversion_mapping.py, "ViTModel"), in this order
_LEGACY = [
    (r"encoder\.layer\.(\d+)\.", r"layers.\1."),
    (r"\.attention\.attention\.(query|key|value)\.", None),  # q_proj / k_proj / v_proj
    (r"\.attention\.output\.dense\.", ".attention.o_proj."),
    (r"\.intermediate\.dense\.", ".mlp.fc1."),
    (r"\.output\.dense\.", ".mlp.fc2."),
]
_QKV = {"query": "q_proj", "key": "k_proj", "value": "v_proj"}
_UNUSED = ("pooler.", "embeddings.mask_token")  # see the module docstring


def _current_name(key: str) -> str:
    for pattern, new in _LEGACY:
        if new is None:
            key = re.sub(pattern, lambda m: f".attention.{_QKV[m.group(1)]}.", key)
        else:
            key = re.sub(pattern, new, key)
    return key


def _side(hf: HFConfig, key: str) -> int:
    """image_size / patch_size: an int, or a square [h, w] pair."""
    value = hf[key]
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            hf.reject(key, value, "attnlab's patch frontend is for square images and patches")
            return int(value[0]) if value else 1
        return int(value[0])
    return value


class ViTConverter:
    model_type = "vit"
    hf_class = "ViTForImageClassification"

    def _class(self, cfg: ModelConfig) -> str:
        return "ViTForImageClassification" if cfg.num_labels else "ViTModel"

    def config_from_hf(self, data: dict) -> ModelConfig:
        hf = HFConfig("vit", data, _DEFAULTS)
        arch = hf.architecture()
        classify = arch == "ViTForImageClassification"
        if arch and arch not in ("ViTModel", "ViTForImageClassification"):
            hf.reject("architectures", arch, "only ViTModel and ViTForImageClassification")
        heads, d = hf["num_attention_heads"], hf["hidden_size"]
        if hf.get("head_dim") not in (None, d // heads):
            hf.reject("head_dim", hf.get("head_dim"), f"only hidden_size / heads ({d // heads})")
        act = hf.activation("hidden_act")
        size, patch = _side(hf, "image_size"), _side(hf, "patch_size")
        if size % patch:
            hf.reject("image_size", size, f"must be a multiple of patch_size ({patch})")
        hf.done()
        labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2
        return ModelConfig(
            arch="encoder",
            vocab_size=0,
            d_model=d,
            n_layers=hf["num_hidden_layers"],
            n_heads=heads,
            d_ff=hf["intermediate_size"],
            positional=NoPositions(),  # the frontend's table
            attention=AttentionConfig(
                qkv_bias=hf["qkv_bias"], o_bias=True, dropout=hf["attention_probs_dropout_prob"]
            ),
            norm=LayerNormConfig(eps=hf["layer_norm_eps"]),
            ffn=DenseFFN(activation=act),
            norm_placement="pre",
            final_norm=True,
            dropout=hf["hidden_dropout_prob"],
            num_labels=labels if classify else 0,
            classifier_pooler=False,  # also bare: the head num_labels would add is ViT's
            frontend=PatchFrontend(
                image_size=size, patch_size=patch, num_channels=hf["num_channels"]
            ),
            init="normal",
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        needs = (
            ("arch", "encoder"),
            ("frontend.kind", "patches"),
            ("positional.kind", "none"),
            ("norm_placement", "pre"),
            ("residual", "sequential"),
            ("final_norm", True),
            ("embedding_norm", False),
            ("norm.kind", "layernorm"),
            ("norm.bias", True),
            ("ffn.kind", "dense"),
            ("ffn.bias", True),
            ("attention.o_bias", True),
            ("attention.qk_norm", False),
            ("attention.sliding_window", None),
            ("activation_dropout", 0.0),
        )
        fit = Fit(cfg, "vit", needs=needs)
        fit.mha()
        fit.plain_heads()
        if cfg.frontend is None:
            fit.fail("frontend", None, "transformers' vit reads images: set a patches frontend")
        fit.need("classifier_pooler", False, " (ViT's classifier reads the class token)")
        fit.done()
        f = cfg.frontend
        hf = dict(
            architectures=[self._class(cfg)],
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            intermediate_size=cfg.ffn_dim,
            hidden_act=ACT_TO_HF[cfg.ffn.activation],
            hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.attention.dropout,
            layer_norm_eps=cfg.norm.eps,
            image_size=f.image_size,
            patch_size=f.patch_size,
            num_channels=f.num_channels,
            qkv_bias=cfg.attention.qkv_bias,
            encoder_stride=f.patch_size,  # SimMIM's decoder only; its default equals patch_size
        )
        if cfg.num_labels:
            hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
            hf["label2id"] = {f"LABEL_{i}": i for i in range(cfg.num_labels)}
        return confirmed(self, cfg, hf)

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = {_current_name(k): v for k, v in strip(sd, "vit.").items()}
        sd = drop(sd, prefixes=_UNUSED)
        out = move(sd, swap(_BODY + (_CLASSIFIER if cfg.num_labels else [])), cfg.n_layers)
        for ours, theirs in _PARAMETERS:
            if theirs in sd:
                out[ours] = sd.pop(theirs)
        return {**out, **sd}  # what is left, from_hf / load_pretrained report

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        src, sd = sd, dict(sd)
        out = move(sd, _BODY, cfg.n_layers)
        out.update({theirs: sd.pop(ours) for ours, theirs in _PARAMETERS})
        head = move(sd, _CLASSIFIER, cfg.n_layers)
        check_consumed(sd, "vit (attnlab side)")
        if cfg.num_labels:
            return {**add_prefix(out, "vit."), **head}
        w = src["frontend.proj.bias"]  # bare model: zero pooler (module docstring)
        out["pooler.dense.weight"] = w.new_zeros(cfg.d_model, cfg.d_model)
        out["pooler.dense.bias"] = w.new_zeros(cfg.d_model)
        return out


CONVERTERS.register("vit")(ViTConverter())
