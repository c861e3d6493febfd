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
  paper's equation; `truncate` False keeps the unrounded dims (GPT-OSS);
- llama3 (Meta's Llama 3.1 code, `apply_scaling`; arXiv:2407.21783): by wavelength λ = 2π/θ,
  pairs with λ < L/high_freq_factor kept, λ > L/low_freq_factor divided by factor, a blend in
  L/λ between (L = original length);
- longrope (Ding et al. 2024, arXiv:2402.13753; Phi-3 / Phi-4): θ_i / short_factor_i, or
  θ_i / long_factor_i in a forward pass whose highest position reaches past the original
  length, with the attention factor sqrt(1 + ln(factor) / ln(L)) on cos and sin;
- proportional (p-RoPE, Barbero et al. 2025, arXiv:2410.06205; Gemma 4): the lowest
  frequencies set to 0 (those pairs unrotated), the others θ_i, all divided by factor.

R is the number of rotated channels per head. Frequencies are computed in float64 and stored in
fp32 by rope.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ...registry import Registry


def plain_inv_freq(rot_dim: int, base: float) -> torch.Tensor:
    """θ_i = base^(-2i/R), i < R/2, float64."""
    return 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)


class RopeScaling:
    """No scaling: the paper's frequencies. Subclasses override what they change."""

    attention_factor = 1.0  # multiplies cos and sin (YaRN's temperature)
    dynamic = False  # True: frequencies depend on the length of each forward pass (at_length)
    # a cache filled while the sequence held at most this many tokens goes stale once it holds
    # more (the frequencies changed for every position): decoding reruns the sequence then
    reprefill_after: int | None = None

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
        truncate: bool = True,
    ) -> None:
        self.factor, self.original_max_len = factor, original_max_len
        self.beta_fast, self.beta_slow, self.truncate = beta_fast, beta_slow, truncate
        # None: the paper's temperature; DeepSeek-V2 gives its own (config/scaling.py, YaRNScaling)
        default = 0.1 * math.log(factor) + 1.0
        self.attention_factor = default if attention_factor is None else attention_factor

    def inv_freq(self, rot_dim: int, base: float) -> torch.Tensor:
        extrapolated = plain_inv_freq(rot_dim, base)
        interpolated = extrapolated / self.factor

        def dim_for(n_rotations: float) -> float:  # the pair that turns n times in `original`
            turns = self.original_max_len / (n_rotations * 2 * math.pi)
            return rot_dim * math.log(turns) / (2 * math.log(base))

        low, high = dim_for(self.beta_fast), dim_for(self.beta_slow)
        if self.truncate:  # whole pairs (the reference code); GPT-OSS keeps the fractions
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rot_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (fast dims), 0: interpolate (slow dims)
        return interpolated * (1 - keep) + extrapolated * keep


@ROPE_SCALINGS.register("llama3")
class Llama3Scaling(RopeScaling):
    def __init__(
        self,
        *,
        factor: float,
        original_max_len: int,
        low_freq_factor: float = 1.0,
        high_freq_factor: float = 4.0,
    ) -> None:
        self.factor, self.original_max_len = factor, original_max_len
        self.low, self.high = low_freq_factor, high_freq_factor

    def inv_freq(self, rot_dim: int, base: float) -> torch.Tensor:
        theta = plain_inv_freq(rot_dim, base)
        turns = self.original_max_len * theta / (2 * math.pi)  # L / λ: turns in the original length
        # 0 at λ = L / low (and longer: divided by factor), 1 at λ = L / high (and shorter: kept)
        keep = ((turns - self.low) / (self.high - self.low)).clamp(0, 1)
        return theta / self.factor * (1 - keep) + theta * keep


@ROPE_SCALINGS.register("longrope")
class LongRoPEScaling(RopeScaling):
    """Static frequencies θ / short_factor; `at_length` switches to θ / long_factor for a forward
    pass reaching past original_max_len positions, as transformers' `longrope_frequency_update`
    does per call. A forward pass on a cache does the same per step: once a step's position
    reaches original_max_len its q and k rotate with the long factors while the keys already
    cached keep their short-factor rotation (equal to transformers' model called with a cache).
    transformers' Phi-3 `generate` does not decode on from there: when the sequence reaches
    original_max_len + 1 tokens on a cache of at most original_max_len
    (Phi3ForCausalLM.prepare_inputs_for_generation), it drops the cache and reruns the whole
    sequence, every position rotated with the long factors. `reprefill_after` declares that
    length for decoding loops (RotaryEmbedding.reprefill_after)."""

    dynamic = True

    def __init__(
        self,
        *,
        short_factor: Sequence[float],
        long_factor: Sequence[float],
        original_max_len: int,
        factor: float,
        attention_factor: float | None = None,
    ) -> None:
        self.short = torch.tensor(list(short_factor), dtype=torch.float64)
        self.long = torch.tensor(list(long_factor), dtype=torch.float64)
        self.original_max_len, self.factor = original_max_len, factor
        self.reprefill_after = original_max_len
        if attention_factor is None:  # Phi-3's: YaRN-like, from the extension ratio
            attention_factor = (
                math.sqrt(1 + math.log(factor) / math.log(original_max_len)) if factor > 1 else 1.0
            )
        self.attention_factor = attention_factor

    def _divided(self, factors: torch.Tensor, rot_dim: int, base: float) -> torch.Tensor:
        if factors.numel() != rot_dim // 2:
            raise ValueError(
                f"longrope has {factors.numel()} factors per set, but {rot_dim} rotary channels "
                f"make {rot_dim // 2} pairs: give one factor per pair"
            )
        return plain_inv_freq(rot_dim, base) / factors

    def inv_freq(self, rot_dim: int, base: float) -> torch.Tensor:
        return self._divided(self.short, rot_dim, base)

    def at_length(self, length: int, rot_dim: int, base: float) -> torch.Tensor | None:
        return self._divided(self.long, rot_dim, base) if length > self.original_max_len else None


@ROPE_SCALINGS.register("proportional")
class ProportionalScaling(RopeScaling):
    def __init__(self, *, fraction: float, factor: float = 1.0) -> None:
        self.fraction, self.factor = fraction, factor

    def inv_freq(self, rot_dim: int, base: float) -> torch.Tensor:
        theta = plain_inv_freq(rot_dim, base)
        theta[int(self.fraction * rot_dim // 2) :] = 0.0  # the lowest frequencies: unrotated
        return theta / self.factor
