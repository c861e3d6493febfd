"""The static KV cache: preallocated (L, B, H_kv, max_len, D) buffers filled in order.

The simplest kind and the default: every row reserves max_len slots up front (gpt-fast's and
transformers' StaticCache), so writing a step is one in-place copy and reading is a view — no
allocation while decoding. Its cost is memory reserved for tokens that may never come (the paged
cache in paged.py gives it back).
"""

from __future__ import annotations

import torch

from .base import (
    CACHE_KINDS,
    CacheBase,
    CacheFullError,
    CacheShape,
    LayerView,
    advance,
    check_batch,
    stats_dict,
)


class _StaticLayer(LayerView):
    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, T = self.cache, k.shape[2]
        k_all, v_all = c.k.select(0, self.layer), c.v.select(0, self.layer)  # (B, H_kv, max_len, D)
        k_all.narrow(2, c.length - T, T).copy_(k)  # select / narrow / copy_: no indexing overhead
        v_all.narrow(2, c.length - T, T).copy_(v)
        return k_all.narrow(2, 0, c.length), v_all.narrow(2, 0, c.length)  # (B, H_kv, S, D)


class StaticKVCache(CacheBase):
    def __init__(self, shape: CacheShape) -> None:
        super().__init__(shape, _StaticLayer)
        B, S = shape.batch_size, shape.max_len
        buf = (shape.n_layers, B, shape.n_kv_heads, S, shape.head_dim)
        self.k = torch.zeros(buf, dtype=shape.dtype, device=shape.device)
        self.v = torch.zeros(buf, dtype=shape.dtype, device=shape.device)
        self.positions = torch.zeros(B, S, dtype=torch.long, device=shape.device)
        self.valid = torch.zeros(B, S, dtype=torch.bool, device=shape.device)

    def stats(self) -> dict:
        """Allocated (every row's max_len slots, up front) vs used (slots written) bytes."""
        B = self.batch_size
        return stats_dict(B * self.max_len, B * self.length, self.bytes_per_token())

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for T new tokens; returns (B, S) key positions and validity for all."""
        check_batch(self.batch_size, positions)
        T = positions.shape[1]
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise CacheFullError(
                f"KV cache too short: {end} positions needed ({start} stored + {T} new), "
                f"{self.max_len} available: create it with model.new_cache(..., max_len={end}) or more"
            )
        self.positions[:, start:end] = positions
        self.valid[:, start:end] = valid
        self.next_position = advance(self.next_position, positions, valid)
        self.length = end
        self.begin_forward()
        return self.positions[:, :end], self.valid[:, :end]

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows `index` (beam search): row i becomes old row index[i]. `cross` False
        leaves the cross-attention K/V alone: beams of one item share one source, so after the
        first expansion they never need moving."""
        self.k, self.v = self.k.index_select(1, index), self.v.index_select(1, index)
        self.reorder_rows(index, ("positions", "valid"), cross)


CACHE_KINDS.register("static")(StaticKVCache)
