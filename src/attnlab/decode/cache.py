"""The old path of the KV caches, kept for code written before they moved to `attnlab.cache`
(src/attnlab/cache/, a package below nn/: docs/architecture.md, "Import direction"). Importing
it warns once and gives the same names; its submodules (`attnlab.decode.cache.paged`) are gone:
import `attnlab.cache.paged` instead."""

import warnings

from ..cache import *  # noqa: F403  (the same objects, not copies)
from ..cache import __all__  # noqa: F401

warnings.warn(
    "attnlab.decode.cache moved to attnlab.cache: import from there (this alias will go)",
    DeprecationWarning,
    stacklevel=2,
)
