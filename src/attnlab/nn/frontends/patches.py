"""Patch embedding: an image is a sequence of patches (Dosovitskiy et al. 2021, "An Image is Worth
16x16 Words", arXiv:2010.11929, section 3.1, eq. 1).

The image (B, C, H, W) is cut into non-overlapping P x P patches; each flattened patch is mapped to
d_model by one linear projection, written as a Conv2d with kernel = stride = P (the same linear
map, applied at every patch). A learned class token x_class is prepended, whose final state the
classifier reads, and learned 1-D positions E_pos are added to all N + 1 tokens:

    z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos          (B, N + 1, d_model), N = (H/P)·(W/P)

Other image sizes (section 3.2, "Fine-tuning and higher resolution"): the N patch rows of the
table are laid out on their sqrt(N) x sqrt(N) grid and resized to the new grid by 2-D bicubic
interpolation; the class token's row is kept. This follows transformers' ViT
(`ViTEmbeddings.interpolate_pos_encoding`, transformers 5): `interpolate(size=(H/P, W/P),
mode="bicubic", align_corners=False)` in the table's dtype, and no interpolation when the grid
is unchanged (same patch count and a square image). Earlier transformers versions and DINO passed
`scale_factor` with a +0.1 offset instead of `size`; the installed version has no offset, so
neither does this. Without `interpolate_pos_encoding` an image of another size is refused, as
transformers refuses it.

Names and shapes follow transformers' ViTEmbeddings (cls_token (1, 1, d), position_embeddings
(1, N + 1, d)) so that checkpoints map one to one (src/attnlab/interop/vit.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import FRONTENDS, Frontend


@FRONTENDS.register("patches")
class PatchEmbedding(Frontend):
    input_name = "pixel_values"

    def __init__(
        self, *, d_model: int, image_size: int, patch_size: int, num_channels: int = 3
    ) -> None:
        """Args:
        d_model: the width of each token.
        image_size: the side of the (square) images the position table is for.
        patch_size: the side P of each square patch; image_size must be a multiple of it.
        num_channels: C of the images (3 for RGB).
        """
        super().__init__()
        if image_size % patch_size:
            raise ValueError(
                f"image_size ({image_size}) must be divisible by patch_size ({patch_size})"
            )
        self.image_size, self.patch_size, self.num_channels = image_size, patch_size, num_channels
        self.grid = image_size // patch_size  # patches per side of the table
        self.proj = nn.Conv2d(num_channels, d_model, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.position_embeddings = nn.Parameter(torch.zeros(1, self.grid**2 + 1, d_model))

    def forward(
        self, pixel_values: torch.Tensor, interpolate_pos_encoding: bool = False
    ) -> torch.Tensor:
        """pixel_values (B, C, H, W), normalised floats -> (B, N + 1, d_model), class token first.
        interpolate_pos_encoding: resize the position table to an image of another size."""
        self._check(pixel_values, interpolate_pos_encoding)
        B, _, H, W = pixel_values.shape
        x = self.proj(pixel_values.to(self.proj.weight.dtype))  # (B, d_model, H/P, W/P)
        x = x.flatten(2).transpose(1, 2)  # (B, d_model, N) -> (B, N, d_model), row-major patches
        cls = self.cls_token.expand(B, -1, -1)  # (1, 1, d_model) -> (B, 1, d_model), a view
        x = torch.cat([cls, x], dim=1)  # (B, N + 1, d_model)
        if not interpolate_pos_encoding:
            return x + self.position_embeddings  # (1, N + 1, d_model) broadcast over B
        return x + self.interpolated_positions(H // self.patch_size, W // self.patch_size)

    def interpolated_positions(self, rows: int, cols: int) -> torch.Tensor:
        """The table for a rows x cols grid of patches: (1, rows·cols + 1, d_model)."""
        table = self.position_embeddings
        if rows * cols == self.grid**2 and rows == cols:  # transformers' no-op condition
            return table
        d = table.shape[-1]
        cls, grid = table[:, :1], table[:, 1:]  # (1, 1, d), (1, N, d)
        # (1, N, d) -> (1, g, g, d) -> (1, d, g, g): channels first, as interpolate wants them
        grid = grid.reshape(1, self.grid, self.grid, d).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        grid = grid.permute(0, 2, 3, 1).reshape(1, rows * cols, d)  # (1, d, r, c) -> (1, r·c, d)
        return torch.cat([cls, grid], dim=1)  # (1, r·c + 1, d)

    def _check(self, px: torch.Tensor, interpolate: bool) -> None:
        if not isinstance(px, torch.Tensor):
            raise TypeError(f"pixel_values must be a torch.Tensor, got {type(px).__name__}")
        if not px.dtype.is_floating_point:
            raise TypeError(
                f"pixel_values must be floating point (normalised images), got {px.dtype}: "
                f"convert with .float() and normalise as the model's image processor does"
            )
        if px.dim() != 4:
            raise ValueError(
                f"pixel_values must be 4-D (batch, channels, height, width), got shape "
                f"{tuple(px.shape)}: add a batch dimension with pixel_values[None] for one image"
            )
        channels, h, w = px.shape[1:]
        p, s = self.patch_size, self.image_size
        if channels != self.num_channels:
            raise ValueError(
                f"pixel_values have {channels} channels, the model expects num_channels "
                f"{self.num_channels} (shape (B, C, H, W): channels first)"
            )
        if h < p or w < p:
            raise ValueError(f"an image of {h}x{w} holds no {p}x{p} patch: use larger images")
        if not interpolate and (h != s or w != s):
            raise ValueError(
                f"pixel_values are {h}x{w} images; the position table is for "
                f"{self.image_size}x{self.image_size}: resize them, or pass "
                f"interpolate_pos_encoding=True to resize the table (bicubic, as transformers)"
            )
