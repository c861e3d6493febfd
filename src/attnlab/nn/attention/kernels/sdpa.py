"""torch's fused `scaled_dot_product_attention` where it is one call that builds no (T, S)
tensor: nothing masked, or the plain causal square (the flash path, `is_causal`), with or
without sinks (one more key, base.py `with_sink_key`) and dropout.

Anything with more structure is another kernel's, chosen by the selector (select.py): causal
ALiBi folded into an extra channel (alibi.py), BigBird's key blocks (block_gather.py), any mask
and bias in blocks of rows (chunked.py), or FlexAttention on CUDA (flex.py). Soft-capping is not
declared: c · tanh(s / c) acts on each score inside the softmax, and torch's fused kernel has no
hook for it (the flash kernels of FlashAttention-2 / -3 do; torch's sdpa does not expose it).
"""

from __future__ import annotations

import torch

from .base import KERNELS, Kernel, KernelCaps, masked_sdpa
from .call import AttnCall


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor | None]:
    causal = call.mask is not None and not call.mask.is_empty  # plain causal (`plain`)
    out = masked_sdpa(q, k, v, None, None, call.scale, call.dropout_p, causal, call.sinks)
    return out, None


def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall) -> str | None:
    m = call.mask
    if m is None or m.is_empty or (m.is_plain_causal and q.shape[2] == k.shape[2]):
        return None
    return (
        "its mask limits keys beyond the plain causal square (a window, padding, a cache's "
        "positions or a layout), which torch's sdpa takes only as a dense (T, S) tensor"
    )


CAPS = KernelCaps(bias=False, weights=False, dropout=True, backward=True, softcap=False, sinks=True)
KERNELS.register("sdpa")(Kernel(sdpa_attention, caps=CAPS, accepts=plain))
