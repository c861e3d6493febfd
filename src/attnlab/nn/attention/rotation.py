"""Rotation: what a rotary scheme hands the attention layer (RoFormer, Su et al. 2021,
arXiv:2104.09864, equation 34), beside the other attention inputs, the mask (masks.py) and the
score bias (bias.py).

A positional scheme (src/attnlab/nn/positional/rope.py) computes cos/sin for one forward pass;
the attention layer applies the rotation to q and k and never asks which scheme made it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import check_choice

LAYOUTS = ("half", "interleaved")  # RoPE's channel pairings, see Rotation


@dataclass(frozen=True)
class Rotation:
    """cos/sin for one forward pass, (B, T, R/2) each, R = rotated channels per head."""

    cos: torch.Tensor
    sin: torch.Tensor
    layout: str  # "half" or "interleaved"

    def __post_init__(self) -> None:
        check_choice("layout", self.layout, LAYOUTS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x (B, H, T, D): the first R channels rotate, the rest pass through."""
        rot = 2 * self.cos.shape[-1]
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        cos, sin = self.cos[:, None].to(x.dtype), self.sin[:, None].to(x.dtype)  # (B, 1, T, R/2)
        if self.layout == "half":  # channel i pairs with i + R/2
            x1, x2 = x_rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:  # channel 2i pairs with 2i + 1
            x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out
