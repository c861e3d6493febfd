"""The frontend contract and its registry.

A frontend is the seam between a modality and the Transformer body: it reads one kind of input
(`input_name`, the model's forward argument, e.g. "pixel_values") and returns the embedded
sequence (B, T, d_model) that the stack then treats exactly like token embeddings (embedding
norm, dropout, blocks). Whatever positions it needs it adds itself, so the stack's positional
scheme is "none". Options a kind takes at run time (ViT's `interpolate_pos_encoding`) are keyword
arguments of its forward; the model passes them through without knowing them. Input checks that
depend on the modality (dtype, channels, image size) live in the frontend, so each fails with its
own message.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ...registry import Registry


class Frontend(nn.Module):
    input_name: ClassVar[str]  # the model's forward argument this frontend reads

    def forward(self, inputs: torch.Tensor, **options) -> torch.Tensor:
        """inputs (B, ...) -> embedded sequence (B, T, d_model)."""
        raise NotImplementedError


FRONTENDS: Registry[type[Frontend]] = Registry("frontend")
