"""Attention: the layer, its kernels and masks."""

from .kernels import KERNELS, Kernel, naive_attention, sdpa_attention
from .layer import Attention, AttnContext, set_kernel
from .masks import MaskSpec

__all__ = [
    "KERNELS",
    "Attention",
    "AttnContext",
    "Kernel",
    "MaskSpec",
    "naive_attention",
    "sdpa_attention",
    "set_kernel",
]
