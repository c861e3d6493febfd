"""KV caches: explicit decoding state, owned by the caller (see base.py for the protocol).

Importing this package registers every kind (static.py, sliding.py, paged.py, recurrent.py,
latent.py, memory.py); `new_cache` builds one by name.
"""

from . import latent, memory, paged, recurrent, sliding, static  # noqa: F401  (registration)
from .base import CACHE_KINDS, CacheFullError, CacheShape, CrossKV, KVCache, LayerKV
from .latent import LatentKVCache
from .memory import MemoryKVCache
from .paged import PagedKVCache
from .recurrent import LayerState, RecurrentCache
from .sliding import SlidingKVCache
from .static import StaticKVCache


def new_cache(shape: CacheShape, kind: str = "static", **options) -> KVCache:
    """A cache of `kind` ("static", "sliding", "paged", "recurrent", "latent", "memory") for a
    decoder of `shape`."""
    return CACHE_KINDS.get(kind)(shape, **options)


__all__ = [
    "CACHE_KINDS",
    "CacheFullError",
    "CacheShape",
    "CrossKV",
    "KVCache",
    "LatentKVCache",
    "LayerKV",
    "LayerState",
    "MemoryKVCache",
    "PagedKVCache",
    "RecurrentCache",
    "SlidingKVCache",
    "StaticKVCache",
    "new_cache",
]
