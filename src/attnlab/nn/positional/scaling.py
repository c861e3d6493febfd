"""RoPE context-extension scalings: each changes the rotation frequencies θ (rope.py), one class
per method, registered under the `kind` of its config node (src/attnlab/config/scaling.py).

- linear / position interpolation (Chen et al. 2023, arXiv:2306.15595): positions / factor,
  i.e. θ / factor;
- NTK-aware (bloc97 2023): base · factor^(R/(R-2)), stretching low frequencies more than high;
- dynamic NTK (Emozilla 2023): the NTK base recomputed from the current length L once
  L > original: base · (factor·L/original - (factor - 1))^(R/(R-2));
- YaRN (Peng et al. 2023, arXiv:2309.00071, section 3.2-3.4): a linear ramp, per frequency,
  between extrapolation (high-frequency dims kept as is) and interpolation (low-frequency dims
  divided by factor), plus an attention temperature 0.1·ln(factor) + 1 folded into cos and sin.
  As in the authors' reference code (and transformers), the ramp is linear in the pair index
  between the floor/ceil of the correction dims, not linear in the wavelength ratio r of the
  paper's equation.

R is the number of rotated channels per head. Frequencies are computed in float64 and stored in
fp32 by rope.py.
"""

from __future__ import annotations

import math

import torch

from ...registry import Registry


def plain_inv_freq(rot_dim: int, base: float) -> torch.Tensor:
    """θ_i = base^(-2i/R), i < R/2, float64."""
    return 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)


class RopeScaling:
    """No scaling: the paper's frequencies. Subclasses override what they change."""

    attention_factor = 1.0  # multiplies cos and sin (YaRN's temperature)
    dynamic = False  # True: frequencies depend on the length of each forward pass (at_length)

    def inv_freq(self, rot_dim: int, base: float) -> torch.Tensor:
        """(R/2,) float64 frequencies used at every length (unless `at_length` says otherwise)."""
        return plain_inv_freq(rot_dim, base)

    def at_length(self, length: int, rot_dim: int, base: float) -> torch.Tensor | None:
        """Frequencies for a forward pass reaching `length` positions; None: the static ones."""
        return None


ROPE_SCALINGS: Registry[type[RopeScaling]] = Registry("RoPE scaling")


@ROPE_SCALINGS.register("linear")
class LinearScaling(RopeScaling):
    def __init__(self, *, factor: float) -> None:
        self.factor = factor

    def inv_freq(self, rot_dim: int, base: float) -> torch.Tensor:
        return plain_inv_freq(rot_dim, base) / self.factor


@ROPE_SCALINGS.register("ntk")
class NTKScaling(RopeScaling):
    def __init__(self, *, factor: float) -> None:
        self.factor = factor

    def inv_freq(self, rot_dim: int, base: float) -> torch.Tensor:
        return plain_inv_freq(rot_dim, base * self.factor ** (rot_dim / (rot_dim - 2)))


@ROPE_SCALINGS.register("dynamic-ntk")
class DynamicNTKScaling(RopeScaling):
    dynamic = True

    def __init__(self, *, factor: float, original_max_len: int) -> None:
        self.factor, self.original_max_len = factor, original_max_len

    def at_length(self, length: int, rot_dim: int, base: float) -> torch.Tensor | None:
        if length <= self.original_max_len:
            return None
        grow = self.factor * length / self.original_max_len - (self.factor - 1)
        return plain_inv_freq(rot_dim, base * grow ** (rot_dim / (rot_dim - 2)))


@ROPE_SCALINGS.register("yarn")
class YaRNScaling(RopeScaling):
    def __init__(
        self,
        *,
        factor: float,
        original_max_len: int,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        attention_factor: float | None = None,
    ) -> None:
        self.factor, self.original_max_len = factor, original_max_len
        self.beta_fast, self.beta_slow = beta_fast, beta_slow
        # None: the paper's temperature; DeepSeek-V2 gives its own (config/scaling.py, YaRNScaling)
        default = 0.1 * math.log(factor) + 1.0
        self.attention_factor = default if attention_factor is None else attention_factor

    def inv_freq(self, rot_dim: int, base: float) -> torch.Tensor:
        extrapolated = plain_inv_freq(rot_dim, base)
        interpolated = extrapolated / self.factor

        def dim_for(n_rotations: float) -> float:  # the pair that turns n times in `original`
            turns = self.original_max_len / (n_rotations * 2 * math.pi)
            return rot_dim * math.log(turns) / (2 * math.log(base))

        low = max(math.floor(dim_for(self.beta_fast)), 0)
        high = min(math.ceil(dim_for(self.beta_slow)), rot_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (fast dims), 0: interpolate (slow dims)
        return interpolated * (1 - keep) + extrapolated * keep
