"""Frontends: inputs other than token ids become the (B, T, d_model) sequence the unchanged
Transformer body reads. Importing this package registers every kind in FRONTENDS.

    patches.py   ViT's patch embedding: images (B, C, H, W) -> class token + patches + positions
"""

from . import patches  # noqa: F401  (registers "patches")
from .base import FRONTENDS, Frontend
from .patches import PatchEmbedding

__all__ = ["FRONTENDS", "Frontend", "PatchEmbedding"]
