"""The only module that reads a config: it turns a ModelConfig into modules.

Components take plain keyword arguments and never see the config. The kinds that grow —
positional schemes, attention, FFNs, norms (and inside them RoPE scalings and activations) — are
built from their registries with `Registry.build` (src/attnlab/registry.py): a component's
constructor names the values it needs, and each is taken from its config node's fields or from the
shared `Dims` below. So there is no per-kind code here: a new scheme registers itself and its
config class carries its fields (and what it derives: `rotary_dim`, `ffn.dense`, ...; see
src/attnlab/config/base.py, `Kind`); nothing in this file changes. The init scheme is built the same
way from `INITS`, taking the sizes it names from the dims, not the config.

    ModelConfig ─┬─ Dims (sizes every component may ask for by name)
                 ├─ positional ─ POSITIONAL.build(kind, fields, dims) ─┐
                 ├─ attention ── ATTENTIONS.build(kind, fields, dims) ─┤  (1 or 2 per block)
                 │                                                     ├─ Block × n ─ Stack ─┐
                 ├─ ffn ──────── FFNS.build(kind, fields, dims) ───────┤                     │
                 └─ norm ─────── NORMS.build(kind, fields, dim=...) ───┘                     │
    arch ─ DecoderOnlyModel / EncoderOnlyModel / EncoderDecoderModel (one or two stacks) ────┤
    frontend (the encoder's, or None) ─ FRONTENDS.build(kind, fields, dims) ─────────────────┘
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from .config import ConfigError, Frozen, ModelConfig
from .errors import AttnlabError
from .nn.attention import ATTENTIONS
from .nn.block import Block
from .nn.ffn import FFNS
from .nn.frontends import FRONTENDS
from .nn.heads import ClassificationHead, MLMHead
from .nn.init import INITS
from .nn.model import DecoderOnlyModel, EncoderDecoderModel, EncoderOnlyModel
from .nn.norms import NORMS
from .nn.positional import POSITIONAL, PositionalScheme
from .nn.stack import LayerVariant, Stack
from .nn.swin import HierarchicalEncoderModel, PatchMerging, Stage, WindowAttention

__all__ = ["Dims", "build_model", "count_parameters", "dims_of"]


@dataclass(frozen=True)
class Dims:
    """The sizes a component may ask for by naming a constructor parameter after a field."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int  # channels of each head that RoPE rotates (0 without RoPE)
    d_ff: int  # hidden width of the FFN (of each expert)
    n_layers: int
    causal: bool  # the stack being built is causal (a decoder)


def dims_of(cfg: ModelConfig, causal: bool, n_layers: int | None = None) -> Dims:
    """The shared sizes of one stack (`n_layers`: its depth; the encoder's by default)."""
    return Dims(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.kv_heads,
        head_dim=cfg.attn_head_dim,
        rotary_dim=cfg.rotary_dim,
        d_ff=cfg.ffn_dim,
        n_layers=cfg.n_layers if n_layers is None else n_layers,
        causal=causal,
    )


def fields(node: Frozen) -> dict[str, Any]:
    """A config node as plain data (nested nodes as dicts), the kwargs a component is built from."""
    return node.model_dump()


def build_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    return NORMS.build(cfg.norm.kind, fields(cfg.norm), dim=dim or cfg.d_model)


def build_positional(cfg: ModelConfig, dims: Dims) -> PositionalScheme:
    pos = cfg.positional
    return POSITIONAL.build(pos.kind, fields(pos), dataclasses.asdict(dims))


def build_ffn(cfg: ModelConfig, dims: Dims | None = None, layer_index: int = 0) -> nn.Module:
    """The FFN of `ffn.kind` (FFNS); `layer_index` (the block's place in its stack) is offered
    to every kind; a MoE stack's first `dense_layers` blocks are dense (DeepSeek)."""
    dims = dims or dims_of(cfg, cfg.is_causal)
    f = cfg.ffn
    return FFNS.build(
        f.kind,
        fields(f),
        dataclasses.asdict(dims),
        dropout=cfg.activation_dropout,
        layer_index=layer_index,
    )


