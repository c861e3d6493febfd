"""Attention: the layer, its kernels and masks."""

from .bias import DenseBias, LinearBias, ScoreBias
from .kernels import KERNELS, Kernel, chunked_attention, naive_attention, sdpa_attention
from .layer import ATTENTIONS, Attention, AttnContext, set_kernel
from .linear import FEATURE_MAPS, LinearAttention
from .masks import MaskSpec

__all__ = [
    "ATTENTIONS",
    "FEATURE_MAPS",
    "KERNELS",
    "Attention",
    "AttnContext",
    "DenseBias",
    "Kernel",
    "LinearAttention",
    "LinearBias",
    "MaskSpec",
    "ScoreBias",
    "chunked_attention",
    "naive_attention",
    "sdpa_attention",
    "set_kernel",
]
