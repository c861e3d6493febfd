"""torch's fused `scaled_dot_product_attention` where it is one call that builds no (T, S)
tensor: nothing masked, or the plain causal square (the flash path, `is_causal`), with or
without sinks (one more key, base.py `with_sink_key`) and dropout. A call of at most DENSE_ROWS
query rows (a decode step) takes any mask and score bias as dense (B, ·, T, S) tensors, which
are then the size of a row of K: one fused call of one shape for every step (compiled decoding).

Anything with more structure is another kernel's, chosen by the selector (select.py): causal
ALiBi folded into an extra channel (alibi.py), BigBird's key blocks (block_gather.py), any mask
and bias in blocks of rows (chunked.py), or FlexAttention on CUDA (flex.py). Soft-capping is not
declared: c · tanh(s / c) acts on each score inside the softmax, and torch's fused kernel has no
hook for it (the flash kernels of FlashAttention-2 / -3 do; torch's sdpa does not expose it).
"""

from __future__ import annotations

import torch

from .base import DENSE_ROWS, KERNELS, Kernel, KernelCaps, masked_sdpa
from .call import AttnCall

_WIDE = (torch.float32, torch.float64)


def _square(q: torch.Tensor, k: torch.Tensor, call: AttnCall) -> bool:
    """No bias, and nothing masked or the plain causal square: sdpa's own `is_causal`."""
    m = call.mask
    plain_mask = m is None or m.is_empty or (m.is_plain_causal and q.shape[2] == k.shape[2])
    return plain_mask and call.bias is None


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if _square(q, k, call):
        causal = call.mask is not None and not call.mask.is_empty
        out = masked_sdpa(q, k, v, None, None, call.scale, call.dropout_p, causal, call.sinks)
    else:  # a few query rows (`plain`): the mask and bias as dense tensors
        m, bias = call.mask, call.bias
        allowed = m.dense() if m is not None else None  # (B | 1, planes, T, S), or None
        extra = bias.dense() if bias is not None else None  # (B | 1, H, T, S)
        out = masked_sdpa(q, k, v, allowed, extra, call.scale, call.dropout_p, False, call.sinks)
    return out, None


def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall) -> str | None:
    few = q.shape[2] <= DENSE_ROWS and call.layout == "dense"
    # a bias folded into sdpa's additive mask takes q's dtype: in bf16 / fp16 a small ALiBi
    # slope's far-key bias would be rounded (flex and chunked add it in fp32)
    if _square(q, k, call) or (few and (call.bias is None or q.dtype in _WIDE)):
        return None
    if few:
        return f"its score bias would be folded into a {q.dtype} mask (fp32 and fp64 only)"
    what = (
        "its score bias"
        if call.bias is not None
        else "its mask, which limits keys beyond the plain causal square (a window, padding, "
        "a cache's positions or a layout),"
    )
    return (
        f"{what} spans more than {DENSE_ROWS} query rows: torch's sdpa takes it only as a "
        f"dense (T, S) tensor"
    )


CAPS = KernelCaps(bias=True, weights=False, dropout=True, backward=True, softcap=False, sinks=True)
KERNELS.register("sdpa")(Kernel(sdpa_attention, caps=CAPS, accepts=plain))
