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

    def dense(self) -> torch.Tensor | None:
        """(B, 1, T, S) bool, True = may attend; None when nothing is masked."""
        if self.is_empty:
            return None
        q = self.q_positions[:, :, None]  # (B, T) -> (B, T, 1)
        k = self.k_positions[:, None, :]  # (B, S) -> (B, 1, S)
        allowed = torch.ones(q.shape[0], q.shape[1], k.shape[2], dtype=torch.bool, device=q.device)
        if self.causal:
            allowed = allowed & (k <= q)  # (B, T, S) by broadcasting
        if self.window is not None:
            dist = q - k if self.causal else (q - k).abs()  # (B, T, S)
            allowed = allowed & (dist < self.window)
        if self.key_padding is not None:
            allowed = allowed & self.key_padding[:, None, :].bool()  # (B, S) -> (B, 1, S)
        return allowed[:, None]  # (B, T, S) -> (B, 1, T, S): one mask for every head
