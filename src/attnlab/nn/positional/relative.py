"""T5 relative position bias (Raffel et al. 2020, section 2.1; Shaw et al. 2018).

A learned scalar per (bucket, head) is added to the attention scores. Offsets k - q are bucketed:
half the buckets are exact small distances, the rest log-spaced up to `max_distance`, beyond which
everything shares the last bucket. Bidirectional stacks (encoders) spend half the buckets on each
direction; causal stacks only look back. One table per stack, shared by all its layers (T5 stores
it in the first layer and passes the bias down); cross-attention gets no bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..attention.bias import ScoreBias, block_offsets, toeplitz
from ..attention.masks import repeat_last
from .base import POSITIONAL, PositionalScheme


def t5_bucket(
    relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket index for each relative offset k - q (any shape, integer tensor)."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative > 0).long() * num_buckets
        n = relative.abs()
    else:
        n = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # log-spaced buckets from max_exact to max_distance; computed in float, floored like T5
    large = (
        max_exact
        + (
            torch.log(n.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, n, large)


@POSITIONAL.register("t5-relative")
class T5RelativeBias(PositionalScheme):
    def __init__(
        self, *, n_heads: int, causal: bool, num_buckets: int = 32, max_distance: int = 128
    ) -> None:
        """n_heads: one learned scalar per (bucket, head); causal: decoders bucket only the past,
        encoders spend half the buckets on each direction; max_distance: where the last
        log-spaced bucket starts."""
        super().__init__()
        self.bidirectional = not causal
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, n_heads)

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> BucketBias:
        """A description the kernels evaluate per block (the table's gradient flows through)."""
        return BucketBias(self, q_positions, k_positions)


@dataclass(frozen=True)
class BucketBias(ScoreBias):
    """T5's bias for one pass: bucket(k − q) looked up in the scheme's table, block by block."""

    scheme: T5RelativeBias
    q_positions: torch.Tensor  # (B, T)
    k_positions: torch.Tensor  # (B, S)

    def block(self, q: slice, k: slice | torch.Tensor) -> torch.Tensor:
        """Consecutive positions (training, prefill, a cache): the Toeplitz matrix of the
        block's tq + tk − 1 offsets (bias.py, `toeplitz`); else bucket every (query, key)."""
        s = self.scheme
        span = block_offsets(self.q_positions, self.k_positions, q, k)
        if span is not None:
            lo, tq, tk = span
            return toeplitz(self.offsets(lo, lo + tq + tk - 2), tq, tk)[None]  # (1, H, tq, tk)
        rel = self.k_positions[:, None, k] - self.q_positions[:, q, None]  # (B, tq, tk)
        buckets = t5_bucket(rel.long(), s.bidirectional, s.num_buckets, s.max_distance)
        # (B, tq, tk) -> (B, tq, tk, H) -> (B, H, tq, tk)
        return s.relative_attention_bias(buckets).permute(0, 3, 1, 2).float()

    def padded(self, B: int, T: int, S: int) -> BucketBias:
        q, k = repeat_last(self.q_positions, B, T), repeat_last(self.k_positions, B, S)
        return BucketBias(self.scheme, q, k)

    def score_mod(self):
        """bucket(k − q) looked up per score: the table's gradient reaches it through flex's
        backward (captured tensors that require grad)."""
        s = self.scheme
        table, qpos, kpos = s.relative_attention_bias.weight, self.q_positions, self.k_positions

        def score_mod(score, b, h, q, kv):
            rel = (kpos[b, kv] - qpos[b, q]).long()
            bucket = t5_bucket(rel, s.bidirectional, s.num_buckets, s.max_distance)
            return score + table[bucket, h]

        return score_mod

    def offsets(self, lo: int, hi: int) -> torch.Tensor:
        s = self.scheme
        rel = torch.arange(lo, hi + 1, device=self.q_positions.device)  # (L,) offsets k − q
        buckets = t5_bucket(rel, s.bidirectional, s.num_buckets, s.max_distance)  # (L,)
        return s.relative_attention_bias(buckets).t().float()  # (L, H) -> (H, L)
