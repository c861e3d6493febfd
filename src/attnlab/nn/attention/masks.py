"""Masks as descriptions, not tensors.

A `MaskSpec` says which keys each query may see, in terms of explicit positions: causal
(k <= q), a sliding window (q - k < window, or |q - k| < window without causality), key padding,
and — because q and k positions are explicit — the query offset of decoding with a cache. A kernel
can exploit the structure (sdpa's `is_causal` fast path when the mask is plain causal); the naive
kernel materialises it with `dense()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MaskSpec:
    q_positions: torch.Tensor  # (B, T) position of each query
    k_positions: torch.Tensor  # (B, S) position of each key
    causal: bool = False
    window: int | None = None
    key_padding: torch.Tensor | None = None  # (B, S) bool, True = real token
    aligned: bool = False  # q and k positions are both 0..T-1 in every row (no cache, no offset)

    @property
    def is_plain_causal(self) -> bool:
        """Exactly the lower-triangular mask of a square, unpadded, uncached sequence."""
        return self.causal and self.aligned and self.window is None and self.key_padding is None

    @property
    def is_empty(self) -> bool:
        """Every query sees every key."""
        return not self.causal and self.window is None and self.key_padding is None

    @property
    def is_structured(self) -> bool:
        """Whether the mask limits keys by position (causal or window), beyond padding."""
        return self.causal or self.window is not None

    def block(self, q: slice, k: slice, padding: bool = True) -> torch.Tensor | None:
        """(B, 1, tq, tk) bool for queries `q` × keys `k` (slices of T and S), True = may attend;
        None when nothing is masked. `padding` False leaves key padding out (the positional part
        alone, which decides what key ranges a block of queries can skip)."""
        if self.is_empty or (not padding and not self.is_structured):
            return None
        qp = self.q_positions[:, q, None]  # (B, T) -> (B, tq, 1)
        kp = self.k_positions[:, None, k]  # (B, S) -> (B, 1, tk)
        allowed = torch.ones(
            qp.shape[0], qp.shape[1], kp.shape[2], dtype=torch.bool, device=qp.device
        )
        if self.causal:
            allowed = allowed & (kp <= qp)  # (B, tq, tk) by broadcasting
        if self.window is not None:
            dist = qp - kp if self.causal else (qp - kp).abs()  # (B, tq, tk)
            allowed = allowed & (dist < self.window)
        if padding and self.key_padding is not None:
            allowed = allowed & self.key_padding[:, None, k].bool()  # (B, tk) -> (B, 1, tk)
        return allowed[:, None]  # (B, tq, tk) -> (B, 1, tq, tk): one mask for every head

    def visible_keys(self, rows: slice) -> slice | torch.Tensor:
        """The keys some query of `rows` may see by position (causal edge, window; padding aside),
        so that a blocked kernel can skip the rest: a slice when they are contiguous, else their
        sorted indices (a pattern with gaps); slice(None) when that is every key."""
        allowed = self.block(rows, slice(None), padding=False)  # (B, 1, rows, S), or None
        if allowed is None:
            return slice(None)
        idx = allowed.any(dim=(0, 1, 2)).nonzero().flatten()  # (n_seen,) key indices, sorted
        n, S = idx.numel(), allowed.shape[-1]
        if n in (0, S):  # nothing seen (rows of padding) or everything: no skipping
            return slice(None)
        first, last = int(idx[0]), int(idx[-1])
        return slice(first, last + 1) if last - first + 1 == n else idx

    def dense(self) -> torch.Tensor | None:
        """(B, 1, T, S) bool, True = may attend; None when nothing is masked."""
        return self.block(slice(None), slice(None))
