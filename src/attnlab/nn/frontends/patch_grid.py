"""Patch grid: an image as a grid of patch tokens, for encoders that keep its 2-D layout (Swin,
Liu et al. 2021, arXiv:2103.14030, section 3.1, "patch partition" and "linear embedding").

The image (B, C, H, W) is cut into P x P patches, each mapped to d_model by a Conv2d with kernel =
stride = P and normalised (LayerNorm, eps 1e-5 as transformers' SwinEmbeddings); no class token
and no positions (Swin's relative bias sits in its window attention, src/attnlab/nn/swin.py). A
side that is not a multiple of P is zero-padded on the right / bottom first. The tokens are
row-major; `grid_of` gives the (rows, columns) the body needs to lay them out again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import FRONTENDS, Frontend


@FRONTENDS.register("patch-grid")
class PatchGrid(Frontend):
    input_name = "pixel_values"

    def __init__(
        self, *, d_model: int, image_size: int, patch_size: int, num_channels: int = 3
    ) -> None:
        """Args:
        d_model: the width of each token.
        image_size: the side of the (square) images the model is made for; other sizes work
            (nothing here depends on it), the attention windows must fit the grid.
        patch_size: the side P of each square patch.
        num_channels: C of the images (3 for RGB).
        """
        super().__init__()
        self.image_size, self.patch_size, self.num_channels = image_size, patch_size, num_channels
        self.proj = nn.Conv2d(num_channels, d_model, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(d_model, eps=1e-5)

    def grid_of(self, pixel_values: torch.Tensor) -> tuple[int, int]:
        """(rows, columns) of patches for images of this size (a partial patch counts)."""
        p = self.patch_size
        return -(-pixel_values.shape[-2] // p), -(-pixel_values.shape[-1] // p)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, rows·columns, d_model), row-major."""
        if pixel_values.dim() != 4 or pixel_values.shape[1] != self.num_channels:
            raise ValueError(
                f"pixel_values must be (B, {self.num_channels}, H, W) images, got shape "
                f"{tuple(pixel_values.shape)}"
            )
        if not pixel_values.is_floating_point():
            raise TypeError(f"pixel_values must be floating point, got {pixel_values.dtype}")
        p = self.patch_size
        x = F.pad(pixel_values, (0, -pixel_values.shape[-1] % p, 0, -pixel_values.shape[-2] % p))
        x = self.proj(x.to(self.proj.weight.dtype))  # (B, d, rows, columns)
        return self.norm(x.flatten(2).transpose(1, 2))  # (B, rows·columns, d)
