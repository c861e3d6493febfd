"""The only module that reads a config: it turns a ModelConfig into modules.

Components take plain typed arguments and never see the config (DESIGN.md, "Variant selection");
this file is the translation table. Registries are looked up by the config's `kind` names.
"""

from __future__ import annotations

import math
from functools import partial

from torch import nn

from .config import ModelConfig, MoEFFN, RoPE
from .nn.attention.layer import Attention
from .nn.block import Block
from .nn.ffn import ACTIVATIONS, FFNS
from .nn.heads import ClassificationHead, MLMHead
from .nn.init import INITS
from .nn.model import DecoderOnlyModel, EncoderDecoderModel, EncoderOnlyModel
from .nn.norms import NORMS
from .nn.positional import POSITIONAL, PositionalScheme
from .nn.stack import Stack


def build_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    args = cfg.norm.model_dump(exclude={"kind"})
    return NORMS.get(cfg.norm.kind)(dim or cfg.d_model, **args)


def build_positional(cfg: ModelConfig, causal: bool) -> PositionalScheme:
    pos = cfg.positional
    cls = POSITIONAL.get(pos.kind)
    if pos.kind == "sinusoidal":
        return cls(cfg.d_model, pos.base, pos.layout)
    if pos.kind == "learned":
        return cls(cfg.d_model, pos.max_len, pos.offset)
    if isinstance(pos, RoPE):
        scaling = pos.scaling.model_dump() if pos.scaling is not None else None
        return cls(cfg.rotary_dim, pos.base, pos.layout, scaling)
    if pos.kind == "alibi":
        return cls(cfg.n_heads, causal)
    if pos.kind == "t5-relative":
        return cls(cfg.n_heads, causal, pos.num_buckets, pos.max_distance)
    return cls()


def build_attention(cfg: ModelConfig) -> Attention:
    a = cfg.attention
    qk_norm = (
        (build_norm(cfg, cfg.attn_head_dim), build_norm(cfg, cfg.attn_head_dim))
        if a.qk_norm
        else None
    )
    return Attention(
        cfg.d_model,
        cfg.n_heads,
        cfg.kv_heads,
        cfg.attn_head_dim,
        a.qkv_bias,
        a.o_bias,
        qk_norm,
        a.scale,
        a.dropout,
    )


def build_ffn(cfg: ModelConfig) -> nn.Module:
    f = cfg.ffn
    if isinstance(f, MoEFFN):
        expert = f.expert
        make = partial(
            FFNS.get(expert.kind),
            cfg.d_model,
            activation=expert.activation,
            bias=expert.bias,
            dropout=cfg.activation_dropout,
        )
        shared = make(cfg.ffn_dim * f.n_shared_experts) if f.n_shared_experts else None
        experts = [make(cfg.ffn_dim) for _ in range(f.n_experts)]
        return FFNS.get("moe")(cfg.d_model, experts, f.top_k, f.routing, shared, f.aux_loss_coef)
    return FFNS.get(f.kind)(cfg.d_model, cfg.ffn_dim, f.activation, f.bias, cfg.activation_dropout)


def build_stack(cfg: ModelConfig, causal: bool, cross: bool, n_layers: int) -> Stack:
    blocks = [
        Block(
            build_attention(cfg),
            build_ffn(cfg),
            partial(build_norm, cfg),
            cfg.norm_placement,
            cfg.residual,
            build_attention(cfg) if cross else None,
            cfg.dropout,
        )
        for _ in range(n_layers)
    ]
    return Stack(
        build_positional(cfg, causal),
        blocks,
        build_norm(cfg) if cfg.final_norm else None,
        build_norm(cfg) if cfg.embedding_norm else None,
        causal,
        cfg.attention.sliding_window,
        cfg.dropout,
    )


def build_model(cfg: ModelConfig) -> nn.Module:
    """Build the model a config describes, initialised with its `init` scheme."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"build_model expects a ModelConfig, got {type(cfg).__name__}: convert a dict with "
            f"attnlab.ModelConfig.from_dict(d), or start from attnlab.presets.get(name)"
        )
    embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
    logit_scale = cfg.d_model**-0.5 if cfg.scale_tied_logits else 1.0
    if cfg.arch == "decoder":
        model = DecoderOnlyModel(
            build_stack(cfg, True, False, cfg.n_layers),
            cfg.vocab_size,
            cfg.d_model,
            cfg.tie_embeddings,
            embed_scale,
            logit_scale,
        )
    elif cfg.arch == "encoder":
        act = ACTIVATIONS[(cfg.ffn.expert if isinstance(cfg.ffn, MoEFFN) else cfg.ffn).activation]
        mlm = MLMHead(cfg.d_model, cfg.vocab_size, act, build_norm(cfg)) if cfg.mlm_head else None
        cls = (
            ClassificationHead(cfg.d_model, cfg.num_labels, cfg.dropout) if cfg.num_labels else None
        )
        model = EncoderOnlyModel(
            build_stack(cfg, False, False, cfg.n_layers),
            cfg.vocab_size,
            cfg.d_model,
            cfg.type_vocab_size,
            embed_scale,
            mlm,
            cls,
        )
    else:
        model = EncoderDecoderModel(
            build_stack(cfg, False, False, cfg.n_layers),
            build_stack(cfg, True, True, cfg.decoder_layers),
            cfg.vocab_size,
            cfg.d_model,
            cfg.tie_embeddings,
            cfg.share_encoder_decoder_embeddings,
            embed_scale,
            logit_scale,
        )
    INITS.get(cfg.init)(model, cfg)
    model.config = cfg
    return model


__all__ = ["build_model", "count_parameters"]


def count_parameters(cfg: ModelConfig) -> int:
    """Exact parameter count (tied weights once), built on the meta device: no memory used."""
    import torch

    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())
