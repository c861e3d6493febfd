"""ALiBi: attention with linear biases (Press, Smith & Lewis 2022, arXiv:2108.12409).

No position embeddings; each head h adds -m_h · distance to its scores, with slopes a geometric
sequence. For n heads a power of two, m_h = 2^(-8h/n), h = 1..n. Otherwise (paper, section 3 and
its reference code) take the slopes of the closest power of two p below n, then every other slope
of 2p for the remaining n - p heads.

Causal stacks use m_h · (k - q) (zero on the diagonal, negative into the past); bidirectional
stacks use -m_h · |k - q|. BLOOM and MPT add m_h · k instead, which differs from m_h · (k - q) by a
per-row constant that softmax ignores.
"""

from __future__ import annotations

import math

import torch

from ..attention.bias import LinearBias
from .base import POSITIONAL, PositionalScheme


def alibi_slopes(n_heads: int) -> list[float]:
    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return power_of_two(n_heads)
    p = 2 ** math.floor(math.log2(n_heads))
    return power_of_two(p) + power_of_two(2 * p)[0::2][: n_heads - p]


@POSITIONAL.register("alibi")
class ALiBi(PositionalScheme):
    def __init__(self, *, n_heads: int, causal: bool) -> None:
        """n_heads: one slope per head; causal: bias m·(k - q) (decoders) or -m·|k - q|."""
        super().__init__()
        self.causal = causal
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_heads)), persistent=False)

    def score_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> LinearBias:
        """A description: the kernels evaluate it per block, or fold it into sdpa (causal)."""
        return LinearBias(self.slopes, q_positions, k_positions, self.causal)
