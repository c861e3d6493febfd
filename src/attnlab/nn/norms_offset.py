"""RMSNorm with a unit offset on its weight: y = x / rms(x) · (1 + w) (Gemma Team 2024, "Gemma:
Open Models Based on Gemini Research and Technology", arXiv:2403.08295, section 2; the same
RMSNorm as Zhang & Sennrich 2019, arXiv:1910.07467, with its gain stored as w = gain - 1).

Two differences from `rmsnorm` (src/attnlab/nn/norms.py), both Gemma's:
- the stored weight is the offset from 1, so a norm is the identity scaling at w = 0 (its
  `identity_weight`, which src/attnlab/nn/init.py starts it at) and weight decay pulls the gain
  towards 1, not 0;
- the weight multiplies in fp32, *before* the cast back to the input dtype: (x̂ · (1 + w)).to(dtype),
  where Llama's RMSNorm casts x̂ first and multiplies in the input dtype (transformers'
  GemmaRMSNorm and its comment on PR #29402). In bf16 the two orders round differently, so the
  order is part of the definition, not a detail.

Registered as "rmsnorm-unit-offset" by src/attnlab/nn/norms.py, which imports this module, so
NORMS is complete once norms.py is imported (this module imports nothing of norms.py: no circle).
"""

from __future__ import annotations

import torch
from torch import nn


class UnitOffsetRMSNorm(nn.Module):
    identity_weight = 0.0  # the weight at which the norm leaves the normalised x unscaled

    def __init__(self, *, dim: int, eps: float = 1e-6) -> None:
        """dim: the normalised (last) dimension; eps: added to the mean square."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # every step in fp32 (the sum of squares of bf16 / fp16 loses precision or overflows),
        # one rounding to the input dtype at the very end; float64 stays float64
        wide = torch.promote_types(x.dtype, torch.float32)
        x32 = x.to(wide)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.to(wide))).to(x.dtype)
