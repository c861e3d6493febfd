"""Initialisation schemes, applied once after building (a registry: schemes grow).

- "xavier": Xavier/Glorot uniform (Glorot & Bengio 2010) on every matrix, zero biases — the
  2017 Transformer as the Annotated Transformer and tensor2tensor initialise it.
- "normal": normal(0, 0.02) everywhere (BERT, BART, Llama as `transformers` initialises them).
- "gpt2": normal(0, 0.02) on matrices and embeddings; residual output projections (o_proj,
  down_proj) scaled by 1/sqrt(2·n_layers), because each layer adds two residual branches and the
  stream's variance would otherwise grow with depth (Radford et al. 2019, section 2.3).
- "t5": T5's (Mesh TF) fan-in scheme with factor 1: embeddings N(0, 1), q N(0, (d·d_kv)^-0.5),
  k/v N(0, d^-0.5), o N(0, (H·d_kv)^-0.5), FFN in N(0, d^-0.5), out N(0, d_ff^-0.5); that is why T5
  needs no 1/sqrt(d_k) in attention.

Norm weights start where the norm leaves x̂ unscaled (1; 0 for `rmsnorm-unit-offset`) and
biases at 0 in every scheme. Frozen parameters (requires_grad False) keep the values their module
computed.

A scheme is called as `scheme(model, **sizes)` and names the sizes it needs as keyword-only
parameters; build.py passes them by name from its `Dims` (`Registry.build`), so a scheme never
sees the config.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..registry import Registry

INITS: Registry[Callable[..., None]] = Registry("init scheme")
RESIDUAL_OUT = ("o_proj", "down_proj")


def _learned(model: nn.Module):
    """(name, parameter) of every trainable parameter: a frozen one (requires_grad False) is a
    fixed table its module computed (Whisper's sinusoids, src/attnlab/nn/frontends/audio.py)."""
    return ((n, p) for n, p in model.named_parameters() if p.requires_grad)


def _norms_and_biases(model: nn.Module) -> None:
    """Biases to 0; norm weights to their module's `identity_weight` (1, or 0 for a norm that
    stores its gain as an offset from 1: src/attnlab/nn/norms_offset.py)."""
    for prefix, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            name = f"{prefix}.{leaf}" if prefix else leaf
            if leaf == "bias":
                nn.init.zeros_(p)
            elif "norm" in name and leaf == "weight":
                nn.init.constant_(p, getattr(module, "identity_weight", 1.0))


@INITS.register("xavier")
@torch.no_grad()
def xavier(model: nn.Module) -> None:
    for name, p in _learned(model):
        if p.dim() > 1 and "norm" not in name:
            nn.init.xavier_uniform_(p)
    _norms_and_biases(model)


@INITS.register("normal")
@torch.no_grad()
def normal(model: nn.Module) -> None:
    """normal(0, 0.02) on every matrix, no depth scaling (BERT, BART, Llama in transformers)."""
    for name, p in _learned(model):
        if p.dim() > 1 and "norm" not in name:
            nn.init.normal_(p, std=0.02)
    _norms_and_biases(model)


@INITS.register("gpt2")
@torch.no_grad()
def gpt2(model: nn.Module, *, n_layers: int) -> None:
    """n_layers: the depth of the (first) stack, whose residual stream the scaling is for."""
    residual_std = 0.02 / math.sqrt(2 * n_layers)
    for name, p in _learned(model):
        if p.dim() > 1 and "norm" not in name:
            std = residual_std if name.rsplit(".", 2)[-2] in RESIDUAL_OUT else 0.02
            nn.init.normal_(p, std=std)
    _norms_and_biases(model)


@INITS.register("t5")
@torch.no_grad()
def t5(model: nn.Module, *, d_model: int, head_dim: int, n_heads: int, d_ff: int) -> None:
    """d_model, head_dim (T5's d_kv), n_heads and d_ff: the sizes the fan-ins are counted from."""
    d, d_kv, H = d_model, head_dim, n_heads
    stds = {
        "q_proj": (d * d_kv) ** -0.5,
        "k_proj": d**-0.5,
        "v_proj": d**-0.5,
        "o_proj": (H * d_kv) ** -0.5,
        "gate_proj": d**-0.5,
        "up_proj": d**-0.5,
        "down_proj": d_ff**-0.5,
        "relative_attention_bias": d**-0.5,
        "lm_head": d**-0.5,
        "router": d**-0.5,
    }
    for name, p in _learned(model):
        if p.dim() > 1 and "norm" not in name:
            nn.init.normal_(p, std=stds.get(name.rsplit(".", 2)[-2], 1.0))
    _norms_and_biases(model)