def build_attention(cfg: ModelConfig, dims: Dims, layer_index: int = 0) -> nn.Module:
    """The layer of `attention.kind` (ATTENTIONS); qk-norm as two norms, as wide as one head or,
    with `qk_norm_scope` "projection" (a field of the kinds that have it), as the whole q / k
    projection. `layer_index` (the block's place in its stack) is offered to every kind; BigBird
    seeds its random plan with it."""
    a = cfg.attention
    node = fields(a)
    q_width = k_width = dims.head_dim
    if node.get("qk_norm_scope", "head") == "projection":
        q_width, k_width = dims.n_heads * dims.head_dim, dims.n_kv_heads * dims.head_dim
    return ATTENTIONS.build(
        a.kind,
        node,
        dataclasses.asdict(dims),
        q_norm=build_norm(cfg, q_width) if a.qk_norm else None,
        k_norm=build_norm(cfg, k_width) if a.qk_norm else None,
        layer_index=layer_index,
    )


def build_frontend(cfg: ModelConfig) -> nn.Module | None:
    """The frontend of `frontend.kind` (FRONTENDS), or None for a model that reads token ids."""
    f = cfg.frontend
    if f is None:
        return None
    return FRONTENDS.build(f.kind, fields(f), dataclasses.asdict(dims_of(cfg, cfg.is_causal)))


def build_variants(cfg: ModelConfig, dims: Dims) -> list[LayerVariant] | None:
    """One LayerVariant per entry of `layer_pattern` (a layer's own positional scheme is built
    from the same dims, with its own rotary channels), or None without a pattern."""
    if cfg.layer_pattern is None:
        return None
    out = []
    for spec in cfg.layer_pattern:
        pos = spec.positional
        scheme = None
        if pos is not None:
            own = dataclasses.replace(dims, rotary_dim=pos.rotary_dim(dims.head_dim))
            scheme = POSITIONAL.build(pos.kind, fields(pos), dataclasses.asdict(own))
        out.append(LayerVariant(window=spec.sliding_window, positional=scheme))
    return out


def build_stack(
    cfg: ModelConfig, causal: bool, cross: bool, n_layers: int, positions: bool = True
) -> Stack:
    """One stack; `positions` False: it adds none, as its input comes from a frontend that
    adds its own (Whisper's encoder; `positional` is then the decoder's)."""
    dims = dims_of(cfg, causal, n_layers)
    blocks = [
        Block(
            self_attn=build_attention(cfg, dims, i),
            ffn=build_ffn(cfg, dims, i),
            make_norm=lambda: build_norm(cfg),
            placement=cfg.norm_placement,
            residual=cfg.residual,
            cross_attn=build_attention(cfg, dims, i) if cross else None,
            dropout=cfg.dropout,
            attn_norm=cfg.first_attn_norm or i > 0,
            residual_multiplier=cfg.residual_multiplier,
        )
        for i in range(n_layers)
    ]
    return Stack(
        positional=build_positional(cfg, dims) if positions else POSITIONAL.build("none"),
        blocks=blocks,
        causal=causal,
        final_norm=build_norm(cfg) if cfg.final_norm else None,
        embedding_norm=build_norm(cfg) if cfg.embedding_norm else None,
        window=cfg.attention.sliding_window,
        dropout=cfg.dropout,
        variants=build_variants(cfg, dims),
    )


