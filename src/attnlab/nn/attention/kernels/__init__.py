"""Attention kernels, one file each; importing this package registers them all in KERNELS.

naive       the formula written out; the oracle (returns weights)         naive.py
sdpa        torch's fused kernel, structure-aware dispatch (default)      sdpa.py
chunked     any bias / mask, blocks of query rows, linear memory          chunked.py
alibi-sdpa  causal ALiBi folded into one extra q/k channel                alibi.py
block-gather block-sparse layouts (BigBird): gathered key blocks          block_gather.py
tiled       FlashAttention's online softmax in plain torch, to read       tiled.py
"""

from . import alibi, block_gather, chunked, naive, sdpa, tiled  # noqa: F401  (registration)
from .alibi import alibi_attention
from .base import BLOCK_BYTES, KERNELS, SAVE_BYTES, Kernel, KernelCaps, masked_sdpa
from .block_gather import block_gather_attention
from .chunked import chunked_attention
from .naive import naive_attention
from .sdpa import sdpa_attention
from .tiled import tiled_attention

__all__ = [
    "BLOCK_BYTES",
    "KERNELS",
    "SAVE_BYTES",
    "Kernel",
    "KernelCaps",
    "alibi_attention",
    "block_gather_attention",
    "chunked_attention",
    "masked_sdpa",
    "naive_attention",
    "sdpa_attention",
    "tiled_attention",
]
