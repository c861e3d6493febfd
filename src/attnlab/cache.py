"""KV caches: explicit decoding state, owned by the caller (DESIGN.md, "State and decoding").

The model hands one out (`model.new_cache(batch_size, max_len, kind=...)`); `forward(...,
cache=cache)` appends the new tokens' keys and values and attends over everything stored. Keys
are stored *after* rotation, so each keeps the position it was computed at. GQA/MQA caches hold
n_kv_heads, not n_heads: that is where their memory saving comes from.

    "static"   StaticKVCache   preallocated (L, B, H_kv, max_len, D) buffers, filled in order
    "sliding"  SlidingKVCache  a ring of the last `window` slots per row (cache_sliding.py)
    "paged"    PagedKVCache    blocks from a shared pool, a block table per row (cache_paged.py)
    CrossKV                    the encoder's K/V per decoder layer, computed once, then reused

Every kind offers one interface, so the stack and the attention layer never ask which is in use:

    append(positions, valid) -> (k_positions, k_valid)   reserve slots for T new tokens (B, T);
                                  returns position and validity of every key the step attends to
    layers[i].update(k, v)   -> (k, v)                   store layer i's new K/V (B, H_kv, T, D),
                                  return all keys the step attends to (B, H_kv, S, D), same order
    cross, next_position, length, batch_size, reorder(index, cross=True), finish(done),
    bytes_per_token(), stats()

Each slot records its position and whether it holds a real token (left-padded prompts leave
empty slots), which is all the mask needs; key order is free (softmax does not care), which
lets a ring buffer or a block table hand keys over in storage order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .registry import Registry


class CacheFullError(ValueError):
    """A cache too short for the tokens written to it (or a paged pool out of blocks)."""


@dataclass(frozen=True)
class CacheShape:
    """What every cache kind is built from: the decoder's sizes and the runtime choices."""

    n_layers: int
    batch_size: int
    max_len: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str | None = None
    cross_attention: bool = False
    window: int | None = None  # the decoder's sliding window, if it has one


# kind name -> factory(shape, **options); cache_sliding.py and cache_paged.py add theirs
CACHE_KINDS: Registry[Callable[..., object]] = Registry("KV cache kind")


def stats_dict(allocated_tokens: int, used_tokens: int, per_token: int, **extra) -> dict:
    """allocated vs used bytes; `waste` is the allocated bytes that hold no token."""
    allocated, used = allocated_tokens * per_token, used_tokens * per_token
    return {
        "allocated_bytes": allocated,
        "used_bytes": used,
        "waste_bytes": allocated - used,
        "waste_fraction": (allocated - used) / allocated if allocated else 0.0,
        **extra,
    }


class _LayerView:
    def __init__(self, cache: StaticKVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer
        self.ready = False

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, T = self.cache, k.shape[2]
        k_all, v_all = c.k.select(0, self.layer), c.v.select(0, self.layer)  # (B, H_kv, max_len, D)
        k_all.narrow(2, c.length - T, T).copy_(k)  # select / narrow / copy_: no indexing overhead
        v_all.narrow(2, c.length - T, T).copy_(v)
        return k_all.narrow(2, 0, c.length), v_all.narrow(2, 0, c.length)  # (B, H_kv, S, D)


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


def reorder_cross(cross: list[CrossKV] | None, index: torch.Tensor) -> None:
    for c in cross or ():
        if c.ready:
            c.k, c.v = c.k.index_select(0, index), c.v.index_select(0, index)


def check_batch(expected: int, positions: torch.Tensor) -> None:
    if positions.shape[0] != expected:
        raise ValueError(
            f"cache was made for batch size {expected}, got a batch of {positions.shape[0]}"
        )


def advance(next_position: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor):
    """The next free position per row after writing `positions` where `valid`."""
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=1)
    return torch.maximum(next_position, last + 1)


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
        return self.positions[:, :end], self.valid[:, :end]

    def finish(self, done: torch.Tensor) -> None:
        """Rows `done` (B,) bool will not be read again. Static buffers are freed only with the
        whole cache, so there is nothing to do (the paged cache returns their blocks)."""

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
        if cross:
            reorder_cross(self.cross, index)


@CACHE_KINDS.register("static")
def _static(shape: CacheShape) -> StaticKVCache:
    return StaticKVCache(
        shape.n_layers,
        shape.batch_size,
        shape.max_len,
        shape.n_kv_heads,
        shape.head_dim,
        shape.dtype,
        shape.device,
        shape.cross_attention,
    )


def new_cache(shape: CacheShape, kind: str = "static", **options):
    """A cache of `kind` ("static", "sliding", "paged") for a decoder of `shape`."""
    from . import cache_paged, cache_sliding  # noqa: F401  (they register their kinds)

    return CACHE_KINDS.get(kind)(shape, **options)
