"""Normalisation layers.

LayerNorm (Ba, Kiros & Hinton 2016, arXiv:1607.06450): subtract the mean, divide by the standard
deviation over the feature dimension, then scale (and shift, when `bias`).
RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467): divide by the root mean square only, no mean,
no shift. Accumulated in fp32 whatever the input dtype, because the sum of squares of a bf16/fp16
vector loses precision (and overflows in fp16) long before the result does; the normalised
value is cast back to the input dtype before the weight multiplies it, as Llama does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Registry

NORMS: Registry[type[nn.Module]] = Registry("norm")


@NORMS.register("layernorm")
class LayerNorm(nn.Module):
    def __init__(self, *, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        """dim: the normalised (last) dimension; eps: added to the variance; bias: the shift."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


@NORMS.register("rmsnorm")
class RMSNorm(nn.Module):
    def __init__(self, *, dim: int, eps: float = 1e-6) -> None:
        """dim: the normalised (last) dimension; eps: added to the mean square."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
