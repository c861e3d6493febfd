"""KV caches: explicit decoding state, owned by the caller (DESIGN.md, "State and decoding").

The model hands one out (`model.new_cache(batch_size, max_len)`); `forward(..., cache=cache)`
appends the new tokens' keys and values and attends over everything stored. Keys are stored
*after* rotation, so each keeps the position it was computed at. GQA/MQA caches hold n_kv_heads,
not n_heads: that is where their memory saving comes from.

    StaticKVCache     preallocated (L, B, H_kv, max_len, D) buffers written at the next slots
    CrossKV           the encoder's K/V per decoder layer, computed on the first step, then reused

Each slot also records its position and whether it holds a real token (left-padded prompts
leave empty slots), which is all the mask needs.
"""

from __future__ import annotations

import torch


class CacheFullError(ValueError):
    """A cache too short for the tokens written to it."""


class _LayerView:
    def __init__(self, cache: StaticKVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer
        self.ready = False

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        start, end = c.length - k.shape[2], c.length
        c.k[self.layer, :, :, start:end] = k.to(c.k.dtype)
        c.v[self.layer, :, :, start:end] = v.to(c.v.dtype)
        return c.k[self.layer, :, :, :end], c.v[self.layer, :, :, :end]  # (B, H_kv, S, D)


class CrossKV:
    """The encoder K/V of one decoder layer: filled on first use, read on every later step."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def ready(self) -> bool:
        return self.k is not None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k, self.v = k, v
        return k, v


class StaticKVCache:
    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        cross_attention: bool = False,
    ) -> None:
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.length, self.max_len, self.batch_size = 0, max_len, batch_size
        self.layers = [_LayerView(self, i) for i in range(n_layers)]
        self.cross = [CrossKV() for _ in range(n_layers)] if cross_attention else None

    def bytes_per_token(self) -> int:
        """K and V bytes for one token of one sequence, all layers."""
        L, _, H_kv, _, D = self.k.shape
        return 2 * L * H_kv * D * self.k.element_size()

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for T new tokens; returns (B, S) key positions and validity for all."""
        B, T = positions.shape
        if self.batch_size != B:
            raise ValueError(f"cache was made for batch size {self.batch_size}, got a batch of {B}")
        start, end = self.length, self.length + T
        if end > self.max_len:
            raise CacheFullError(
                f"KV cache too short: {end} positions needed ({start} stored + {T} new), "
                f"{self.max_len} available: create it with model.new_cache(..., max_len={end}) or more"
            )
        self.positions[:, start:end] = positions
        self.valid[:, start:end] = valid
        last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=1)
        self.next_position = torch.maximum(self.next_position, last + 1)
        self.length = end
        return self.positions[:, :end], self.valid[:, :end]

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows `index` (beam search): row i becomes old row index[i]. `cross` False
        leaves the cross-attention K/V alone: beams of one item share one source, so after the
        first expansion they never need moving."""
        for name in ("k", "v"):
            setattr(self, name, getattr(self, name).index_select(1, index))
        self.positions = self.positions.index_select(0, index)
        self.valid = self.valid.index_select(0, index)
        self.next_position = self.next_position.index_select(0, index)
        self.batch_size = index.numel()
        if cross and self.cross is not None:
            for c in self.cross:
                if c.ready:
                    c.k, c.v = c.k.index_select(0, index), c.v.index_select(0, index)