def build_stages(cfg: ModelConfig) -> HierarchicalEncoderModel:
    """Swin (`stages`, src/attnlab/nn/swin.py): the patch-grid frontend, then per stage s blocks
    of width d_model·2^s whose attention is windowed (shifted in every second block), patch
    merging between stages, the final norm at the last stage's width."""
    st, a = cfg.stages, cfg.attention
    stages = []
    for s, (depth, heads) in enumerate(zip(st.depths, st.heads, strict=True)):
        width = cfg.d_model << s
        dims = dataclasses.replace(
            dims_of(cfg, False, depth),
            d_model=width,
            n_heads=heads,
            n_kv_heads=heads,
            head_dim=width // heads,
            d_ff=cfg.ffn_dim << s,
        )
        blocks = [
            Block(
                self_attn=WindowAttention(
                    d_model=width,
                    n_heads=heads,
                    window_size=st.window_size,
                    shift=st.window_size // 2 if i % 2 else 0,
                    qkv_bias=a.qkv_bias,
                    o_bias=a.o_bias,
                    dropout=a.dropout,
                ),
                ffn=build_ffn(cfg, dims),
                make_norm=lambda width=width: build_norm(cfg, width),
                dropout=cfg.dropout,
                residual_multiplier=cfg.residual_multiplier,
            )
            for i in range(depth)
        ]
        merge = PatchMerging(d_model=width) if s < len(st.depths) - 1 else None
        stages.append(Stage(blocks=blocks, merge=merge))
    last = cfg.d_model << (len(st.depths) - 1)
    return HierarchicalEncoderModel(
        frontend=build_frontend(cfg),
        stages=stages,
        final_norm=build_norm(cfg, last),
        classifier=nn.Linear(last, cfg.num_labels) if cfg.num_labels else None,
    )


def _encoder_heads(cfg: ModelConfig) -> dict[str, nn.Module | None]:
    mlm = None
    if cfg.mlm_head:  # BERT's transform uses the FFN's activation (an MoE's: its experts')
        mlm = MLMHead(
            d_model=cfg.d_model,
            vocab_size=cfg.vocab_size,
            activation=cfg.ffn.dense.activation,
            norm=build_norm(cfg),
            dense_bias=cfg.mlm_dense_bias,
        )
    cls = None
    if cfg.num_labels:
        cls = ClassificationHead(
            d_model=cfg.d_model,
            num_labels=cfg.num_labels,
            dropout=cfg.dropout,
            pooler=cfg.classifier_pooler,
        )
    return {"mlm_head": mlm, "classifier": cls}


