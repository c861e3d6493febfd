"""What every KV-cache kind shares: the protocol, the shape it is built from, the per-layer view
and the cross-attention store.

The model hands a cache out (`model.new_cache(batch_size, max_len, kind=...)`, see
src/attnlab/nn/model.py); `forward(..., cache=cache)` appends the new tokens' keys and values and
attends over everything stored. Keys are stored *after* rotation, so each keeps the position it
was computed at. GQA/MQA caches hold n_kv_heads, not n_heads: that is where their memory saving
comes from. The kinds, one file each in this folder:

    "static"    StaticKVCache   preallocated (L, B, H_kv, max_len, D) buffers, filled in order
    "fixed"     FixedKVCache    the same buffers read whole, every step one shape (fixed.py:
                                compiled decoding, CUDA graphs)
    "sliding"   SlidingKVCache  a ring of the last `window` slots per row (sliding.py)
    "paged"     PagedKVCache    blocks from a shared BlockPool, a block table per row (paged.py,
                                blocks.py; the engine's RaggedPagedCache, ragged.py, is its sibling)
    "recurrent" RecurrentCache  linear attention's running state (recurrent.py)
    "latent"    LatentKVCache   MLA's compressed entries, stored once (latent.py)
    "memory"    MemoryKVCache   Transformer-XL's segment memory (memory.py)
    CrossKV                     the encoder's K/V per decoder layer, computed once, then reused

Every kind offers one interface (`KVCache` below), so the stack and the attention layer never ask
which is in use; a forward pass calls `append` once, then each layer's `update` once
(`ForwardCache` spells out the order, and the layer views check it). Each slot records its
position and whether it holds a real token (left-padded prompts leave empty slots), which is all
the mask needs; key order is free (softmax does not care), which lets a ring buffer or a block
table hand keys over in storage order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ..registry import Registry


class CacheFullError(ValueError):
    """A cache too short for the tokens written to it (or a paged pool out of blocks)."""


@dataclass(frozen=True)
class CacheGeometry:
    """What a model tells about its decoder's cache before any batch exists
    (`model.cache_geometry()`): sizes, the cache kind its attention declares and that kind's
    default options, and where the weights live."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    kind: str  # the attention's own cache kind: "static", "recurrent", "memory"
    options: dict = field(default_factory=dict, hash=False)  # the kind's defaults (XL: mem_len)
    window: int | None = None  # the decoder's sliding window, if it has one
    dtype: torch.dtype = torch.float32
    device: torch.device | str | None = None
    cross_attention: bool = False

    def shape(
        self, batch_size: int, max_len: int, dtype: torch.dtype | None = None, device=None
    ) -> CacheShape:
        """The CacheShape of a cache of batch_size rows and max_len slots; dtype and device
        default to the weights'."""
        return CacheShape(
            self.n_layers,
            batch_size,
            max_len,
            self.n_kv_heads,
            self.head_dim,
            dtype or self.dtype,
            device or self.device,
            self.cross_attention,
            self.window,
        )


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


