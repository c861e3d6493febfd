"""Position-wise feed-forward network (Vaswani et al. 2017, section 3.3):

    FFN(x) = down_proj(act(up_proj(x)))

ReLU in 2017 and T5 v1.0; GELU (Hendrycks & Gimpel 2016, arXiv:1606.08415) in BERT and GPT-2, the
latter with the tanh approximation ("gelu-tanh", GPT-2's `gelu_new`). Every FFN returns
(output, aux_loss) so a mixture of experts can be swapped in; dense ones have no aux loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...registry import Registry

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu-tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}

FFNS: Registry[type[nn.Module]] = Registry("FFN")


@FFNS.register("dense")
class DenseFFN(nn.Module):
    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str = "relu",
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)  # on the hidden activation, as T5 and fairseq do

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.down_proj(self.dropout(self.act(self.up_proj(x)))), None
