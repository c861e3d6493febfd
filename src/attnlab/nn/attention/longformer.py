"""Longformer attention (Beltagy et al. 2020, arXiv:2004.05150, section 3.1): a sliding window
for every token plus a few global tokens, each with its own projections.

Local rows attend, with the usual projections, to the keys of their window and to every global
key (the mask says which: masks.py, `MaskSpec.local()`); global rows attend to every real key
with a second set of projections, q/k/v_global ("Linear Projections for Global Attention",
section 3.1), and their output replaces the local one:

    x ─ q_proj, k_proj, v_proj ──── kernel(mask: window ∪ global keys) ─────────┐
                                                                                ├─ o_proj
    x[global] ─ global_q_proj ─┐                                                │
    x ───────── global_k_proj ─┼─ kernel(mask: every real key) ─ global rows ───┘
    x ───────── global_v_proj ─┘

This is what transformers' LongformerSelfAttention computes (modeling_longformer.py): a local
row's scores are query·key over its window (|i − j| <= attention_window / 2) with global keys
counted once, in the same softmax, through the same `key` / `value`; a global row's are
query_global·key_global over every unpadded key, values from value_global; both scaled by
1/sqrt(head_dim). transformers runs the window as overlapping chunks and pads the sequence to a
multiple of the window; here the window is a mask description, so any blocked kernel skips what
no row of a block sees (memory and time linear in T), and no padding is needed.

The global rows are gathered into (B, G) slots (G the most global tokens of any sequence) and run
as one small kernel call: (B, H, G, S), never (T, S). Without global tokens the layer is
softmax attention over the window. Score biases (ALiBi, T5) are refused: they are bound to all T
rows, and the gathered global rows have none (config/attention.py refuses them too).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...cache.base import LayerKV
from .kernels.select import choose
from .layer import ATTENTIONS, Attention, AttnContext
from .masks import GlobalRows
from .rotation import Rotation


@ATTENTIONS.register("longformer")
class LongformerAttention(Attention):
    fusable = False  # its own forward: the global rows read q_proj's twin projections

    def __init__(self, *, qkv_bias: bool = True, o_bias: bool = True, **attention: Any) -> None:
        """Args: those of `Attention` (layer.py), with biases by default as in transformers;
        `qkv_bias` also applies to the global projections global_q_proj, global_k_proj,
        global_v_proj, which have the shapes of q_proj, k_proj, v_proj; q_norm / k_norm
        (qk-norm, not in transformers' Longformer) are shared by both sets. The window is the
        mask's (the stack's), not the layer's."""
        super().__init__(qkv_bias=qkv_bias, o_bias=o_bias, **attention)
        d, q, kv = self.d_model, self.q_proj.out_features, self.k_proj.out_features
        self.global_q_proj = nn.Linear(d, q, bias=qkv_bias)
        self.global_k_proj = nn.Linear(d, kv, bias=qkv_bias)
        self.global_v_proj = nn.Linear(d, kv, bias=qkv_bias)

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        memory: torch.Tensor | None = None,
        cache: LayerKV | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d_model) -> (B, T, d_model); global rows from ctx.mask.q_global."""
        mask = ctx.mask
        if mask is None or mask.q_global is None or not bool(mask.q_global.any()):
            return super().forward(x, ctx, memory, cache, need_weights)
        if memory is not None or cache is not None or need_weights or ctx.bias is not None:
            raise ValueError(
                "longformer attention with global tokens is self-attention of one whole "
                "sequence: no memory, cache, score bias or need_weights (got "
                f"memory={memory is not None}, cache={cache is not None}, "
                f"bias={ctx.bias is not None}, need_weights={need_weights})"
            )
        # local rows: window ∪ global keys, the usual projections; (B, T, d_model)
        out, _ = super().forward(x, replace(ctx, mask=mask.local()))
        rows = GlobalRows.of(mask.q_global)  # the global rows, packed into (B, G) slots
        q = self._heads(rows.gather(x), self.global_q_proj, self.n_heads)  # (B, H, G, D)
        k = self._heads(x, self.global_k_proj, self.n_kv_heads)  # (B, H_kv, S, D)
        v = self._heads(x, self.global_v_proj, self.n_kv_heads)  # (B, H_kv, S, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.rotation is not None:
            r = ctx.rotation  # cos/sin (B, T, R/2) -> the global rows' (B, G, R/2)
            q = Rotation(rows.gather(r.cos), rows.gather(r.sin), r.layout)(q)
            k = r(k)
        g_mask = mask.select_rows(rows)  # each slot a global row: every real key
        call = self.call(replace(ctx, mask=g_mask), None, False)
        g, _ = choose(self.kernel, q, k, v, call).kernel.fn(q, k, v, call)  # (B, H, G, D)
        B, H, G, D = g.shape
        # (B, H, G, D) -> transpose (B, G, H, D) -> reshape (B, G, H·D) -> o_proj (B, G, d_model)
        g = self.o_proj(g.transpose(1, 2).reshape(B, G, H * D))
        return rows.scatter(out, g.to(out.dtype)), None  # (B, T, d_model)
