"""The three positional hooks: where a positional scheme meets the model.

A scheme uses exactly one of them; the others return None and the model never asks which scheme
it holds:

    embed(positions)                -> (B, T, d_model) added to the token embeddings
    rotation(positions)             -> a Rotation applied to q and k inside attention
    score_bias(q_positions, k_pos)  -> a ScoreBias (src/attnlab/nn/attention/bias.py): what is
                                       added to the scores, as a description kernels evaluate
                                       block by block, never a (B, H, T, S) tensor up front

Shape vocabulary (used across attnlab): B batch, T query length, S key length, H heads,
H_kv key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import check_choice
from ...registry import Registry
from ..attention.bias import ScoreBias

POSITIONAL: Registry[type[PositionalScheme]] = Registry("positional scheme")
LAYOUTS = ("half", "interleaved")  # RoPE's channel pairings, see Rotation


class PositionalScheme(nn.Module):
    """Base class: every hook is a no-op."""

    def __init__(self) -> None:  # no arguments (nn.Module's are *args, **kwargs)
        super().__init__()

    def embed(self, positions: torch.Tensor) -> torch.Tensor | None:
        return None

    def rotation(self, positions: torch.Tensor) -> Rotation | None:
        return None

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> ScoreBias | None:
        return None


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


@POSITIONAL.register("none")
class NoPositions(PositionalScheme):
    """No positional information at all (NoPE, Kazemnejad et al. 2023, arXiv:2305.19466): a
    causal decoder still infers order from the mask; an encoder becomes permutation-equivariant."""
