"""Transformer-XL attention (Dai et al. 2019, arXiv:1901.02860, sections 3.2-3.3): softmax
attention whose scores carry the relative position term of the `xl-relative` scheme, over the
keys of the current segment and a memory of earlier ones.

    x ─ q_proj ─ q ─┬─ + u ───────────────────────── query ─┐
                    └─ + v ─┐                               │
    R ─ r_proj (W_R) ─ r ───┴─ (q + v)·r, shifted ── bias ──┼─ kernel ─ o_proj
    x ─ k_proj, v_proj ─ [SG(memory); new] (cache) ─ k, v ──┘

The layer is softmax attention (layer.py: its projections, kernels and dropout) with two
differences: the kernel gets q + u as its query and the scheme's positions bound to this
layer's q + v and W_R as its bias (`score_terms`; src/attnlab/nn/positional/xl_relative.py
holds u, v and R and explains the block-wise relative shift), and the keys and values are those
of [SG(memory); x] (`keys_values`). Projections have no biases, as in the original code
(qkv_net, o_net, r_net); no qk-norm, rotation or fused projections.

Segment-level recurrence (section 3.2) is the `memory` cache kind, this layer's default
(src/attnlab/cache/memory.py): the last `mem_len` positions of earlier segments, each
layer's input there (h_mem) and its keys and values, detached. The paper computes K and V of
[SG(h_mem); h] in every segment; in training this layer does the same from the stored inputs,
so that W_k and W_v get the memory's share of the gradient. Without gradients it reads the
stored K/V, which are those values (the weights have not moved, and with relative positions
no key depends on where the query stands), so decoding does not re-project the memory.
"""

from __future__ import annotations

import torch
from torch import nn

from ...cache.base import LayerKV
from .kernels.select import AUTO
from .layer import ATTENTIONS, Attention, AttnContext
from .xl_bias import XLPositions, XLRelativeBias


@ATTENTIONS.register("xl")
class XLAttention(Attention):
    cache_kind = "memory"  # what model.new_cache hands out by default
    fusable = False  # its own forward: keys and values of the memory as well (keys_values)

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        mem_len: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        segment_len: int | None = None,
        dropout: float = 0.0,
        kernel: str = AUTO,
        layer_index: int = 0,
    ) -> None:
        """Args: those of `Attention` (layer.py), without projection biases, and
        mem_len: positions of earlier segments kept as memory (the default of `new_cache`).
        segment_len: the segment length the memory cache folds after (None: each forward
            call is a segment); a runtime default too, see src/attnlab/cache/memory.py.
        layer_index: this layer's place in its stack, which picks its u, v when the scheme
            holds one pair per layer.
        """
        super().__init__(
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            dropout=dropout,
            kernel=kernel,
        )
        if mem_len < 0 or (segment_len is not None and segment_len < 1):
            raise ValueError(
                f"mem_len ({mem_len}) must be >= 0 and segment_len ({segment_len}) None or "
                f">= 1: they count positions"
            )
        self.r_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)  # W_R
        self.layer_index = layer_index
        self.cache_options = {"mem_len": mem_len, "segment_len": segment_len}

    def score_terms(self, q: torch.Tensor, ctx: AttnContext) -> tuple[torch.Tensor, XLRelativeBias]:
        """q (B, H, T, D) -> (q + u, (q + v)·W_R R · scale as a bias description)."""
        if not isinstance(ctx.bias, XLPositions):
            raise ValueError(
                "attention kind 'xl' needs the 'xl-relative' positional scheme, which supplies "
                f"R, u and v (got a context bias {type(ctx.bias).__name__}): set positional "
                "{'kind': 'xl-relative'}; it has no cross-attention form"
            )
        return ctx.bias.bind(q, self.r_proj, self.layer_index, self.scale)

    def keys_values(
        self, x: torch.Tensor, cache: LayerKV | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of [SG(memory); x], (B, H_kv, S, D). The new tokens' are projected here; the
        stored ones come from the cache, or, in training, are recomputed from the stored inputs
        SG(h_mem) with the current weights, so that W_k and W_v get the memory's gradient as in
        the paper (src/attnlab/cache/memory.py)."""
        k = self._heads(x, self.k_proj, self.n_kv_heads)  # (B, H_kv, T, D)
        v = self._heads(x, self.v_proj, self.n_kv_heads)
        if cache is None:
            return k, v
        h_mem = cache.remember(x)  # (B, S − T, d), or None: a cache that keeps no inputs
        k_all, v_all = cache.update(k, v)  # the stored K/V and the new, (B, H_kv, S, D)
        if h_mem is None or h_mem.shape[1] == 0 or not torch.is_grad_enabled():
            return k_all, v_all
        k_mem = self._heads(h_mem, self.k_proj, self.n_kv_heads)  # (B, H_kv, S − T, D)
        v_mem = self._heads(h_mem, self.v_proj, self.n_kv_heads)
        return torch.cat((k_mem, k), dim=2), torch.cat((v_mem, v), dim=2)

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        memory: torch.Tensor | None = None,
        cache: LayerKV | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d_model) -> (B, T, d_model) and, with need_weights, the (B, H, T, S)
        attention weights; `cache` a memory cache's layer (or any kind's: a static cache keeps
        every earlier key, a memory without bound, computed with the weights of its time)."""
        if memory is not None:
            raise ValueError(
                "attention kind 'xl' is self-attention over a segment memory; it has no "
                "cross-attention form: use arch 'decoder'"
            )
        q = self._heads(x, self.q_proj, self.n_heads)  # (B, H, T, D)
        k, v = self.keys_values(x, cache)  # (B, H_kv, S, D)
        q, bias = self.score_terms(q, ctx)
        return self.attend(q, k, v, ctx, bias, need_weights)  # (B, T, d_model), weights
