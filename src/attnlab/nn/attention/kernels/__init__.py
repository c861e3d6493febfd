"""Attention kernels, one file each; importing this package registers them all in KERNELS.

naive        the formula written out; the oracle (returns weights)        naive.py
sdpa         torch's fused kernel: nothing masked or plain causal          sdpa.py
chunked      any bias / mask, blocks of query rows, linear memory          chunked.py
alibi-sdpa   causal ALiBi folded into one extra q/k channel                alibi.py
block-gather block-sparse layouts (BigBird): gathered key blocks           block_gather.py
tiled        FlashAttention's online softmax in plain torch, to read       tiled.py
flex         FlexAttention from the mask and bias descriptions (CUDA;      flex.py
             forward-only on the CPU)
paged        the engine's decode step over the paged pool in place (CPU)   paged.py
paged-flex   the same through FlexAttention, its BlockMask from the rows'  paged_flex.py
             block tables (CUDA's; runs on the CPU when named)

Every kernel is fn(q, k, v, call: AttnCall) (call.py); which one runs is select.py's choice.
"""

from . import alibi, block_gather, chunked, flex, naive, paged, paged_flex, sdpa, tiled  # noqa: F401
from .alibi import alibi_attention
from .base import BLOCK_BYTES, KERNELS, SAVE_BYTES, Kernel, KernelCaps, masked_sdpa
from .block_gather import block_gather_attention
from .call import AttnCall, PagedKV
from .chunked import chunked_attention
from .naive import naive_attention
from .sdpa import sdpa_attention
from .select import AUTO, PREFERENCE, Choice, NoKernelError, attend, choose
from .tiled import tiled_attention

__all__ = [
    "AUTO",
    "BLOCK_BYTES",
    "KERNELS",
    "PREFERENCE",
    "SAVE_BYTES",
    "AttnCall",
    "Choice",
    "Kernel",
    "KernelCaps",
    "NoKernelError",
    "PagedKV",
    "alibi_attention",
    "attend",
    "block_gather_attention",
    "choose",
    "chunked_attention",
    "masked_sdpa",
    "naive_attention",
    "sdpa_attention",
    "tiled_attention",
]