def build_model(cfg: ModelConfig, *, check_memory: bool = True) -> nn.Module:
    """Build the model a config describes, initialised with its `init` scheme. On the CPU its
    parameters are first checked against the memory available (`check_memory=False` skips it);
    on the meta device nothing is allocated and nothing is checked."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(
            f"build_model expects a ModelConfig, got {type(cfg).__name__}: convert a dict with "
            f"attnlab.ModelConfig.from_dict(d), or start from attnlab.presets.get(name)"
        )
    if check_memory:
        check_fits(cfg)
    sqrt_d = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
    io = dict(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        embed_scale=sqrt_d * cfg.embedding_multiplier,  # exact: × 1.0 changes no bit
        round_embed_scale=cfg.round_embed_scale,
    )
    head = dict(
        logit_scale=cfg.d_model**-0.5 if cfg.scale_tied_logits else 1.0,
        logit_multiplier=cfg.logit_multiplier,
        final_logit_softcap=cfg.final_logit_softcap,
    )
    model: nn.Module
    if cfg.arch == "decoder":
        model = DecoderOnlyModel(
            decoder=build_stack(cfg, True, False, cfg.n_layers),
            tie_embeddings=cfg.tie_embeddings,
            **head,
            **io,
        )
    elif cfg.stages is not None:  # a hierarchical image encoder (Swin)
        model = build_stages(cfg)
    elif cfg.arch == "encoder":
        model = EncoderOnlyModel(
            encoder=build_stack(cfg, False, False, cfg.n_layers),
            type_vocab_size=cfg.type_vocab_size,
            frontend=build_frontend(cfg),
            **_encoder_heads(cfg),
            **io,
        )
    else:
        model = EncoderDecoderModel(
            encoder=build_stack(cfg, False, False, cfg.n_layers, cfg.frontend is None),
            decoder=build_stack(cfg, True, True, cfg.decoder_layers),
            tie_embeddings=cfg.tie_embeddings,
            share_embeddings=cfg.share_encoder_decoder_embeddings,
            frontend=build_frontend(cfg),
            **head,
            **io,
        )
    if any(p.device.type != "meta" for p in model.parameters()):  # on meta there are no values
        INITS.build(cfg.init, dataclasses.asdict(dims_of(cfg, cfg.is_causal)), model=model)
    model.config = cfg
    return model


class ModelTooLargeError(AttnlabError, ValueError):
    """A config whose parameters alone exceed the memory this machine has available."""


def check_fits(cfg: ModelConfig) -> None:
    """Refuse, with the numbers and the fix, a config whose parameters would not fit in the
    memory available, before any of it is allocated (`--set model.overrides.d_model=100000`
    asked for 40 GB and died in the allocator; n_layers = 10^6 built for minutes). Only where
    the default device is the CPU; activations are not counted."""
    import torch

    if torch.get_default_device().type != "cpu":
        return
    available = available_memory()
    if available is None:
        return
    itemsize = torch.get_default_dtype().itemsize
    if _rough_parameters(cfg) * itemsize * 64 < available:  # far from the limit: no counting
        return
    n = estimated_parameters(cfg)
    if n * itemsize > available:
        raise ModelTooLargeError(
            f"this config has about {n / 1e9:.2f}B parameters, {n * itemsize / 2**30:.1f} GiB in "
            f"{str(torch.get_default_dtype()).removeprefix('torch.')}, but this machine has "
            f"{available / 2**30:.1f} GiB of memory available: make it smaller (d_model, "
            f"n_layers, d_ff, vocab_size, n_experts), or count it without building it "
            f"(attnlab.count_parameters(cfg), on the meta device)"
        )


def _rough_parameters(cfg: ModelConfig) -> int:
    """A quick size from the config's widths (embeddings, attention maps, FFNs, every expert):
    within a small factor of the real count for every kind (Swin's widths grow per stage, hence
    check_fits' margin of 64), so small models skip counting."""
    d, layers = (
        cfg.d_model,
        cfg.n_layers + (cfg.decoder_layers if cfg.arch == "encoder-decoder" else 0),
    )
    width = max(d, cfg.n_heads * cfg.attn_head_dim)
    ffns = 1 + getattr(cfg.ffn, "n_experts", 0) + getattr(cfg.ffn, "n_shared_experts", 0)
    per_layer = 4 * d * width + 3 * d * cfg.ffn_dim * ffns
    return 2 * cfg.vocab_size * d + layers * per_layer


def estimated_parameters(cfg: ModelConfig) -> int:
    """The parameter count, from the config at one and at two layers per stack (every layer
    holds the same parameters) when it is deep: the exact count (count_parameters) builds every
    layer, which takes minutes at 10^6 of them. Exact for stacks of identical layers."""
    deep = max(cfg.n_layers, cfg.decoder_layers if cfg.arch == "encoder-decoder" else 0)
    if deep <= 8:
        return count_parameters(cfg)
    try:
        one, two = (
            count_parameters(
                cfg.replace(n_layers=k, n_decoder_layers=k if cfg.n_decoder_layers else None)
            )
            for k in (1, 2)
        )
    except ConfigError:  # a config tied to its depth (Swin's stages, MoE's dense layers)
        return count_parameters(cfg)
    return one + (deep - 1) * (two - one)


def available_memory() -> int | None:
    """Bytes of memory available to this process: Linux's MemAvailable, capped by a cgroup
    (container) limit; None where neither can be read."""
    from pathlib import Path

    out = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                out = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            room = int(limit) - used
            out = room if out is None else min(out, room)
    except (OSError, ValueError):
        pass
    return out


def count_parameters(cfg: ModelConfig) -> int:
    """Exact parameter count (tied weights once), built on the meta device: no memory used."""
    import torch

    with torch.device("meta"):
        model = build_model(cfg)
    return sum(p.numel() for p in model.parameters())
