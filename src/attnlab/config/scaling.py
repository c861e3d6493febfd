"""RoPE's scalings, `RoPE.scaling`: ways to run a rotary model past the length it was trained at
(src/attnlab/nn/positional/scaling.py computes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, ClassVar, Literal, Union

from pydantic import Field

from .base import Kind, TinySize

if TYPE_CHECKING:
    from typing_extensions import Self


class ScalingBase(Kind):
    """Base of RoPE's scalings."""

    # rotary channels the scaling needs: NTK's exponent d/(d-2) is undefined at d = 2
    min_rotary_dim: ClassVar[int] = 2


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


RopeScaling = Annotated[
    Union[LinearScaling, NTKScaling, DynamicNTKScaling, YaRNScaling], Field(discriminator="kind")
]