@runtime_checkable
class LayerKV(Protocol):
    """One attention layer's store inside a cache (`cache.layers[i]`, `cache.cross[i]`)."""

    @property
    def ready(self) -> bool:
        """True when K/V are already stored and need not be computed (cross-attention only)."""
        ...

    def update(self, k: torch.Tensor, v: torch.Tensor) -> KVView:
        """Store the new K/V (B, H_kv, T, D) in the slots this forward pass's `append` reserved;
        return every key/value the step attends to (B, H_kv, S, D), in the order `append`
        returned their positions: a `KVView`, which unpacks as the pair (`k, v = view`) and, on
        the pooled kinds' one-token steps, also carries the pool as a kernel reads it in place
        (`pages`, blocks.py; None elsewhere).
        Once per layer and forward pass: a self-attention update without a preceding append
        raises RuntimeError (cross-attention stores are filled once per source and take no
        append)."""
        ...

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored K/V, once `ready`."""
        ...

    def remember(self, x: torch.Tensor) -> torch.Tensor | None:
        """Keep the layer's input for the new tokens (B, T, d_model) and return the inputs kept
        before them, for a layer that recomputes old K/V (Transformer-XL in training); None from
        a kind that keeps no inputs (all but memory.py's)."""
        ...


@runtime_checkable
class ForwardCache(Protocol):
    """What one forward pass needs of a cache: the protocol between the stack
    (src/attnlab/nn/stack.py), the attention layers and every cache kind. In this order:

        1. k_pos, k_valid = cache.append(positions, valid)   once per forward pass: reserve
           slots for the T new tokens, record their positions and validity; returns the (B, S)
           positions and validity of every key the step attends to (what the mask needs)
        2. k_all, v_all = cache.layers[i].update(k, v)       once per layer: store the new K/V
           in the slots (1) reserved; returns (B, H_kv, S, D) in the order of (1)

    `update` reads what `append` set up for this pass (the slots, the ring position), so an
    update with no append before it, or a second update of one layer after one append, raises
    RuntimeError instead of writing over other tokens' slots (LayerView.check_order)."""

    layers: list[LayerKV]
    cross: list[CrossKV] | None  # encoder K/V per decoder layer (encoder-decoder models)
    next_position: torch.Tensor  # (B,) the position the next real token of each row gets
    # True for a compiled step's view (fixed.py, ragged.py `graph_view`): every shape fixed and
    # nothing read from the device, so the stack skips its host shortcuts
    fixed_shape: bool

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for T new tokens (positions, valid: (B, T)); return the (B, S) position
        and validity of every key the step attends to."""
        ...


@runtime_checkable
class KVCache(ForwardCache, Protocol):
    """The decoding state a model's forward takes as `cache=` (and returns in ModelOutput):
    a forward pass's protocol (ForwardCache) plus what the decoding loops need (beam search's
    reorder, freeing finished rows, sizes). Every kind in CACHE_KINDS implements it."""

    length: int  # slots written per row so far
    batch_size: int

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows `index` (beam search): row i becomes old row index[i]."""
        ...

    def finish(self, done: torch.Tensor) -> None:
        """Rows where `done` (B,) is True will not be read again (their memory may be freed)."""
        ...

    def bytes_per_token(self) -> int: ...

    def stats(self) -> dict: ...


# kind name -> factory(shape, **options); each kind's module registers itself
CACHE_KINDS: Registry[Callable[..., KVCache]] = Registry("KV cache kind")


