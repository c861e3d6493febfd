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

Sinks (base.py) are one more key on every path above but the two ALiBi / block-sparse tricks,
whose masks and biases go to the chunked kernel with them: exact, and the unmasked and plain
causal calls stay single fused calls (`masked_sdpa`). Soft-capping is declared unsupported
(caps.softcap False): c · tanh(s / c) acts on each score inside the softmax, and torch's fused
kernel has no hook for it (the flash kernels of FlashAttention-2 / -3 do, torch's sdpa does not
expose it), so the attention layer runs a soft-capped layer on the chunked kernel instead.
"""

from __future__ import annotations

import torch

from .. import bias as B_
from ..masks import MaskDescription
from . import block_gather
from .alibi import alibi_attention, applies
from .base import KERNELS, Kernel, KernelCaps, check_transforms, masked_sdpa, no_weights
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
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    no_weights("sdpa", need_weights)
    check_transforms("sdpa", CAPS, softcap, None)
    bias = B_.as_bias(bias)
    if sinks is not None:
        return _with_sinks(q, k, v, mask, bias, scale, dropout_p, sinks), None
    if bias is None and (mask is None or mask.is_empty):
        return masked_sdpa(q, k, v, None, None, scale, dropout_p), None
    if bias is None and mask.is_plain_causal and q.shape[2] == k.shape[2]:
        return masked_sdpa(q, k, v, None, None, scale, dropout_p, is_causal=True), None
    if applies(bias):
        return alibi_attention(q, k, v, mask, bias, scale, dropout_p)
    if block_gather.applies(mask, bias):
        return block_gather.block_gather_attention(q, k, v, mask, bias, scale, dropout_p)
    return chunked_attention(q, k, v, mask, bias, scale, dropout_p)


def _with_sinks(q, k, v, mask, bias, scale, dropout_p, sinks) -> torch.Tensor:
    """The same dispatch with the sinks as one more key: one fused call when nothing is masked
    or the mask is plain causal, the chunked kernel otherwise (its blocks carry the sink key)."""
    if bias is None and (mask is None or mask.is_empty):
        return masked_sdpa(q, k, v, None, None, scale, dropout_p, sinks=sinks)
    if bias is None and mask.is_plain_causal and q.shape[2] == k.shape[2]:
        return masked_sdpa(q, k, v, None, None, scale, dropout_p, is_causal=True, sinks=sinks)
    return chunked_attention(q, k, v, mask, bias, scale, dropout_p, sinks=sinks)[0]


CAPS = KernelCaps(bias=True, weights=False, dropout=True, backward=True, softcap=False, sinks=True)
KERNELS.register("sdpa")(Kernel(sdpa_attention, caps=CAPS))
