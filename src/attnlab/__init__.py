"""attnlab: every architectural choice of the Transformer as a small, swappable, tested component.

    import attnlab as al
    cfg = al.presets.get("llama2-7b")
    model = al.build_model(al.presets.tiny(cfg))
"""

from . import presets
from .build import build_model
from .config import ConfigError, ModelConfig
from .model import ModelOutput

__all__ = ["ConfigError", "ModelConfig", "ModelOutput", "build_model", "presets"]
__version__ = "0.1.0"
