"""attnlab: every architectural choice of the Transformer as a small, swappable, tested component.

import attnlab as al
cfg = al.presets.get("llama2-7b")
model = al.build_model(al.presets.tiny(cfg))

The names below load on first use (PEP 562), so `import attnlab` — and `attnlab --help` — does
not import torch until something needs it.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from typing import TYPE_CHECKING, Any


def _inductor_cache_per_isa() -> None:
    """torch.compile's CPU code follows ATEN_CPU_CAPABILITY (torch/_inductor/cpu_vec_isa.py), but
    its cache keys do not: a kernel compiled for AVX-512 is reused by a process run with
    ATEN_CPU_CAPABILITY=avx2 (measured: a crash) and the other way round (wrong numbers; compiled
    flex attention off by 2.3 in tests/nn/attention/kernels/test_flex.py, torch 2.13). A process
    that sets the variable gets a cache of its own, unless the user chose one
    (TORCHINDUCTOR_CACHE_DIR); tested in tests/nn/attention/kernels/test_flex.py."""
    isa = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if not isa or os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return
    user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "user"
    cache = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_attnlab_{isa}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache


_inductor_cache_per_isa()

if TYPE_CHECKING:
    from . import interop, presets, surgery
    from .build import build_model, count_parameters
    from .config import ConfigError, ModelConfig
    from .decode.generate import generate
    from .nn.attention import set_kernel
    from .nn.fuse import fuse, unfuse
    from .nn.inputs import shift_right
    from .nn.model import ModelOutput
    from .nn.quantize import quantize

_SUBMODULES = ("interop", "presets", "surgery")  # public; the rest load on use as well:
_PACKAGES = ("build", "cache", "config", "data", "decode", "errors", "lab", "nn", "registry")
_PACKAGES += ("serve", "train")
_NAMES = {  # public name -> the module that defines it
    "build_model": ".build",
    "count_parameters": ".build",
    "ConfigError": ".config",
    "ModelConfig": ".config",
    "generate": ".decode.generate",
    "set_kernel": ".nn.attention",
    "fuse": ".nn.fuse",
    "unfuse": ".nn.fuse",
    "shift_right": ".nn.inputs",
    "ModelOutput": ".nn.model",
    "quantize": ".nn.quantize",
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES or name in _PACKAGES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name], __name__), name)
    else:
        raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


__all__ = [
    "ConfigError",
    "ModelConfig",
    "ModelOutput",
    "build_model",
    "count_parameters",
    "fuse",
    "generate",
    "interop",
    "presets",
    "quantize",
    "set_kernel",
    "shift_right",
    "surgery",
    "unfuse",
]
__version__ = "0.1.0"
