"""Gated FFNs (Dauphin et al. 2017; Shazeer 2020, "GLU Variants Improve Transformer",
arXiv:2002.05202):

    FFN(x) = down_proj(act(gate_proj(x)) * up_proj(x))

SwiGLU (act = SiLU: Llama, Mistral, Qwen) and GeGLU (act = GELU: T5 v1.1, Gemma). Three matrices
instead of two, so the hidden size is usually 2/3 of the dense 4·d_model to keep the parameter
count (ModelConfig.ffn_dim in src/attnlab/config.py). Bias-free by default, as in the paper.
"""

from __future__ import annotations

import torch
from torch import nn

from ..activations import ACTIVATIONS
from .base import FFNS


@FFNS.register("glu")
class GLUFFN(nn.Module):
    def __init__(
        self,
        *,
        d_model: int,
        d_ff: int,
        activation: str = "silu",
        bias: bool = False,
        dropout: float = 0.0,
    ) -> None:
        """Args:
        d_model: input and output width.
        d_ff: hidden width of the gate and of the up projection.
        activation: the gate's activation, a name in src/attnlab/nn/activations.py ("silu" is
            SwiGLU, "gelu" / "gelu-tanh" GeGLU).
        bias: biases on the three linear maps.
        dropout: on the gated hidden activation (training only).
        """
        super().__init__()
        self.act = ACTIVATIONS.get(activation)
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.down_proj(self.dropout(self.act(self.gate_proj(x)) * self.up_proj(x))), None