class CacheBase:
    """The parts every kind shares: sizes, per-layer views, cross-attention K/V, bookkeeping."""

    fixed_shape = False  # an eager cache: the stack may read it on the host

    def __init__(self, shape: CacheShape, layer_view: type[LayerView]) -> None:
        self.shape = shape
        self.length, self.max_len, self.batch_size = 0, shape.max_len, shape.batch_size
        self.next_position = torch.zeros(shape.batch_size, dtype=torch.long, device=shape.device)
        self.layers = [layer_view(self, i) for i in range(shape.n_layers)]
        self.cross = [CrossKV() for _ in range(shape.n_layers)] if shape.cross_attention else None
        self.forwards = 0  # forward passes opened by `append` (the order LayerView checks)

    def begin_forward(self) -> None:
        """Open a forward pass, in which each layer may `update` once: every kind's `append`
        calls this once its slots are reserved."""
        self.forwards += 1

    def bytes_per_token(self) -> int:
        """K and V bytes for one token of one sequence, all layers."""
        s = self.shape
        return kv_bytes(s.n_layers, s.n_kv_heads, s.head_dim, s.dtype.itemsize)

    def reorder_rows(self, index: torch.Tensor, names: tuple[str, ...], cross: bool) -> None:
        """What every `reorder` shares: the per-row tensors `names` (batch first) and
        next_position follow `index`, the batch size becomes its length, and the cross-attention
        K/V follow too unless `cross` is False."""
        for name in (*names, "next_position"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        self.batch_size = index.numel()
        if cross:
            reorder_cross(self.cross, index)

    def finish(self, done: torch.Tensor) -> None:
        """Rows `done` (B,) bool will not be read again. Buffers preallocated per row are freed
        only with the whole cache, so there is nothing to do (the paged cache returns blocks)."""


@dataclass(frozen=True)
class PagedKV:
    """One layer's pool as a one-token decode step reads it in place (blocks.py `_PoolLayer`):
    k, v (H_kv, P, D) every slot of the pool; slots (B, S) each row's slot table; lengths (B,)
    how many of its slots row b attends to (its first n_b, the new key last); block_size: the
    pool's (a row's slots j·bs .. j·bs + bs − 1 lie in one block), 0 where unknown; step: what
    a kernel derives once per forward pass from the slots and lengths and every layer of the pass
    reuses (one dict per pass, owned by the cache: paged_flex.py keeps its BlockMask there)."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    block_size: int = 0
    step: dict = field(default_factory=dict, compare=False, repr=False)
    blocks: BlockVisits | None = None  # the rows' blocks as a block-sparse kernel visits them


@dataclass(frozen=True)
class BlockVisits:
    """Which pool blocks each row's one-token step visits, for a block-sparse kernel
    (paged_flex.py's BlockMask), made before the step by the cache (blocks.py `visits`):
    used (B,) blocks row b reads; indices (B, N) those physical blocks in table order, then 0;
    ordinal (B, N) each physical block's place in row b's table, −1 where not the row's
    (N: the pool's blocks, scratch included)."""

    used: torch.Tensor
    indices: torch.Tensor
    ordinal: torch.Tensor


class KVView:
    """What every layer's `update` returns: the dense (B, H_kv, S, D) pair the step attends to
    (`k, v = view`), and `pages`: on a pooled cache's one-token step the pool as a kernel reads
    it in place (layout "paged": nn/attention/kernels/paged.py, paged_flex.py), the pair then
    gathered from the pool only when it is unpacked (a layer whose kernels do not read the
    pool, or a layer kind that takes only the pair); None elsewhere (`KVView.of(k, v)`)."""

    def __init__(
        self,
        pages: PagedKV | None,
        gather: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> None:
        self.pages, self._gather = pages, gather
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> KVView:
        """The view of a pair already at hand (no pool to read)."""
        view = cls(None, None)
        view._pair = (k, v)
        return view

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pair is None:
            self._pair = self._gather()
        return self._pair

    def __iter__(self):
        return iter(self.dense())

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.dense()[i]

    def __len__(self) -> int:
        return 2


class LayerView:
    """Layer `layer` of a cache: the object the attention layer calls `update` on. A kind
    implements `store` (write the new K/V where `append` said, return what is attended to);
    `update` checks the protocol's order first."""

    ready = False  # self-attention K/V are always computed from the new tokens

    def __init__(self, cache: CacheBase, layer: int) -> None:
        self.cache, self.layer = cache, layer
        self.stored_in = 0  # the forward pass (cache.forwards) this layer last stored into

    def update(self, k: torch.Tensor, v: torch.Tensor) -> KVView:
        self.check_order()
        out = self.store(k, v)
        return out if isinstance(out, KVView) else KVView.of(*out)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | KVView:
        """Write the new K/V where `append` said; what is attended to, a pair or a KVView."""
        raise NotImplementedError

    def remember(self, x: torch.Tensor) -> torch.Tensor | None:
        return None  # this kind keeps no layer inputs (cache/memory.py does)

    def check_order(self) -> None:
        """RuntimeError unless `append` opened a forward pass this layer has not stored into."""
        opened = self.cache.forwards
        if self.stored_in == opened:
            why = "no append yet" if opened == 0 else "it already stored after the last append"
            raise RuntimeError(
                f"cache.layers[{self.layer}].update() without a preceding cache.append() "
                f"({why}): call cache.append(positions, valid) once per forward pass (the "
                f"stack does), then each layer's update once"
            )
        self.stored_in = opened

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("self-attention K/V are read through update(), which stores them")


class CrossKV:
    """The encoder K/V of one decoder layer: filled on first use, read on every later step."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def ready(self) -> bool:
        return self.k is not None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> KVView:
        self.k, self.v = k, v
        return KVView.of(k, v)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None or self.v is None:
            raise RuntimeError("cross-attention K/V read before the first update")
        return self.k, self.v


def kv_bytes(n_layers: int, n_kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """K and V bytes of one token of one sequence: 2 · L · H_kv · D · bytes. GQA/MQA divide it
    by n_heads / n_kv_heads; this is the number that decides how many tokens fit in memory."""
    return 2 * n_layers * n_kv_heads * head_dim * bytes_per_value


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
