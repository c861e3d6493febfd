"""The fixed-shape KV cache: the static cache's buffers, read whole, for compiled decoding.

A static cache (static.py) returns `narrow(2, 0, length)`: the keys a step attends to grow by one
every token, so under `torch.compile` each token is a new shape (a recompile) and no CUDA graph
can be captured. This kind keeps every shape fixed, as transformers' `StaticLayer` and gpt-fast's
`KVCache` do:

    cursor      a (1,) device tensor, the next slot; advanced in place, never read by the host
    write       the new tokens' positions and validity at the given slots (`index_copy_`)
    store       the new K/V into the layer's (B, H_kv, max_len, D) buffers at the same slots

Eagerly (a prefill) it reads like the static cache, the filled slots only, so the prompt keeps
the kernels' fast paths. The compiled step (src/attnlab/decode/compiled_step.py) runs over
`graph_view()`, which writes the one slot `step_slot` through `write` and `store` and reads the
whole buffers: a slot not yet written is invalid, so the mask covers it, and the view's
`fixed_shape` tells the stack (src/attnlab/nn/stack.py) to skip its host shortcuts, which read
the device.
`length`, the slots written, is the host's own count (`reserve`), so capacity is checked before
a step and no step reads the device. What a compiled step costs over the static cache's is
attention over all max_len slots (masked) instead of the filled ones: the price of one graph
for every step.
"""

from __future__ import annotations

import torch

from .base import (
    CACHE_KINDS,
    CacheFullError,
    CacheShape,
    KVView,
    LayerView,
    advance,
    check_batch,
    reorder_cross,
)
from .static import StaticKVCache


class _FixedLayer(LayerView):
    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        k_all, v_all = c.store(self.layer, k, v, c.slots)
        return k_all[:, :, : c.length], v_all[:, :, : c.length]  # eager: the filled slots


class FixedKVCache(StaticKVCache):
    """The static cache's buffers and sizes (static.py), written at a device cursor. Eagerly
    (`append`, the layers' `update`: a prefill) it reads as the static cache does, the filled
    slots only, so a prompt keeps the kernels' fast paths; the compiled step writes through
    `write` and `store` with the one-slot `step_slot` and reads the whole buffers."""

    def __init__(self, shape: CacheShape) -> None:
        super().__init__(shape)
        self.layers = [_FixedLayer(self, i) for i in range(shape.n_layers)]
        self.cursor = torch.zeros(1, dtype=torch.long, device=shape.device)  # the next slot
        self.slots = self.cursor.clone()  # the slots an eager forward pass writes (T,)
        # the compiled step's slot: a buffer of its own, copied from the cursor in the graph, so
        # a captured CUDA graph reads and writes the same address at every replay
        self.step_slot = self.cursor.clone()
        self.in_use = False  # held by a decoding loop (decode/compiled_step.py reusable_cache)
        self._graph_view: FixedGraphView | None = None

    def graph_view(self) -> FixedGraphView:
        """The cache as the compiled step's graph sees it (one, kept: its inputs are this
        cache's buffers at fixed addresses)."""
        if self._graph_view is None:
            self._graph_view = FixedGraphView(self)
        return self._graph_view

    def reset(self) -> None:
        """Empty, for the next sequence of the same shape: the buffers (and a compiled step's
        graph over them) are kept."""
        self.valid.zero_()
        self.cursor.zero_()
        self.next_position.zero_()
        self.length = 0

    def reserve(self, T: int) -> None:
        """The host half of `append`: check there is room for T more slots, count them."""
        end = self.length + T
        if end > self.max_len:
            raise CacheFullError(
                f"KV cache too short: {end} positions needed ({self.length} stored + {T} new), "
                f"{self.max_len} available: create it with model.new_cache(..., max_len={end}) or more"
            )
        self.length = end

    def write(self, positions: torch.Tensor, valid: torch.Tensor, slots: torch.Tensor) -> None:
        """The device half of `append`: no host reads, no Python state a compiled graph would
        guard on. Positions and validity (B, T) go to `slots` (T,), the cursor moves past them."""
        self.positions.index_copy_(1, slots, positions)
        self.valid.index_copy_(1, slots, valid)
        self.next_position.copy_(advance(self.next_position, positions, valid))
        self.cursor.add_(positions.shape[1])

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for T new tokens; returns the (B, S) key positions and validity of the
        slots filled so far (S = length), as the static cache does."""
        check_batch(self.batch_size, positions)
        self.reserve(positions.shape[1])
        self.slots = self.cursor + torch.arange(positions.shape[1], device=self.cursor.device)
        self.write(positions, valid, self.slots)
        self.begin_forward()
        return self.positions[:, : self.length], self.valid[:, : self.length]

    def store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer `layer`'s new K/V (B, H_kv, T, D) at `slots`; returns the whole
        (B, H_kv, max_len, D) buffers."""
        k_all, v_all = self.k.select(0, layer), self.v.select(0, layer)
        k_all.index_copy_(2, slots, k.to(k_all.dtype))
        v_all.index_copy_(2, slots, v.to(v_all.dtype))
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


class _GraphLayer:
    """One layer of `FixedGraphView`: `update` stores and returns the whole buffers."""

    ready = False

    def __init__(self, cache: FixedKVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def update(self, k: torch.Tensor, v: torch.Tensor) -> KVView:
        return KVView.of(*self.cache.store(self.layer, k, v, self.cache.step_slot))

    def remember(self, x: torch.Tensor) -> None:
        return None


class FixedGraphView:
    """The device half of a FixedKVCache, as the compiled step's forward sees it (the stack's
    cache protocol with `fixed_shape`): no Python state changes from step to step, so the
    graph's guards hold for every step; `append` writes the one slot at the cursor and returns
    the whole (B, max_len) positions and validity (the slots not yet written are invalid)."""

    fixed_shape = True
    cross = None

    def __init__(self, cache: FixedKVCache) -> None:
        self.cache = cache
        self.layers = [_GraphLayer(cache, i) for i in range(len(cache.layers))]

    @property
    def next_position(self) -> torch.Tensor:
        return self.cache.next_position

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        c.step_slot.copy_(c.cursor)
        c.write(positions, valid, c.step_slot)
        return c.positions, c.valid


CACHE_KINDS.register("fixed")(FixedKVCache)
