"""Frontends: inputs other than token ids become the (B, T, d_model) sequence the unchanged
Transformer body reads. Importing this package registers every kind in FRONTENDS.

    patches.py   ViT's patch embedding: images (B, C, H, W) -> class token + patches + positions
    audio.py     Whisper's stem: log-mel (B, n_mels, frames) -> two Conv1d + GELU + sinusoids
    patch_grid.py  Swin's stem: images -> a row-major grid of normalised patch tokens
"""

from . import audio, patch_grid, patches  # noqa: F401  (registers "audio", "patch-grid", "patches")
from .audio import AudioEmbedding
from .base import FRONTENDS, Frontend
from .patch_grid import PatchGrid
from .patches import PatchEmbedding

__all__ = ["FRONTENDS", "AudioEmbedding", "Frontend", "PatchEmbedding", "PatchGrid"]
