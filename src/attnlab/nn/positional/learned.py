"""Learned absolute positions (Gehring et al. 2017; BERT, GPT-2, BART): a trainable table.

The table's length is a hard limit: there is no row for position max_len - offset, which is why
these models cannot extrapolate (the lab's length experiment shows it). `offset` reproduces BART
and RoBERTa, which keep the first 2 rows unused.
"""

from __future__ import annotations

import torch
from torch import nn

from ..inputs import reads_values
from .base import POSITIONAL, PositionalScheme


class PositionOutOfRangeError(ValueError):
    """A position beyond a learned table."""


@POSITIONAL.register("learned")
class LearnedPositions(PositionalScheme):
    def __init__(self, *, d_model: int, max_len: int, offset: int = 0) -> None:
        """d_model: width of the embeddings; max_len: rows of the table; offset: rows skipped
        before position 0 (BART, RoBERTa: 2), so max_len - offset positions are usable."""
        super().__init__()
        if not 0 <= offset < max_len:
            raise ValueError(f"offset ({offset}) must be in 0..max_len-1 ({max_len - 1})")
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        nn.init.normal_(self.weight, std=0.02)

    @property
    def max_positions(self) -> int:
        return self.weight.shape[0] - self.offset

    def embed(self, positions: torch.Tensor) -> torch.Tensor:
        if reads_values(positions):
            top = int(positions.max())
            if top >= self.max_positions:
                raise PositionOutOfRangeError(
                    f"position {top} is beyond the learned position table, which holds "
                    f"{self.max_positions} positions (0..{self.max_positions - 1}): shorten the "
                    f"input to {self.max_positions} tokens, or use a scheme that extrapolates "
                    f"(positional kind 'rope' or 'alibi')"
                )
        return self.weight[positions + self.offset]
