"""KV caches: explicit decoding state, owned by the caller (see base.py for the protocol).

Importing this package registers every kind (static.py, fixed.py, sliding.py, paged.py,
recurrent.py, latent.py, memory.py); `new_cache` builds one by name. The paged cache keeps its K/V in a
`BlockPool` (blocks.py), which the engine's `RaggedPagedCache` (ragged.py, not a kind: rows of
their own lengths, no beams) shares.
"""

from . import fixed, latent, memory, paged, recurrent, sliding, static  # noqa: F401  (registration)
from .base import (
    CACHE_KINDS,
    CacheFullError,
    CacheGeometry,
    CacheShape,
    CrossKV,
    ForwardCache,
    KVCache,
    KVView,
    LayerKV,
)
from .blocks import BlockPool
from .fixed import FixedKVCache
from .latent import LatentKVCache
from .memory import MemoryKVCache
from .paged import PagedKVCache
from .ragged import RaggedPagedCache
from .recurrent import LayerState, RecurrentCache
from .sliding import SlidingKVCache
from .static import StaticKVCache


def new_cache(shape: CacheShape, kind: str = "static", **options) -> KVCache:
    """A cache of `kind` ("static", "fixed", "sliding", "paged", "recurrent", "latent",
    "memory") for a decoder of `shape`."""
    return CACHE_KINDS.get(kind)(shape, **options)


__all__ = [
    "CACHE_KINDS",
    "BlockPool",
    "CacheFullError",
    "CacheGeometry",
    "CacheShape",
    "CrossKV",
    "FixedKVCache",
    "ForwardCache",
    "KVCache",
    "KVView",
    "LatentKVCache",
    "LayerKV",
    "LayerState",
    "MemoryKVCache",
    "PagedKVCache",
    "RaggedPagedCache",
    "RecurrentCache",
    "SlidingKVCache",
    "StaticKVCache",
    "new_cache",
]
