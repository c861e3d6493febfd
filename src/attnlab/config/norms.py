"""The norm kinds, `ModelConfig.norm`: LayerNorm, RMSNorm and Gemma's unit-offset RMSNorm."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from .base import Kind


class NormBase(Kind):
    """Base of the norm kinds."""


class LayerNormConfig(NormBase):
    """LayerNorm (Ba et al. 2016, arXiv:1607.06450); `bias` False drops the shift (MPT, OLMo,
    Cohere). `upcast`: 16-bit inputs are normalised, scaled and shifted in fp32 and rounded once
    at the end (Cohere's CohereLayerNorm); False: torch's layer_norm in the input dtype, as
    nn.LayerNorm (the two differ by one rounding in bf16, never in fp32)."""

    kind: Literal["layernorm"] = "layernorm"
    eps: float = Field(1e-5, gt=0)
    bias: bool = True
    upcast: bool = False


class RMSNormConfig(NormBase):
    """RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467): scale only, no mean, no bias."""

    kind: Literal["rmsnorm"] = "rmsnorm"
    eps: float = Field(1e-6, gt=0)


class UnitOffsetRMSNormConfig(NormBase):
    """RMSNorm with its gain stored as an offset from 1, x / rms(x) · (1 + w), the weight applied
    in fp32 before the cast back (Gemma, arXiv:2403.08295; src/attnlab/nn/norms_offset.py)."""

    kind: Literal["rmsnorm-unit-offset"] = "rmsnorm-unit-offset"
    eps: float = Field(1e-6, gt=0)


NormConfig = Annotated[
    Union[LayerNormConfig, RMSNormConfig, UnitOffsetRMSNormConfig], Field(discriminator="kind")
]
