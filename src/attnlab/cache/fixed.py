"""The fixed-shape KV cache: the static cache's buffers, read whole, for compiled decoding.

A static cache (static.py) returns `narrow(2, 0, length)`: the keys a step attends to grow by one
every token, so under `torch.compile` each token is a new shape (a recompile) and no CUDA graph
can be captured. This kind keeps every shape fixed, as transformers' `StaticLayer` and gpt-fast's
`KVCache` do:

    cursor      a (1,) device tensor, the next slot; advanced in place, never read by the host
    append      writes the new tokens' positions and validity at the cursor (`index_copy_`) and
                returns the whole (B, max_len) positions and validity: a slot not yet written
                is invalid, so the mask covers it
    update      `index_copy_`s the new K/V into the layer's (B, H_kv, max_len, D) buffers at the
                same slots and returns the whole buffers

Its `fixed_shape` flag tells the stack (src/attnlab/nn/stack.py) to skip its host shortcuts
(dropping an all-true padding mask, a decode step's mask), which read the device. `length`, the
slots written, is the host's own count (`append` adds T; a compiled step that bypasses `append`'s
host half advances it with `advance_host`), so capacity is checked before a step and no step
reads the device. What one step of this cache costs over the static one is attention over all
max_len slots (masked) instead of the filled ones: the price of one graph for every step.
"""

from __future__ import annotations

import torch

from .base import (
    CACHE_KINDS,
    CacheFullError,
    CacheShape,
    LayerView,
    advance,
    check_batch,
    reorder_cross,
)
from .static import StaticKVCache


class _FixedLayer(LayerView):
    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.store(self.layer, k, v)


class FixedKVCache(StaticKVCache):
    """The static cache's buffers and sizes (static.py), written at a device cursor and read
    whole."""

    fixed_shape = True  # the stack leaves its host-side shortcuts alone (nn/stack.py)

    def __init__(self, shape: CacheShape) -> None:
        super().__init__(shape)
        self.layers = [_FixedLayer(self, i) for i in range(shape.n_layers)]
        self.cursor = torch.zeros(1, dtype=torch.long, device=shape.device)  # the next slot
        self.slots = self.cursor.clone()  # the slots this forward pass writes (T,)

    def reserve(self, T: int) -> None:
        """The host half of `append`: check there is room for T more slots, count them."""
        end = self.length + T
        if end > self.max_len:
            raise CacheFullError(
                f"KV cache too short: {end} positions needed ({self.length} stored + {T} new), "
                f"{self.max_len} available: create it with model.new_cache(..., max_len={end}) or more"
            )
        self.length = end

    def write_slots(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The device half of `append`: no host reads, no Python state a compiled graph would
        guard on. Positions and validity go to the slots at the cursor, which moves past them;
        returns the whole (B, max_len) positions and validity."""
        T = positions.shape[1]
        self.slots = self.cursor + torch.arange(T, device=self.cursor.device)  # (T,)
        self.positions.index_copy_(1, self.slots, positions)
        self.valid.index_copy_(1, self.slots, valid)
        self.next_position.copy_(advance(self.next_position, positions, valid))
        self.cursor.add_(T)
        return self.positions, self.valid

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for T new tokens; returns (B, max_len) key positions and validity (the
        slots not yet written are invalid)."""
        check_batch(self.batch_size, positions)
        self.reserve(positions.shape[1])
        out = self.write_slots(positions, valid)
        self.begin_forward()
        return out

    def store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer `layer`'s new K/V (B, H_kv, T, D) at this pass's slots; returns the whole
        (B, H_kv, max_len, D) buffers."""
        k_all, v_all = self.k.select(0, layer), self.v.select(0, layer)
        k_all.index_copy_(2, self.slots, k.to(k_all.dtype))
        v_all.index_copy_(2, self.slots, v.to(v_all.dtype))
        return k_all, v_all

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows `index` (beam search): row i becomes old row index[i]. Of the same
        batch size the buffers are copied in place, so their addresses (a captured CUDA graph's
        inputs) stay; a new size (beam search's first expansion, before any compiled step)
        allocates new ones."""
        if index.numel() != self.batch_size:
            self.k, self.v = self.k.index_select(1, index), self.v.index_select(1, index)
            self.reorder_rows(index, ("positions", "valid"), cross)
            return
        for name in ("positions", "valid", "next_position"):
            t = getattr(self, name)
            t.copy_(t.index_select(0, index))
        self.k.copy_(self.k.index_select(1, index))
        self.v.copy_(self.v.index_select(1, index))
        if cross:
            reorder_cross(self.cross, index)


CACHE_KINDS.register("fixed")(FixedKVCache)
