"""What every attention kernel shares: the contract, the registry, the block budget and the one
call into torch's fused sdpa with a mask and a bias block.

A kernel computes

    softmax([cap(q kᵀ · scale) + bias, masked ; sink_h]) v      cap(s) = c · tanh(s / c)

from q (B, H, T, D), k and v (B, H_kv, S, D) — H a multiple of H_kv (GQA/MQA: each group of
H / H_kv query heads shares one K/V head) — a mask description (masks.py: a `MaskDescription`,
whose `caps` say what more it offers) and a `ScoreBias` (bias.py), both descriptions, never
(T, S) tensors. Kernels that compute the same function sit in KERNELS and declare what they
support (`KernelCaps`); which one runs is a runtime choice (`attnlab.set_kernel`).

Two optional score transforms, keyword arguments of every kernel that declares them:
- `softcap` c (Gemma 2, arXiv:2408.00118, section 2.2: logit soft-capping, c = 50 for attention):
  the scaled scores pass through c · tanh(s / c) before the bias and the mask are added, in
  transformers' order (models/gemma2/modeling_gemma2.py, eager_attention_forward). A function of
  each score, but inside the softmax: torch's fused sdpa has no hook for it, so a kernel built on
  sdpa's fused path cannot apply it (caps.softcap False) and the attention layer then runs the
  chunked kernel, which forms each block's scores itself.
- `sinks` (H,) (GPT-OSS, arXiv:2508.10925, "attention sinks"; Xiao et al. 2023,
  arXiv:2309.17453): a learned logit per head, one more column of every softmax row's
  denominator with no value, so a row can put weight on nothing. On sdpa it is exact as one more
  key (`with_sink_key`): an extra q/k channel whose dot product is the sink, a zero value.
A query that sees no key outputs mean(v) (below); with sinks its whole weight goes to the sink and
it outputs 0 (`empty_rows_value`).

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
from .call import AttnCall

KernelFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

BLOCK_BYTES = 64 * 2**20  # the largest transient score/bias/mask block a blocked kernel builds
SAVE_BYTES = 256 * 2**20  # above this much saved for backward, blocks are recomputed instead


FLOATS = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})
ANY_DEVICE = frozenset({"cpu", "cuda"})


@dataclass(frozen=True, kw_only=True)
class KernelCaps:
    """What a kernel supports beyond q, k, v, a mask and a scale, by name (docs/architecture.md,
    "The seams", item 4): a caller asks `kernel.why_not(q, k, v, call)`, never a position."""

    bias: bool  # takes a score bias (a ScoreBias description)
    weights: bool  # returns the (B, H, T, S) attention weights with need_weights
    dropout: bool  # applies dropout_p > 0 to the attention weights
    backward: bool  # differentiable: usable for training
    softcap: bool = False  # applies `softcap` c · tanh(s / c) to the scaled scores
    sinks: bool = False  # takes `sinks`, a (H,) logit per head in every softmax denominator
    devices: frozenset[str] = ANY_DEVICE  # device types it runs on
    backward_devices: frozenset[str] = ANY_DEVICE  # ... and is differentiable on
    dtypes: frozenset[torch.dtype] = FLOATS  # dtypes of q, k, v it computes in
    layouts: frozenset[str] = frozenset({"dense"})  # how K/V reach it (call.py, `Layout`)


# a kernel's own test of a call beyond its caps: None when it serves the call, else why not
Accepts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttnCall], str | None]


@dataclass(frozen=True)
class Kernel:
    """A kernel function (the contract above) and what it supports."""

    fn: KernelFn
    _: KW_ONLY
    caps: KernelCaps
    accepts: Accepts | None = None

    def why_not(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        call: AttnCall,
        device: str | None = None,
    ) -> str | None:
        """None when this kernel computes `call` over q, k, v; otherwise the reason, a clause
        that completes "it cannot serve this call: ..." (vLLM's backend validation reasons).
        `device`: the device type to decide for (default q's; the tests ask for "cuda" on the
        CPU, where the selector's CUDA decisions are tested)."""
        c = self.caps
        device = device or q.device.type
        if device not in c.devices:
            return f"it runs on {' / '.join(sorted(c.devices))}, not {device}"
        if q.dtype not in c.dtypes:
            return f"it does not compute in {str(q.dtype).removeprefix('torch.')}"
        if call.layout not in c.layouts:
            return f"it does not read the {call.layout} K/V layout"
        if call.need_weights and not c.weights:
            return "it does not return attention weights (kernel 'naive' does)"
        if call.dropout_p > 0 and not c.dropout:
            return "it has no attention dropout"
        if call.bias is not None and not c.bias:
            return f"it takes no score bias ({type(call.bias).__name__})"
        if call.softcap is not None and not c.softcap:
            return "it cannot soft-cap scores (torch's fused sdpa has no hook for it)"
        if call.sinks is not None and not c.sinks:
            return "it takes no attention sinks"
        grad_here = c.backward and device in c.backward_devices
        if not grad_here and call.needs_grad(q, k, v):
            where = "" if not c.backward else f" on {device}"
            return f"it is not differentiable{where} and this call needs gradients"
        return self.accepts(q, k, v, call) if self.accepts is not None else None


KERNELS: Registry[Kernel] = Registry("attention kernel")


# A call of at most this many query rows (a decode step, a small chunk) is "few rows": its mask
# and bias as dense (B, ·, T, S) tensors are the size of one row of K, so sdpa takes them as
# tensors, and "auto" prefers the naive kernel to the chunked one (its whole score matrix is no
# larger than one of chunked's blocks, and it plans nothing on the host: one graph for every step
# of compiled decoding, src/attnlab/decode/compiled_step.py)
DENSE_ROWS = 16


def masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    extra: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch's fused sdpa with an optional (B, 1, tq, tk) bool mask and a (B|1, H|1, tq, tk) float
    bias folded into one additive mask, and optional (H,) sinks as one more key
    (`with_sink_key`); returns (B, H, tq, D)."""
    gqa = q.shape[1] != k.shape[1]  # enable_gqa: torch shares each K/V head, no repeat
    D = q.shape[-1]
    if allowed is not None:
        # a query that sees no key outputs mean(v), independent of q and k: zero q there so no
        # gradient leaks into q or k through the additive mask (naive's masked_fill gives none);
        # with sinks its sink channel stays, so all its weight goes to the sink (output 0)
        q = q.masked_fill(~allowed.any(dim=-1, keepdim=True), 0)  # (B, 1, tq, 1) over q
    if sinks is not None and is_causal and allowed is None and extra is None:
        # the sink key first and one dummy query row before q: row t + 1 of the causal square
        # then sees the sink and keys 0 .. t, still sdpa's is_causal (flash) path
        q2, k2, v2 = with_sink_key(q, k, v, sinks, scale, first=True)
        q2 = torch.cat((q2.new_zeros(*q2.shape[:2], 1, D + 1), q2), dim=2)  # (B, H, 1 + tq, D + 1)
        out = F.scaled_dot_product_attention(
            q2, k2, v2, None, dropout_p, True, scale=scale, enable_gqa=gqa
        )
        return out[:, :, 1:, :D]
    if sinks is not None:
        if is_causal:  # a causal square as a mask, the sink column after it
            T, S = q.shape[2], k.shape[2]
            allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()[None, None]
        q, k, v = with_sink_key(q, k, v, sinks, scale)  # the sink key last
        if allowed is not None:  # every query sees the sink
            allowed = F.pad(allowed, (0, 1), value=True)  # (B, 1, tq, tk + 1)
        if extra is not None:
            extra = F.pad(extra, (0, 1))  # the sink's bias is in its channel: 0 here
        is_causal = False
    if allowed is None and extra is None:
        out = F.scaled_dot_product_attention(
            q, k, v, None, dropout_p, is_causal, scale=scale, enable_gqa=gqa
        )
        return out[..., :D]
    add = torch.zeros((), dtype=q.dtype, device=q.device) if extra is None else extra.to(q.dtype)
    if allowed is not None:
        add = torch.where(allowed, add, torch.finfo(q.dtype).min)  # (B, 1|H, tq, tk)
    out = F.scaled_dot_product_attention(
        q, k, v, add, dropout_p, False, scale=scale, enable_gqa=gqa
    )
    return out[..., :D]


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


def full_precision(x: torch.Tensor):
    """A context in which the scores a kernel forms itself stay in the dtype it chose (fp32):
    autocast off on x's device. Under autocast a matmul of fp32 inputs runs in 16 bits again, and
    a mask filled with float32's minimum then overflows the 16-bit block (Gemma 2 under bf16)."""
    return torch.autocast(x.device.type, enabled=False)


def cap(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's soft-capping c · tanh(s / c) of scaled scores (None: s unchanged)."""
    return s if softcap is None else torch.tanh(s / softcap) * softcap


def with_sink_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sinks as one more key, exactly, for sdpa: a channel D whose product is the sink,

        q' = [q, sink_h]    k' = [k, 0]; [0, 1/scale] appended    v' = [v, 0]; [0, 0] appended

    so scale · q'·k' is q·k·scale for every real key and sink_h for the appended one, whose value
    is zero: it adds exp(sink_h) to the denominator only. One K/V head's sink key serves all its
    query heads (the channel carries each query head's own sink). q (B, H, tq, D), k, v
    (B, H_kv, tk, D) -> q' (B, H, tq, D + 1), k', v' (B, H_kv, tk + 1, D + 1), the sink key
    last (`first`: at index 0); the caller keeps out[..., :D] and lets every query see it."""
    B, H, tq, _ = q.shape
    H_kv, D = k.shape[1], k.shape[-1]
    q2 = torch.cat((q, sinks.to(q.dtype)[None, :, None, None].expand(B, H, tq, 1)), dim=-1)
    sink_k = torch.zeros(B, H_kv, 1, D + 1, dtype=k.dtype, device=k.device)
    sink_k[..., D] = 1.0 / scale
    k2 = torch.cat((k, k.new_zeros(*k.shape[:-1], 1)), dim=-1)  # (B, H_kv, tk, D + 1)
    v2 = torch.cat((v, v.new_zeros(*v.shape[:-1], 1)), dim=-1)
    sink_v = v.new_zeros(B, H_kv, 1, D + 1)
    pair = ((sink_k, k2), (sink_v, v2)) if first else ((k2, sink_k), (v2, sink_v))
    return q2, torch.cat(pair[0], dim=2), torch.cat(pair[1], dim=2)


def empty_rows_value(v: torch.Tensor, H: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """(B, H, 1, D): what a query that sees no key outputs: the mean of all S values (the naive
    kernel's uniform softmax over fully masked scores), or 0 with sinks (the sink takes it all)."""
    if sinks is not None:
        return v.new_zeros(v.shape[0], H, 1, v.shape[-1])
    return v.mean(dim=2, keepdim=True).repeat_interleave(H // v.shape[1], dim=1)
