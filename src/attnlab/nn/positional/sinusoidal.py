"""Sinusoidal absolute positions (Vaswani et al. 2017, section 3.5).

    PE(pos, 2i)   = sin(pos / base^(2i / d_model))
    PE(pos, 2i+1) = cos(pos / base^(2i / d_model))

added to the (scaled) token embeddings. Computed on the fly in fp32 for the positions asked for,
so there is no length limit and nothing to store. layout "split" puts the sines in the first half
and the cosines in the second, with the paper's frequencies (Marian / Pegasus in transformers) —
the same features, permuted. fairseq and tensor2tensor also split, but space the frequencies as
base^(-i/(d/2 - 1)); that variant is not implemented.
"""

from __future__ import annotations

import torch

from ...errors import check_choice
from .base import POSITIONAL, PositionalScheme

SIN_LAYOUTS = ("interleaved", "split")


@POSITIONAL.register("sinusoidal")
class SinusoidalPositions(PositionalScheme):
    def __init__(self, *, d_model: int, base: float = 10000.0, layout: str = "interleaved") -> None:
        """d_model: width of the embeddings (even); base: the wavelength base; layout:
        "interleaved" (sin, cos, sin, ... the paper) or "split" (all sines, then all cosines)."""
        super().__init__()
        check_choice("layout", layout, SIN_LAYOUTS)
        if d_model % 2:
            raise ValueError(f"d_model ({d_model}) must be even for sin/cos pairs")
        self.d_model, self.layout = d_model, layout
        inv = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def embed(self, positions: torch.Tensor) -> torch.Tensor:
        angle = positions[..., None].float() * self.inv_freq  # (B, T, d/2)
        if self.layout == "split":
            return torch.cat((angle.sin(), angle.cos()), dim=-1)
        return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)  # (B, T, d)
