"""RoPE's scalings, `RoPE.scaling`: ways to run a rotary model past the length it was trained at
(src/attnlab/nn/positional/scaling.py computes them): linear, ntk, dynamic-ntk, yarn, llama3,
longrope, proportional. Each is one of transformers' `rope_type`s, or has no transformers form
(ntk); src/attnlab/interop/rope_params.py translates them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Union

from pydantic import Field, model_validator

from .base import Kind, TinySize

if TYPE_CHECKING:
    from typing_extensions import Self


class ScalingBase(Kind):
    """Base of RoPE's scalings."""

    # rotary channels the scaling needs: NTK's exponent d/(d-2) is undefined at d = 2
    min_rotary_dim: ClassVar[int] = 2

    def rotary_problems(self, rotary_dim: int, where: str) -> list[str]:
        """This scaling's rules on a RoPE that rotates `rotary_dim` channels (RoPE.problems asks
        it; `where` is the scaling's place, "positional.scaling"). None by default."""
        return []

    def fitted(self, rotary_dim: int) -> Self:
        """This scaling for `rotary_dim` rotated channels (RoPE.tiny asks it after `tiny`, when
        the head shrinks); unchanged unless the scaling has per-channel values (longrope)."""
        return self


class _OriginalLength(ScalingBase):
    """A scaling with `original_max_len`, the length the model was trained at: at most 32 at
    test size. (Each subclass declares the field itself, so serialised configs keep its place.)"""

    def tiny(self, size: TinySize) -> Self:
        return self.merged(original_max_len=min(self.original_max_len, 32))


class LinearScaling(ScalingBase):
    """Position interpolation (Chen et al. 2023, arXiv:2306.15595): positions divided by factor."""

    kind: Literal["linear"] = "linear"
    factor: float = Field(gt=0)


class NTKScaling(ScalingBase):
    """NTK-aware scaling (bloc97, 2023): base multiplied by factor^(d/(d-2))."""

    kind: Literal["ntk"] = "ntk"
    min_rotary_dim: ClassVar[int] = 4
    factor: float = Field(gt=0)


class DynamicNTKScaling(_OriginalLength):
    """Dynamic NTK: the NTK base grows with the current length once it exceeds the original."""

    kind: Literal["dynamic-ntk"] = "dynamic-ntk"
    min_rotary_dim: ClassVar[int] = 4
    factor: float = Field(gt=0)
    original_max_len: int = Field(gt=0)


class YaRNScaling(_OriginalLength):
    """YaRN (Peng et al. 2023, arXiv:2309.00071): per-frequency ramp between interpolation and
    extrapolation plus an attention temperature 0.1·ln(factor)+1 folded into cos/sin."""

    kind: Literal["yarn"] = "yarn"
    factor: float = Field(gt=1)
    original_max_len: int = Field(gt=0)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    # multiplies cos and sin; None: the paper's 0.1·ln(factor)+1. DeepSeek-V2 sets it from its
    # mscale / mscale_all_dim (their ratio of 0.1·m·ln(factor)+1 terms: 1.0 when they are equal)
    attention_factor: float | None = Field(None, gt=0)
    # True: the ramp's ends floored / ceiled to whole pairs (the authors' code, transformers'
    # default); False: the unrounded ends (GPT-OSS's `truncate: false`)
    truncate: bool = True


class Llama3Scaling(_OriginalLength):
    """Llama 3.1's frequency-dependent scaling (Meta's reference code, `apply_scaling` in
    meta-llama/llama-models; Llama 3 herd, arXiv:2407.21783): with λ = 2π/θ each pair's
    wavelength, pairs with λ < original_max_len / high_freq_factor are kept, pairs with
    λ > original_max_len / low_freq_factor divided by factor, and between them a blend
    (1 - s)·θ/factor + s·θ, s = (original_max_len/λ - low_freq_factor) / (high_freq_factor -
    low_freq_factor). Llama 3.1 / 3.2 / 3.3: factor 8 (3.2's 1B and 3B: 32), 1, 4, 8192."""

    kind: Literal["llama3"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_len: int = Field(gt=0)

    @model_validator(mode="after")
    def _band(self) -> Llama3Scaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor}): the blend runs between original_max_len / "
                f"high_freq_factor and original_max_len / low_freq_factor; swap or widen them"
            )
        return self


