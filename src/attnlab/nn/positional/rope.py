"""Rotary position embedding, RoPE (Su et al. 2021, arXiv:2104.09864, section 3.4).

Each pair of channels of q and k is rotated by the angle position · θ_i, θ_i = base^(-2i/R) for
i < R/2 (R = rotated channels). Because rotations compose, q_m · k_n depends only on m - n: the
relative property a test checks. Context-extension scalings change θ (or the positions):

- linear / position interpolation (Chen et al. 2023, arXiv:2306.15595): positions / factor;
- NTK-aware (bloc97 2023): base · factor^(R/(R-2)), stretching low frequencies more than high;
- dynamic NTK (Emozilla 2023): the NTK base recomputed from the current length L once
  L > original: base · (factor·L/original - (factor - 1))^(R/(R-2));
- YaRN (Peng et al. 2023, arXiv:2309.00071, section 3.2-3.4): a linear ramp, per frequency,
  between extrapolation (high-frequency dims kept as is) and interpolation (low-frequency dims
  divided by factor), plus an attention temperature 0.1·ln(factor) + 1 folded into cos and sin.
  As in the authors' reference code (and transformers), the ramp is linear in the pair index
  between the floor/ceil of the correction dims, not linear in the wavelength ratio r of the
  paper's equation.

cos/sin are computed in fp32 (angles reach 1e5 rad; bf16 would be useless), then cast to q's dtype.
"""

from __future__ import annotations

import math

import torch

from .base import POSITIONAL, PositionalScheme, Rotation


def _yarn(
    rot_dim: int, base: float, factor: float, original: int, beta_fast: float, beta_slow: float
):
    pos_freq = base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    extrapolated, interpolated = 1.0 / pos_freq, 1.0 / (factor * pos_freq)

    def dim_for(n_rotations: float) -> float:  # the channel pair that turns n times in `original`
        return rot_dim * math.log(original / (n_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), rot_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (fast dims), 0: interpolate (slow dims)
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq, 0.1 * math.log(factor) + 1.0


@POSITIONAL.register("rope")
class RotaryEmbedding(PositionalScheme):
    def __init__(
        self, rot_dim: int, base: float = 10000.0, layout: str = "half", scaling: dict | None = None
    ) -> None:
        super().__init__()
        self.rot_dim, self.base, self.layout = rot_dim, base, layout
        self.scaling = dict(scaling or {})
        kind = self.scaling.get("kind")
        attention_factor = 1.0
        if kind == "yarn":
            s = self.scaling
            inv, attention_factor = _yarn(
                rot_dim, base, s["factor"], s["original_max_len"], s["beta_fast"], s["beta_slow"]
            )
        else:
            if kind == "ntk":
                base = base * self.scaling["factor"] ** (rot_dim / (rot_dim - 2))
            inv = self._inv_freq(base)
            if kind == "linear":
                inv = inv / self.scaling["factor"]
        self.attention_factor = attention_factor
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def _inv_freq(self, base: float) -> torch.Tensor:
        return 1.0 / base ** (torch.arange(0, self.rot_dim, 2, dtype=torch.float64) / self.rot_dim)

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        s = self.scaling
        length = int(positions.max()) + 1 if positions.numel() else 0
        if length <= s["original_max_len"]:
            return self.inv_freq
        grow = s["factor"] * length / s["original_max_len"] - (s["factor"] - 1)
        base = self.base * grow ** (self.rot_dim / (self.rot_dim - 2))
        return self._inv_freq(base).float().to(self.inv_freq.device)

    def rotation(self, positions: torch.Tensor) -> Rotation:
        inv = self.inv_freq
        if self.scaling.get("kind") == "dynamic-ntk" and positions.device.type != "meta":
            inv = self._dynamic_inv_freq(positions)
        angle = positions[..., None].float() * inv  # (B, T, R/2)
        return Rotation(
            angle.cos() * self.attention_factor, angle.sin() * self.attention_factor, self.layout
        )
