"""What Transformer-XL's relative scheme hands its attention (Dai et al. 2019, arXiv:1901.02860,
section 3.3): `XLPositions` (the pass's positions and R, bound per layer to that layer's query and
W_R) and the bound `XLRelativeBias`, (q_i + v)·W_R R_{i−j}, evaluated block by block.

They sit beside the other attention inputs (bias.py, masks.py, rotation.py) so that the attention
layer (xl.py) imports no positional scheme; the scheme that makes them, and the derivation of
the block-wise relative shift, is src/attnlab/nn/positional/xl_relative.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .bias import ScoreBias


class UVBiases(Protocol):
    """The scheme's side of the binding: u, v of one layer and whether the stack is causal."""

    causal: bool

    def biases(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class XLPositions(ScoreBias):
    """What the stack hands every XL attention layer: positions and R, not yet a bias (its
    values depend on each layer's query and W_R: `bind`)."""

    scheme: UVBiases  # the scheme: u, v of each layer
    q_positions: torch.Tensor  # (B, T)
    k_positions: torch.Tensor  # (B, S)
    lo: int  # the offset of R's first row
    embeddings: torch.Tensor  # (L, d_model): R at offsets lo .. lo + L − 1

    def bind(
        self, q: torch.Tensor, r_proj: nn.Module, layer: int, scale: float
    ) -> tuple[torch.Tensor, XLRelativeBias]:
        """q (B, H, T, D) -> (q + u, the bias (q + v)·W_R R · scale as a description)."""
        u, v = self.scheme.biases(layer)  # (H, D) each
        H, D = u.shape
        r = r_proj(self.embeddings.to(q.dtype))  # (L, H·D)
        # (L, H·D) -> view (L, H, D) -> permute (H, L, D): one row per offset, per head
        r = r.view(-1, H, D).permute(1, 0, 2)
        qv = (q + v[None, :, None].to(q.dtype)) * scale  # (B, H, T, D); the kernel scales q·k
        bias = XLRelativeBias(
            qv, r, self.lo, self.q_positions, self.k_positions, self.scheme.causal
        )
        return q + u[None, :, None].to(q.dtype), bias

    def block(self, q: slice, k: slice | torch.Tensor) -> torch.Tensor:
        raise ValueError(
            "positional 'xl-relative' biases the scores through each layer's query and W_R: "
            "use attention kind 'xl' (src/attnlab/nn/attention/xl.py), which binds it"
        )


@dataclass(frozen=True)
class XLRelativeBias(ScoreBias):
    """(q_i + v)·W_R R_{i−j} · scale for one layer, evaluated per block: the block's offsets are
    a contiguous run of r's rows, one (rows × offsets) product, then the relative shift — each
    entry (i, j) picks its offset's column — as a gather onto (rows × keys)."""

    qv: torch.Tensor  # (B, H, T, D): (q + v) · scale
    r: torch.Tensor  # (H, L, D): W_R R at offsets lo .. lo + L − 1
    lo: int
    q_positions: torch.Tensor  # (B, T)
    k_positions: torch.Tensor  # (B, S)
    causal: bool  # negative offsets are masked: evaluated as offset 0 (any value would do)

    def block(self, q: slice, k: slice | torch.Tensor) -> torch.Tensor:
        rel = self.q_positions[:, q, None] - self.k_positions[:, None, k]  # (B, tq, tk): i − j
        if self.causal:  # a block then spans at most tk offsets, not tq + tk − 1
            rel = rel.clamp(min=0)
        first, last = int(rel.min()) - self.lo, int(rel.max()) - self.lo  # rows of r it needs
        # (B, H, tq, D) @ (H, D, n) -> (B, H, tq, n), n = last − first + 1 (at most tq + tk − 1
        # for consecutive positions, tk when causal): every (query, offset) pair of the block
        bd = torch.matmul(self.qv[:, :, q], self.r[:, first : last + 1].transpose(-1, -2))
        idx = (rel - self.lo - first)[:, None].expand(-1, bd.shape[1], -1, -1)  # (B, H, tq, tk)
        out = bd.gather(-1, idx)  # entry (i, j) = column of offset i − j: the relative shift
        return out.to(torch.promote_types(out.dtype, torch.float32))  # fp32, or f64 inputs'
