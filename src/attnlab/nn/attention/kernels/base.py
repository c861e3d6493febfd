"""What every attention kernel shares: the contract, the registry, the block budget and the one
call into torch's fused sdpa with a mask and a bias block.

A kernel computes

    softmax(q kᵀ · scale + bias, masked) v

from q (B, H, T, D), k and v (B, H_kv, S, D) — H a multiple of H_kv (GQA/MQA: each group of
H / H_kv query heads shares one K/V head) — a mask description (masks.py: a `MaskDescription`,
whose `caps` say what more it offers) and a `ScoreBias` (bias.py), both descriptions, never
(T, S) tensors. Kernels that compute the same function sit in KERNELS and declare what they
support (`KernelCaps`); which one runs is a runtime choice (`attnlab.set_kernel`).

Memory: a kernel that works block by block keeps each transient (rows × S) block under
BLOCK_BYTES, and when what autograd would save across blocks exceeds SAVE_BYTES it recomputes
each block in backward instead (activation checkpointing), so memory stays linear in T.

Masked scores are filled with the dtype's most negative finite value rather than −inf: a row with
every key masked (a padding query) then gets a uniform average of v instead of NaN, in every kernel
alike, and its output is ignored downstream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ....registry import Registry

KernelFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

BLOCK_BYTES = 64 * 2**20  # the largest transient score/bias/mask block a blocked kernel builds
SAVE_BYTES = 256 * 2**20  # above this much saved for backward, blocks are recomputed instead


@dataclass(frozen=True, kw_only=True)
class KernelCaps:
    """What a kernel supports beyond q, k, v, a mask and a scale, by name (docs/architecture.md,
    "The seams", item 4): a caller asks `kernel.caps.backward`, never a position."""

    bias: bool  # takes a score bias (a ScoreBias description or a dense tensor)
    weights: bool  # returns the (B, H, T, S) attention weights with need_weights
    dropout: bool  # applies dropout_p > 0 to the attention weights
    backward: bool  # differentiable: usable for training


@dataclass(frozen=True)
class Kernel:
    """A kernel function (the contract above) and what it supports."""

    fn: KernelFn
    _: KW_ONLY
    caps: KernelCaps


KERNELS: Registry[Kernel] = Registry("attention kernel")


def masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    extra: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> torch.Tensor:
    """torch's fused sdpa with an optional (B, 1, tq, tk) bool mask and a (B|1, H|1, tq, tk) float
    bias folded into one additive mask; returns (B, H, tq, D)."""
    gqa = q.shape[1] != k.shape[1]  # enable_gqa: torch shares each K/V head, no repeat
    if allowed is None and extra is None:
        return F.scaled_dot_product_attention(
            q, k, v, None, dropout_p, is_causal, scale=scale, enable_gqa=gqa
        )
    add = torch.zeros((), dtype=q.dtype, device=q.device) if extra is None else extra.to(q.dtype)
    if allowed is not None:
        add = torch.where(allowed, add, torch.finfo(q.dtype).min)  # (B, 1|H, tq, tk)
        # a query that sees no key outputs mean(v), independent of q and k: zero q there so no
        # gradient leaks into q or k through the additive mask (naive's masked_fill gives none)
        q = q.masked_fill(~allowed.any(dim=-1, keepdim=True), 0)  # (B, 1, tq, 1) over q
    return F.scaled_dot_product_attention(
        q, k, v, add, dropout_p, False, scale=scale, enable_gqa=gqa
    )


_FUSED = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _FUSED else CheckpointPolicy.PREFER_RECOMPUTE


def recompute(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """fn(*args) under activation checkpointing that keeps what torch's fused attention returns
    (its output and log-sum-exp: O(rows), no score matrix) and recomputes everything else in
    backward — the key gathers, masks and bias blocks that would be O(rows × keys) — so backward
    re-runs the cheap preparation of a block, not its attention. (Selective activation
    checkpointing, torch.utils.checkpoint; an unfused attention is recomputed whole.)"""
    context = partial(create_selective_checkpoint_contexts, _keep_attention)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context)


def no_weights(kernel: str, need_weights: bool) -> None:
    if need_weights:
        raise ValueError(
            f"the {kernel} kernel does not return attention weights: use kernel 'naive'"
        )
