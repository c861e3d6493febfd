"""Attention: the layer, its kernels and masks."""

from .bias import DenseBias, LinearBias, ScoreBias
from .block_sparse import BlockSparseAttention, BlockSparseMask
from .heads import HeadGeometry, HeadProjections
from .kernels import (
    KERNELS,
    AttnCall,
    Kernel,
    KernelCaps,
    attend,
    choose,
    chunked_attention,
    naive_attention,
    sdpa_attention,
)
from .layer import ATTENTIONS, Attention, AttnContext, record_choices, set_kernel
from .linear import FEATURE_MAPS, LinearAttention
from .longformer import LongformerAttention
from .masks import GlobalRows, MaskCaps, MaskDescription, MaskSpec
from .mla import MultiHeadLatentAttention
from .xl import XLAttention

__all__ = [
    "ATTENTIONS",
    "FEATURE_MAPS",
    "KERNELS",
    "Attention",
    "AttnCall",
    "AttnContext",
    "BlockSparseAttention",
    "BlockSparseMask",
    "DenseBias",
    "GlobalRows",
    "HeadGeometry",
    "HeadProjections",
    "Kernel",
    "KernelCaps",
    "LinearAttention",
    "LinearBias",
    "LongformerAttention",
    "MaskCaps",
    "MaskDescription",
    "MaskSpec",
    "MultiHeadLatentAttention",
    "ScoreBias",
    "XLAttention",
    "attend",
    "choose",
    "chunked_attention",
    "naive_attention",
    "record_choices",
    "sdpa_attention",
    "set_kernel",
]
