"""Transformer-XL attention (Dai et al. 2019, arXiv:1901.02860, sections 3.2-3.3): softmax
attention whose scores carry the relative position term of the `xl-relative` scheme, over the
keys of the current segment and a memory of earlier ones.

    x ─ q_proj ─ q ─┬─ + u ───────────────────────── query ─┐
                    └─ + v ─┐                               │
    R ─ r_proj (W_R) ─ r ───┴─ (q + v)·r, shifted ── bias ──┼─ kernel ─ o_proj
    x ─ k_proj, v_proj ─ [SG(memory); new] (cache) ─ k, v ──┘

The layer differs from softmax attention (layer.py) in one hook, `score_terms`: the kernel gets
q + u as its query and the scheme's positions bound to this layer's q + v and W_R as its bias
(src/attnlab/nn/positional/xl_relative.py holds u, v and R and explains the block-wise relative
shift). Projections have no biases, as in the original code (qkv_net, o_net, r_net).

Segment-level recurrence (section 3.2) is the `memory` cache kind, this layer's default
(src/attnlab/decode/cache/memory.py): the keys and values of the last `mem_len` positions of
earlier segments, detached, in front of the segment's own. They are exactly W_k·h_mem and
W_v·h_mem of the memory's hidden states (each layer's input), as the paper concatenates
[SG(h_mem); h] before its key and value projections, and with relative positions nothing in a
key depends on where the query stands, so they are computed once, when their tokens are new.
"""

from __future__ import annotations

import torch
from torch import nn

from ..positional.xl_relative import XLPositions, XLRelativeBias
from .layer import ATTENTIONS, Attention, AttnContext


@ATTENTIONS.register("xl")
class XLAttention(Attention):
    cache_kind = "memory"  # what model.new_cache hands out by default

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
        kernel: str = "sdpa",
        layer_index: int = 0,
    ) -> None:
        """Args: those of `Attention` (layer.py), without projection biases, and
        mem_len: positions of earlier segments kept as memory (the default of `new_cache`).
        segment_len: the segment length the memory cache folds after (None: each forward
            call is a segment); a runtime default too, see src/attnlab/decode/cache/memory.py.
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
