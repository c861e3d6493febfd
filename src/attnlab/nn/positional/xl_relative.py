"""Transformer-XL's relative positional encoding (Dai et al. 2019, arXiv:1901.02860, section 3.3).

No position enters the embeddings or the keys. The score of query i and key j is

    A_ij = (q_i + u)·k_j + (q_i + v)·W_R R_{i−j}        (times 1/sqrt(d_head))

terms (a) + (c) and (b) + (d) of the paper's equation, where R_{i−j} is a sinusoid of the
offset alone, [sin((i−j)·ω), cos((i−j)·ω)] over d_model channels with ω = base^(−2f/d_model)
(all sines first, as the original code's and transformers' `PositionalEmbedding`), W_R a
bias-free projection per layer (its attention's `r_proj`, src/attnlab/nn/attention/xl.py), and
u, v learned (n_heads, head_dim) biases, shared by every layer as in the paper, or one pair per
layer (`per_layer_uv`, transformers' `untie_r`). This scheme holds u, v and the frequencies;
since keys carry no position, the keys of an earlier segment stay valid when positions move on,
which is what lets Transformer-XL keep them as a memory (src/attnlab/cache/memory.py).

How it reaches the kernels. The position term depends on the query, so it is not a bias a
scheme can evaluate alone. The stack calls `score_bias` once per pass and gets `XLPositions`:
the pass's positions and R at every offset they span. Each XL attention layer binds it to its
own query (`bind`): the kernel gets q + u as its query and an `XLRelativeBias`, whose
`block(rows, keys)` is (q + v)[rows] · r[offsets]ᵀ for the block's offsets (at most tq + tk − 1;
a causal stack clamps the masked negative ones to 0, leaving at most tk), gathered onto the
(tq, tk) grid — the paper's "relative shift", block by block.
So no (T, S) tensor exists outside the naive kernel, and the blocked kernels (chunked, tiled)
keep memory linear in the length, with the gradients of u, v and W_R flowing through the blocks.

Why not the other exact form: sin/cos of (i − j)ω factor into functions of i times functions of
j, so term (b) + (d) is a dot product of a d_model-wide query feature with [cos(jω), sin(jω)],
one sdpa call with heads d_head + d_model wide. That costs (d_head + d_model) / d_head times the
score work (9x at the paper's 64 and 512), and its features are sines of absolute positions,
which lose fp32 accuracy as positions keep counting across segments (sin of 10⁶·ω is good to
~1e-1 in fp32); the offsets here stay small integers whatever the position. The gathered block
costs about one more q·k product per block.

Divergence from the original code: it also applies the embedding dropout to R in training;
here R is exact (dropout stays on the embeddings and the residual branches).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.xl_bias import XLPositions, XLRelativeBias  # noqa: F401  (re-exported)
from .base import POSITIONAL, PositionalScheme


@POSITIONAL.register("xl-relative")
class XLRelativePositions(PositionalScheme):
    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        head_dim: int,
        n_layers: int,
        causal: bool,
        base: float = 10000.0,
        per_layer_uv: bool = False,
    ) -> None:
        """d_model: width of R (even); n_heads, head_dim: the shape of u and v; n_layers: how
        many pairs with per_layer_uv (else one pair for every layer); causal: the stack never
        attends to a negative offset i − j, so none is evaluated (its entries are masked);
        base: the sinusoid's wavelength base."""
        super().__init__()
        if d_model % 2:
            raise ValueError(f"d_model ({d_model}) must be even for R's sin/cos pairs")
        shape = (n_layers, n_heads, head_dim) if per_layer_uv else (n_heads, head_dim)
        self.u = nn.Parameter(torch.zeros(shape))  # content bias, term (c); init: INITS
        self.v = nn.Parameter(torch.zeros(shape))  # position bias, term (d)
        self.per_layer_uv, self.d_model, self.base = per_layer_uv, d_model, base
        self.causal = causal

    def embeddings(self, lo: int, hi: int, device=None) -> torch.Tensor:
        """R at every offset i − j in lo .. hi: (hi − lo + 1, d_model), [sin, cos]. In float64
        (L·d_model values, once per pass; no buffer, so a model cast to 16 bits keeps exact
        frequencies), cast to the query's dtype where it is used."""
        f64 = torch.float64
        inv_freq = self.base ** (
            -torch.arange(0, self.d_model, 2, dtype=f64, device=device) / self.d_model
        )
        offsets = torch.arange(lo, hi + 1, dtype=f64, device=device)  # (L,)
        angle = offsets[:, None] * inv_freq  # (L, d_model / 2)
        return torch.cat((angle.sin(), angle.cos()), dim=-1)  # (L, d_model)

    def biases(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """u, v of attention layer `layer`, (H, D) each."""
        if self.per_layer_uv:
            return self.u[layer], self.v[layer]
        return self.u, self.v

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> XLPositions:
        """The pass's positions and R over the offsets they span, for each layer to bind."""
        lo = int(q_positions.min() - k_positions.max())  # the smallest offset i − j
        hi = int(q_positions.max() - k_positions.min())
        if self.causal:  # keys ahead of a query are masked: clamp their offsets to 0
            lo, hi = max(lo, 0), max(hi, 0)
        R = self.embeddings(lo, hi, q_positions.device)
        return XLPositions(self, q_positions, k_positions, lo, R)
