"""Score biases as descriptions, not tensors (like masks, masks.py).

A positional scheme that biases the attention scores (ALiBi, T5's relative buckets, ...) hands the
kernel a `ScoreBias`: an object bound to the pass's query and key positions that evaluates the
bias for any block of queries × range of keys,

    bias.block(q_slice, k_slice) -> (B or 1, H, tq, tk) float32,

so a kernel that works block by block never holds the whole (B, H, T, S) bias; only the naive
kernel (the oracle) asks for `dense()`. Learnable parameters (T5's table) stay inside the
description, so gradients reach them through whichever blocks are evaluated.

`LinearBias` is the structure kernels can exploit beyond blocking: slope_h · (k − q), linear in
the key position, which a softmax row sees as slope_h · k plus a per-row constant — so one extra
q/k channel carries it through torch's fused sdpa (kernels/alibi.py). `DenseBias` wraps a
ready-made tensor (tests, hand-written experiments).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALL = slice(None)


class ScoreBias:
    """Base of every bias description: `block` evaluates it, `dense` is the whole of it."""

    def block(self, q: slice, k: slice | torch.Tensor) -> torch.Tensor:
        """(B or 1, H, tq, tk) float32 bias of queries `q` (a slice of T) × keys `k` (a slice
        of S, or the indices of a sparse pattern's keys)."""
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """(B or 1, H, T, S): the whole bias. Only the naive kernel should need it."""
        return self.block(ALL, ALL)


@dataclass(frozen=True)
class DenseBias(ScoreBias):
    """A bias already materialised, (B or 1, H, T, S)."""

    tensor: torch.Tensor

    def block(self, q: slice, k: slice) -> torch.Tensor:
        return self.tensor[:, :, q, k].float()


@dataclass(frozen=True)
class LinearBias(ScoreBias):
    """slope_h · (k − q) (causal), or −slope_h · |k − q| (bidirectional): ALiBi's bias."""

    slopes: torch.Tensor  # (H,) float32
    q_positions: torch.Tensor  # (B, T)
    k_positions: torch.Tensor  # (B, S)
    causal: bool

    def block(self, q: slice, k: slice) -> torch.Tensor:
        rel = self.k_positions[:, None, k] - self.q_positions[:, q, None]  # (B, tq, tk)
        rel = rel.float() if self.causal else -rel.abs().float()
        return self.slopes[None, :, None, None] * rel[:, None]  # (B, H, tq, tk)


def as_bias(bias: ScoreBias | torch.Tensor | None) -> ScoreBias | None:
    """Kernels accept a description or a plain (B or 1, H, T, S) tensor."""
    return DenseBias(bias) if isinstance(bias, torch.Tensor) else bias
