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

Relative biases (ALiBi, T5) depend on the offset k − q alone. Such a description also offers
`offsets(lo, hi)`: its (H, hi − lo + 1) values at every offset in [lo, hi]. Where a block's query
and key positions are consecutive (training, prefill, a cache), the block is a Toeplitz matrix of
that vector — entry (i, j) is the value at offset (k0 + j) − (q0 + i) — so it is built by one
strided copy (`toeplitz`) from tq + tk − 1 evaluations instead of tq · tk (T5: a log, a bucket and
a table lookup per entry), and in backward autograd sums each diagonal of the block's gradient
into its offset before the table sees it (unfold's backward), so the table's gradient also costs
tq + tk − 1 lookups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .masks import repeat_last

ALL = slice(None)
ScoreMod = Callable[..., torch.Tensor]  # (score, b, h, q_idx, kv_idx) -> score


class ScoreBias:
    """Base of every bias description: `block` evaluates it, `dense` is the whole of it."""

    def block(self, q: slice, k: slice | torch.Tensor) -> torch.Tensor:
        """(B or 1, H, tq, tk) float32 bias of queries `q` (a slice of T) × keys `k` (a slice
        of S, or the indices of a sparse pattern's keys)."""
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """(B or 1, H, T, S): the whole bias. For the naive kernel, and sdpa on calls of at most
        DENSE_ROWS query rows (kernels/base.py)."""
        return self.block(ALL, ALL)

    def offsets(self, lo: int, hi: int) -> torch.Tensor | None:
        """(H, hi − lo + 1) float32: the bias at every offset k − q in [lo, hi]; None when the
        bias is not a function of the offset alone (the default)."""
        return None

    def padded(self, B: int, T: int, S: int) -> ScoreBias | None:
        """The same bias over B ≥ B0 rows, T ≥ T0 queries × S ≥ S0 keys (what it is at the
        padding does not matter: those keys are masked, those queries and rows dropped); None
        when the kind cannot say (kernels/flex_buckets.py then runs at the exact shape)."""
        return None

    def score_mod(self) -> ScoreMod | None:
        """The bias as FlexAttention's `score_mod(score, b, h, q_idx, kv_idx) -> score + bias`
        (pointwise, from the description's own tensors, so gradients reach its parameters:
        kernels/flex.py); None when the bias is not pointwise (the default)."""
        return None


def start_if_consecutive(positions: torch.Tensor, idx: slice | torch.Tensor) -> int | None:
    """p0 when `positions[:, idx]` (B, n) is p0, p0 + 1, ... in every batch row, else None."""
    if not isinstance(idx, slice):
        return None
    p = positions[:, idx]  # (B, n)
    if p.numel() == 0:
        return None
    p0 = p[:1, :1]  # (1, 1)
    steps = torch.arange(p.shape[1], device=p.device, dtype=p.dtype)  # (n,)
    return int(p0) if bool((p == p0 + steps).all()) else None


def block_offsets(
    q_positions: torch.Tensor, k_positions: torch.Tensor, q: slice, k: slice | torch.Tensor
) -> tuple[int, int, int] | None:
    """(lo, tq, tk) when queries `q` and keys `k` sit at consecutive positions, lo the smallest
    offset k − q of the block (its bottom-left entry); None otherwise."""
    q0, k0 = start_if_consecutive(q_positions, q), start_if_consecutive(k_positions, k)
    if q0 is None or k0 is None:
        return None
    tq, tk = q_positions[:, q].shape[1], k_positions[:, k].shape[1]
    return k0 - (q0 + tq - 1), tq, tk


def toeplitz(values: torch.Tensor, tq: int, tk: int) -> torch.Tensor:
    """values (..., tq + tk − 1) at offsets lo .. hi -> (..., tq, tk) with entry (i, j) =
    values[tq − 1 − i + j], i.e. the value at offset lo + (tq − 1 − i) + j = (k0 + j) − (q0 + i).
    unfold gives the windows values[a : a + tk] (a view, rows in the order of rising offset);
    flipping the rows puts query i where offset falls as i grows, and makes it contiguous."""
    return values.unfold(-1, tk, 1).flip(-2)  # (..., tq, tk)


@dataclass(frozen=True)
class DenseBias(ScoreBias):
    """A bias already materialised, (B or 1, H, T, S)."""

    tensor: torch.Tensor

    def block(self, q: slice, k: slice) -> torch.Tensor:
        return self.tensor[:, :, q, k].float()

    def padded(self, B: int, T: int, S: int) -> DenseBias:
        t = self.tensor
        rows = 0 if t.shape[0] == 1 else B - t.shape[0]  # a broadcast batch stays one row
        pads = (0, S - t.shape[-1], 0, T - t.shape[-2], 0, 0, 0, rows)
        return DenseBias(torch.nn.functional.pad(t, pads))

    def score_mod(self) -> ScoreMod:
        t = self.tensor
        one_b, one_h = t.shape[0] == 1, t.shape[1] == 1  # broadcast dimensions read index 0

        def score_mod(score, b, h, q, kv):
            return score + t[b * 0 if one_b else b, h * 0 if one_h else h, q, kv]

        return score_mod


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

    def padded(self, B: int, T: int, S: int) -> LinearBias:
        return LinearBias(
            self.slopes, repeat_last(self.q_positions, B, T), repeat_last(self.k_positions, B, S),
            self.causal,
        )  # fmt: skip

    def score_mod(self) -> ScoreMod:
        slopes, qpos, kpos, causal = self.slopes, self.q_positions, self.k_positions, self.causal

        def score_mod(score, b, h, q, kv):
            rel = kpos[b, kv] - qpos[b, q]
            rel = rel if causal else -rel.abs()
            return score + slopes[h] * rel

        return score_mod

    def offsets(self, lo: int, hi: int) -> torch.Tensor:
        rel = torch.arange(lo, hi + 1, device=self.slopes.device).float()  # (L,)
        rel = rel if self.causal else -rel.abs()
        return self.slopes[:, None] * rel  # (H, L)


def as_bias(bias: ScoreBias | torch.Tensor | None) -> ScoreBias | None:
    """Kernels accept a description or a plain (B or 1, H, T, S) tensor."""
    return DenseBias(bias) if isinstance(bias, torch.Tensor) else bias
