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

import torch
from torch import nn

from ...registry import Registry
from ..attention.bias import ScoreBias
from ..attention.rotation import LAYOUTS, Rotation  # noqa: F401  (re-exported)

POSITIONAL: Registry[type[PositionalScheme]] = Registry("positional scheme")


class PositionalScheme(nn.Module):
    """Base class: every hook is a no-op."""

    # the positions the scheme can embed; None: any (a learned table declares its size)
    max_positions: int | None = None
    # a cache filled while the sequence was at most this long is stale once it is longer
    # (LongRoPE switches factor sets on the sequence's length; rope.py); None: never stale
    reprefill_after: int | None = None

    def __init__(self) -> None:  # no arguments (nn.Module's are *args, **kwargs)
        super().__init__()

    def embed(self, positions: torch.Tensor) -> torch.Tensor | None:
        return None

    def rotation(self, positions: torch.Tensor) -> Rotation | None:
        return None

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> ScoreBias | None:
        return None


@POSITIONAL.register("none")
class NoPositions(PositionalScheme):
    """No positional information at all (NoPE, Kazemnejad et al. 2023, arXiv:2305.19466): a
    causal decoder still infers order from the mask; an encoder becomes permutation-equivariant."""
