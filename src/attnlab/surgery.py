"""Model surgery on trained weights (the formats a model is written in are interop/'s, and
`attnlab convert`'s): MHA -> GQA/MQA by mean-pooling key/value heads.

Ainslie et al. 2023 (arXiv:2305.13245, section 2.1, "Uptraining"): a multi-head checkpoint is
converted to grouped-query attention by mean-pooling the key and value projection heads of each
group, then trained a little further ("uptraining", 5% of the original compute in the paper).
This is a reconstruction of parameters, not a renaming: the pooled model computes a different
function, and its quality before uptraining is the paper's Figure 3 starting point.

    K/V heads  h0 h1 | h2 h3 | h4 h5 | h6 h7      n_kv_heads 8 -> 4: group of 2 consecutive heads
                 ↓       ↓       ↓       ↓        new head j = mean(old heads j·g .. j·g + g - 1)
               h'0     h'1     h'2     h'3

Consecutive heads form a group because the attention layer shares K/V head j among query heads
j·(H/H_kv) .. (j+1)·(H/H_kv) - 1 (src/attnlab/nn/attention/kernels/naive.py), so query head i
keeps attending with (the mean of) the key head it was trained with. A model that is already GQA
is pooled further (8 -> 4 -> 2 -> 1).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .nn.attention.layer import Attention


def _pool_heads(proj: nn.Linear, n_old: int, n_new: int, head_dim: int) -> nn.Linear:
    """A projection with n_new heads, each the mean of n_old / n_new consecutive old heads."""
    g = n_old // n_new
    d_in = proj.in_features
    # weight (n_old·D, d_in) -> view (n_new, g, D, d_in) -> mean over g -> (n_new·D, d_in)
    w = proj.weight.detach().view(n_new, g, head_dim, d_in).mean(dim=1).reshape(-1, d_in)
    out = nn.Linear(d_in, n_new * head_dim, bias=proj.bias is not None)
    out = out.to(device=proj.weight.device, dtype=proj.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if proj.bias is not None:  # (n_old·D,) -> (n_new, g, D) -> mean over g
            out.bias.copy_(proj.bias.detach().view(n_new, g, head_dim).mean(dim=1).reshape(-1))
    out.weight.requires_grad_(proj.weight.requires_grad)
    return out


def to_gqa(model: nn.Module, n_kv_heads: int) -> nn.Module:
    """A copy of `model` whose softmax attention layers have `n_kv_heads` key/value heads, each the
    mean of the group of K/V heads it replaces (Ainslie et al. 2023). n_kv_heads == the model's
    is a plain copy; 1 gives MQA. Cross-attention layers are pooled too. The copy's `config`
    (when the model carries one, as build_model's do) says the new n_kv_heads."""
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int):
        raise TypeError(f"n_kv_heads must be an int, got {type(n_kv_heads).__name__}")
    layers = [m for m in model.modules() if type(m) is Attention]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no softmax attention layers to convert (to_gqa pools the "
            f"K/V heads of attention.kind 'softmax')"
        )
    for i, layer in enumerate(layers):
        if n_kv_heads < 1 or layer.n_kv_heads % n_kv_heads:
            options = [d for d in range(1, layer.n_kv_heads + 1) if layer.n_kv_heads % d == 0]
            raise ValueError(
                f"n_kv_heads ({n_kv_heads}) must divide the {layer.n_kv_heads} key/value heads of "
                f"attention layer {i} (heads are pooled in whole groups): choose one of {options}"
            )
    new = copy.deepcopy(model)
    for layer in (m for m in new.modules() if type(m) is Attention):
        old = layer.n_kv_heads
        if old == n_kv_heads:
            continue
        layer.k_proj = _pool_heads(layer.k_proj, old, n_kv_heads, layer.head_dim)
        layer.v_proj = _pool_heads(layer.v_proj, old, n_kv_heads, layer.head_dim)
        layer.n_kv_heads = n_kv_heads
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "replace"):
        new.config = cfg.replace(n_kv_heads=n_kv_heads)
    return new
