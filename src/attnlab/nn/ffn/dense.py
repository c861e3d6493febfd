"""Position-wise feed-forward network (Vaswani et al. 2017, section 3.3):

    FFN(x) = down_proj(act(up_proj(x)))

ReLU in 2017 and T5 v1.0; GELU (Hendrycks & Gimpel 2016, arXiv:1606.08415) in BERT and GPT-2, the
latter with the tanh approximation ("gelu-tanh", GPT-2's `gelu_new`). Returns (output, None):
the FFN contract of base.py, so a mixture of experts can be swapped in.
"""

from __future__ import annotations

import torch
from torch import nn

from ..activations import ACTIVATIONS
from .base import FFNS


@FFNS.register("dense")
class DenseFFN(nn.Module):
    def __init__(
        self,
        *,
        d_model: int,
        d_ff: int,
        activation: str = "relu",
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        """Args:
        d_model: input and output width.
        d_ff: hidden width (4·d_model in the 2017 paper).
        activation: a name in src/attnlab/nn/activations.py ("relu", "gelu", ...).
        bias: biases on both linear maps.
        dropout: on the hidden activation, as T5 and fairseq do (training only).
        """
        super().__init__()
        self.act = ACTIVATIONS.get(activation)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.down_proj(self.dropout(self.act(self.up_proj(x)))), None