class LongRoPEScaling(_OriginalLength):
    """LongRoPE (Ding et al. 2024, arXiv:2402.13753), as Phi-3 and Phi-4 use it: one rescale
    factor per rotated pair, θ_i / λ_i, searched per target length; `short_factor` while a forward
    pass stays within original_max_len positions, `long_factor` once it reaches past them
    (transformers' `longrope`: chosen per forward pass from its highest position, so a forward
    pass on a cache that crosses the length rotates the new tokens with the long factors while
    the keys already cached keep their short-factor rotation; transformers' Phi-3 generate
    instead reruns the whole sequence once it holds original_max_len + 1 tokens, all of it with
    the long factors; src/attnlab/nn/positional/scaling.py, `reprefill_after`).

    factor is the extended length over original_max_len (Phi-3-mini-128k: 131072 / 4096 = 32);
    it only sets the default attention_factor, sqrt(1 + ln(factor) / ln(original_max_len))
    (1 when factor <= 1), which multiplies cos and sin at every length."""

    kind: Literal["longrope"] = "longrope"
    short_factor: tuple[float, ...] = Field(min_length=1)
    long_factor: tuple[float, ...] = Field(min_length=1)
    original_max_len: int = Field(gt=0)
    factor: float = Field(gt=0)
    attention_factor: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _positive(self) -> LongRoPEScaling:
        for name in ("short_factor", "long_factor"):
            bad = [x for x in getattr(self, name) if not x > 0]
            if bad:
                raise ValueError(
                    f"{name} ({bad[0]}) must be > 0: each divides a frequency; fix the entry"
                )
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"short_factor ({len(self.short_factor)} entries) and long_factor "
                f"({len(self.long_factor)}) must have one entry per rotated pair each: fix either"
            )
        return self

    def rotary_problems(self, rotary_dim: int, where: str) -> list[str]:
        if len(self.short_factor) != rotary_dim // 2:
            return [
                f"{where}.short_factor / long_factor ({len(self.short_factor)} entries) must "
                f"have one entry per rotated pair, {rotary_dim // 2} ({rotary_dim} rotary "
                f"channels): give {rotary_dim // 2} factors or change fraction / head_dim"
            ]
        return []

    def fitted(self, rotary_dim: int) -> Self:
        """Each tuple resampled to rotary_dim / 2 entries, evenly over the pairs (its shape kept)."""
        n, m = rotary_dim // 2, len(self.short_factor)
        if n == m or n < 1:
            return self
        pick = [round(i * (m - 1) / max(n - 1, 1)) for i in range(n)]
        return self.merged(
            short_factor=[self.short_factor[j] for j in pick],
            long_factor=[self.long_factor[j] for j in pick],
        )


class ProportionalScaling(ScalingBase):
    """p-RoPE (Barbero et al. 2025, arXiv:2410.06205; transformers' `proportional`,
    Gemma 4's global layers): of a head's R/2 pairs only the first int(fraction·R/2), the highest
    frequencies θ_i = base^(-2i/R) (the exponent still over all R channels), rotate; the rest get
    θ = 0 and pass unrotated; every θ is then divided by factor. Unlike RoPE.fraction (the first
    channels rotate among themselves, i with i + R'/2), the pairs stay (i, i + R/2) of the whole
    rotated width, so set RoPE.fraction 1 and this fraction instead."""

    kind: Literal["proportional"] = "proportional"
    fraction: float = Field(ge=0, le=1)
    factor: float = Field(1.0, gt=0)


RopeScaling = Annotated[
    Union[
        LinearScaling,
        NTKScaling,
        DynamicNTKScaling,
        YaRNScaling,
        Llama3Scaling,
        LongRoPEScaling,
        ProportionalScaling,
    ],
    Field(discriminator="kind"),
]
