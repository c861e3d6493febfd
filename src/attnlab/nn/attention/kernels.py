"""Attention kernels: functions that compute the same thing, a runtime choice.

    softmax(q k^T · scale + bias, masked) v

q (B, H, T, D); k, v (B, H_kv, S, D) with H a multiple of H_kv (GQA/MQA: each group of
H / H_kv query heads shares one K/V head). `naive` is the readable reference and the test oracle;
`sdpa` calls torch's fused `scaled_dot_product_attention` (flash / memory-efficient / math,
chosen by torch). Each kernel declares what it supports so callers can fail early.

Masked scores are filled with the dtype's most negative finite value rather than -inf: a row
with every key masked (a padding query) then gets a uniform average instead of NaN, in both
kernels alike, and its output is ignored downstream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...registry import Registry
from .masks import MaskSpec

KernelFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class Kernel:
    fn: KernelFn
    supports_bias: bool
    returns_weights: bool
    supports_dropout: bool
    supports_backward: bool


KERNELS: Registry[Kernel] = Registry("attention kernel")


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskSpec | None,
    bias: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    group = q.shape[1] // k.shape[1]  # H / H_kv query heads share each K/V head
    # (B, H_kv, S, D) -> (B, H, S, D): K/V head j serves query heads j·group .. (j+1)·group - 1
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    # scores and softmax in fp32: exp() of bf16 scores loses the small differences that matter
    # (B, H, T, D) @ (B, H, D, S) -> (B, H, T, S)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias  # + (B, H, T, S) score bias
    allowed = mask.dense() if mask is not None else None  # (B, 1, T, S) bool, or None
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)  # same mask per head
    weights = scores.softmax(dim=-1).to(q.dtype)  # (B, H, T, S), each row sums to 1
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    # (B, H, T, S) @ (B, H, S, D) -> (B, H, T, D)
    return torch.matmul(dropped, v), (weights if need_weights else None)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskSpec | None,
    bias: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if need_weights:
        raise ValueError("the sdpa kernel does not return attention weights: use kernel 'naive'")
    # q (B, H, T, D), k/v (B, H_kv, S, D): enable_gqa lets torch share each K/V head among
    # H / H_kv query heads without repeating them; every call returns (B, H, T, D)
    gqa = q.shape[1] != k.shape[1]
    if bias is None and (mask is None or mask.is_empty):
        out = F.scaled_dot_product_attention(
            q, k, v, None, dropout_p, False, scale=scale, enable_gqa=gqa
        )
        return out, None
    if bias is None and mask is not None and mask.is_plain_causal and q.shape[2] == k.shape[2]:
        out = F.scaled_dot_product_attention(
            q, k, v, None, dropout_p, True, scale=scale, enable_gqa=gqa
        )
        return out, None
    # one additive float mask carries both the bias and the masked positions: a () zero or the
    # (B, H, T, S) bias, with the dtype's most negative value where the mask forbids
    extra = torch.zeros((), dtype=q.dtype, device=q.device) if bias is None else bias.to(q.dtype)
    allowed = mask.dense() if mask is not None else None  # (B, 1, T, S) bool, or None
    if allowed is not None:
        extra = torch.where(allowed, extra, torch.finfo(q.dtype).min)  # (B, 1|H, T, S)
        # a query that sees no key outputs mean(v), independent of q and k: zero q there so no
        # gradient leaks into q or k through the additive mask (naive's masked_fill gives none)
        q = q.masked_fill(~allowed.any(dim=-1, keepdim=True), 0)  # (B, 1, T, 1) over (B, H, T, D)
    out = F.scaled_dot_product_attention(
        q, k, v, extra, dropout_p, False, scale=scale, enable_gqa=gqa
    )
    return out, None


KERNELS.register("naive")(Kernel(naive_attention, True, True, True, True))
KERNELS.register("sdpa")(Kernel(sdpa_attention, True, False, True, True))
