"""Relative biases and positional masks as Toeplitz views, for the blocked kernels (chunked.py).

ALiBi's and T5's biases, and causal and window masks, depend on the offset k − q alone
(`ScoreBias.offsets`, `MaskSpec.offset_allowed`). When every query and key position is
consecutive (training, prefill, a cache) the whole pass's bias and mask are one vector over the
T + S − 1 offsets, evaluated once per call (T5: one bucket and table lookup per offset, not per
query × key), masked offsets set to the dtype's most negative value. A block of query rows
r0 .. r1 − 1 × keys c0 .. c1 − 1 is a Toeplitz matrix of a slice of it; with its query rows
reversed (row i' = r1 − 1 − i' ... the lowest offset first) row i' is values[a + i' : a + i' + tk],
so `unfold` gives the block as a view with strides (L, 1, 1),

    values   [ o_lo  o_lo+1  ...                 o_hi ]        (H, T + S − 1)
    block    row tq−1 (query r0):  values[a + tq − 1 : a + tq − 1 + tk]
             row 0 (query r1 − 1): values[a : a + tk]          a = c0 − r1 + T

which torch's sdpa reads in place: the block's bias is never written out, and each call reverses
the block's (tq, D) query rows to match and its output back.

Gradients. A bias without parameters (ALiBi, a mask) goes through sdpa's fused kernel, backward
included, saving only its inputs, output and log-sum-exp. T5's table needs the bias gradient,
which torch's fused CPU kernel does not give (a mask that requires grad sends sdpa to its unfused
path, which keeps the whole probability block), so `OffsetBiasAttention` runs the fused forward and
backward for q, k, v and adds the bias gradient itself: dS = P ⊙ (dP − rowsum(dO ⊙ O)) with P
recomputed from the saved log-sum-exp and dP = dO Vᵀ (FlashAttention-2's backward, Dao 2023,
arXiv:2307.08691, algorithm 2), and each diagonal of dS summed into its offset (unfold's
backward), so the table's gradient costs one lookup per offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import bias as B_

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class OffsetPlan:
    """A pass's bias and mask as one vector over its offsets (the module docstring)."""

    values: torch.Tensor  # (H | 1, T + S − 1) in q's dtype, offsets lo .. hi, masked at min
    T: int
    S: int

    @classmethod
    def of(cls, mask, bias: B_.ScoreBias | None, T: int, S: int, dtype: torch.dtype):
        """The plan, or None unless the bias (if any) and the mask (if any) are functions of the
        offset alone over consecutive positions and every query sees some key (the general
        path handles rows that see none)."""
        if bias is None and mask is None:
            return None
        if bias is not None and type(bias).offsets is B_.ScoreBias.offsets:
            return None  # not a relative bias (a dense tensor, block-sparse key counts, ...)
        if mask is not None and not mask.caps.offsets:
            return None  # not positional (block-sparse layouts are not Toeplitz)
        los = set()
        for d in (bias, mask):
            if d is None:
                continue
            if d.q_positions.shape[1] != T or d.k_positions.shape[1] != S:
                return None
            q0 = B_.start_if_consecutive(d.q_positions, B_.ALL)
            k0 = B_.start_if_consecutive(d.k_positions, B_.ALL)
            if q0 is None or k0 is None:
                return None
            los.add(k0 - (q0 + T - 1))  # the offset of query T − 1 and key 0, the lowest
        if len(los) != 1:
            return None
        lo = los.pop()
        hi = lo + T + S - 2
        allowed = None
        if mask is not None:
            allowed = mask.offset_allowed(lo, hi)  # (L,) bool
            if allowed is None:
                return None  # padding or global tokens: not a function of the offset
            # query t sees the offsets allowed[T − 1 − t : T − 1 − t + S]: count them
            seen = F.pad(allowed.cumsum(0), (1, 0))  # (L + 1,)
            starts = torch.arange(T - 1, -1, -1, device=seen.device)  # query t -> T − 1 − t
            if bool(((seen[starts + S] - seen[starts]) == 0).any()):
                return None
            allowed = None if bool(allowed.all()) else allowed
        if bias is not None:
            values = bias.offsets(lo, hi).to(dtype)  # (H, L)
        else:  # a mask alone: one plane for every head
            values = torch.zeros(1, T + S - 1, dtype=dtype, device=mask.q_positions.device)
        if allowed is not None:
            values = values.masked_fill(~allowed, torch.finfo(dtype).min)
        return cls(values, T, S)

    def flipped_block(self, rows: slice, keys: slice) -> tuple[torch.Tensor, int]:
        """(the (H | 1, tq + tk − 1) slice of values a block spans, tk): the block, query rows
        reversed, is `slice.unfold(-1, tk, 1)`."""
        r0, r1, _ = rows.indices(self.T)
        c0, c1, _ = keys.indices(self.S)
        tq, tk = r1 - r0, c1 - c0
        a = c0 - r1 + self.T  # where the block's lowest offset sits in values
        return self.values[:, a : a + tq + tk - 1], tk

    @property
    def learnable(self) -> bool:
        return self.values.requires_grad and torch.is_grad_enabled()


