"""attnlab: every architectural choice of the Transformer as a small, swappable, tested component.

import attnlab as al
cfg = al.presets.get("llama2-7b")
model = al.build_model(al.presets.tiny(cfg))
"""

from . import convert, interop, presets
from .build import build_model, count_parameters
from .config import ConfigError, ModelConfig
from .decode.generate import generate
from .nn.attention import set_kernel
from .nn.fuse import fuse, unfuse
from .nn.inputs import shift_right
from .nn.model import ModelOutput
from .nn.quantize import quantize

__all__ = [
    "ConfigError",
    "ModelConfig",
    "ModelOutput",
    "build_model",
    "convert",
    "count_parameters",
    "fuse",
    "generate",
    "interop",
    "presets",
    "quantize",
    "set_kernel",
    "shift_right",
    "unfuse",
]
__version__ = "0.1.0"
