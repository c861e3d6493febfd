"""The naive kernel: the formula, written out. The readable reference and the test oracle: it
materialises the whole (B, H, T, S) score matrix (and the dense bias and mask), which is exactly
what the other kernels avoid. Soft-capping and sinks (base.py) are written out too: the capped
scores, then the bias and mask, then the sink as one more column whose weight is dropped."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import KERNELS, Kernel, KernelCaps, cap, full_precision
from .call import AttnCall


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor | None]:
    mask, bias, scale, softcap, sinks = call.mask, call.bias, call.scale, call.softcap, call.sinks
    group = q.shape[1] // k.shape[1]  # H / H_kv query heads share each K/V head
    # (B, H_kv, S, D) -> (B, H, S, D): K/V head j serves query heads j·group .. (j+1)·group - 1
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    # scores and softmax in fp32: exp() of bf16 scores loses the small differences that matter
    # (B, H, T, D) @ (B, H, D, S) -> (B, H, T, S)
    with full_precision(q):  # fp32 under autocast too
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = cap(scores, softcap)  # c · tanh(s / c), before the bias and mask (Gemma 2)
    if bias is not None:
        scores = scores + bias.dense()  # + (B|1, H, T, S) score bias
    allowed = mask.dense() if mask is not None else None  # (B, 1, T, S) bool, or None
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)  # same mask per head
    if sinks is not None:  # one more column per row, the head's sink: (B, H, T, S + 1)
        column = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, column), dim=-1)
    weights = scores.softmax(dim=-1).to(q.dtype)  # (B, H, T, S[+1]), each row sums to 1
    if sinks is not None:  # the sink's column has no value: rows now sum to 1 - its weight
        weights = weights[..., :-1]
    dropped = F.dropout(weights, call.dropout_p) if call.dropout_p > 0 else weights
    # (B, H, T, S) @ (B, H, S, D) -> (B, H, T, D)
    return torch.matmul(dropped, v), (weights if call.need_weights else None)


CAPS = KernelCaps(bias=True, weights=True, dropout=True, backward=True, softcap=True, sinks=True)
KERNELS.register("naive")(Kernel(naive_attention, caps=CAPS))