class OffsetBiasAttention(torch.autograd.Function):
    """sdpa(q_flipped, k, v, unfold(values)) with the gradient of `values` too (module
    docstring): q (B, H, tq, D) rows reversed, k, v (B, H, tk, D), values (H, tq + tk − 1)."""

    @staticmethod
    def forward(ctx, q, k, v, values, tk: int, scale: float):
        extra = values.unfold(-1, tk, 1)[None]  # (1, H, tq, tk), a view
        out, lse = _flash(q, k, v, 0.0, False, attn_mask=extra, scale=scale)  # lse (B, H, tq)
        ctx.save_for_backward(q, k, v, values, out, lse)
        ctx.tk, ctx.scale = tk, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, values, out, lse = ctx.saved_tensors
        extra = values.unfold(-1, ctx.tk, 1)[None]  # (1, H, tq, tk)
        dout = dout.contiguous()
        dq, dk, dv = _flash_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=extra, scale=ctx.scale
        )
        dvalues = None
        if ctx.needs_input_grad[3]:
            # P = exp(q kᵀ·scale + bias − lse), (B, H, tq, tk), built in place
            p = torch.matmul(q, k.transpose(-1, -2)).mul_(ctx.scale).add_(extra)
            p = p.sub_(lse[..., None]).exp_()
            # dS = P ⊙ (dO vᵀ − rowsum(dO ⊙ O)), (B, H, tq, tk)
            ds = torch.matmul(dout, v.transpose(-1, -2))
            ds = ds.sub_((dout * out).sum(dim=-1, keepdim=True)).mul_(p).sum(dim=0)  # (H, ..)
            # each diagonal of dS into its offset: unfold's backward, (H, tq + tk − 1)
            dvalues = torch.ops.aten.unfold_backward(ds, values.shape, -1, ctx.tk, 1)
        return dq, dk, dv, dvalues, None, None


def offset_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: OffsetPlan,
    rows: slice,
    keys: slice,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """One block through the plan: q (B, H, tq, D), k, v (B, H_kv, tk, D) -> (B, H, tq, D)."""
    values, tk = plan.flipped_block(rows, keys)  # (H | 1, tq + tk − 1)
    qf = q.flip(2)  # the rows in the order of the view's
    if plan.learnable and dropout_p == 0.0 and q.dtype == torch.float32:
        if k.shape[1] != q.shape[1]:  # GQA: the fused op takes one K/V head per query head
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = OffsetBiasAttention.apply(qf, k.contiguous(), v.contiguous(), values, tk, scale)
    else:
        extra = values.unfold(-1, tk, 1)[None]  # (1, H | 1, tq, tk), rows reversed
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(
            qf, k, v, extra, dropout_p, False, scale=scale, enable_gqa=gqa
        )
    return out.flip(2)  # (B, H, tq, D), rows in order again


def saves_linear(plan: OffsetPlan, q: torch.Tensor, dropout_p: float) -> bool:
    """Whether autograd keeps O(rows) per block (the fused kernel's inputs, output and
    log-sum-exp), so that recomputing blocks in backward would buy nothing."""
    if dropout_p != 0.0:
        return False
    return q.dtype == torch.float32 or not plan.values.requires_grad
