"""The default kernel: torch's fused `scaled_dot_product_attention`, with the structure of the
mask and bias chosen so that no (B, H, T, S) tensor is built.

    no bias, nothing masked                 one sdpa call
    no bias, plain causal (square, aligned) one sdpa call with is_causal (the flash path)
    causal ALiBi (a LinearBias)             the channel trick, alibi.py
    a block-sparse layout (BigBird)         gathered key blocks, block_gather.py
    anything else (T5, padding, windows,    the chunked kernel, chunked.py: blocks of query
      bidirectional ALiBi, caches)          rows, key ranges skipped, bias evaluated per block

For small inputs the chunked kernel runs one block — the same single sdpa call with an additive
mask as before — so nothing is lost on short sequences or decoding steps.
"""

from __future__ import annotations

import torch

from .. import bias as B_
from ..masks import MaskDescription
from . import block_gather
from .alibi import alibi_attention, applies
from .base import KERNELS, Kernel, KernelCaps, masked_sdpa, no_weights
from .chunked import chunked_attention


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskDescription | None,
    bias: B_.ScoreBias | torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    no_weights("sdpa", need_weights)
    bias = B_.as_bias(bias)
    if bias is None and (mask is None or mask.is_empty):
        return masked_sdpa(q, k, v, None, None, scale, dropout_p), None
    if bias is None and mask.is_plain_causal and q.shape[2] == k.shape[2]:
        return masked_sdpa(q, k, v, None, None, scale, dropout_p, is_causal=True), None
    if applies(bias):
        return alibi_attention(q, k, v, mask, bias, scale, dropout_p)
    if block_gather.applies(mask, bias):
        return block_gather.block_gather_attention(q, k, v, mask, bias, scale, dropout_p)
    return chunked_attention(q, k, v, mask, bias, scale, dropout_p)


KERNELS.register("sdpa")(
    Kernel(sdpa_attention, caps=KernelCaps(bias=True, weights=False, dropout=True, backward=True))
)
