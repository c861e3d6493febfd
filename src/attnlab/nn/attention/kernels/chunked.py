"""The chunked exact kernel: any bias description, any mask, memory linear in T.

    for each block of query rows:
        keys  = the keys some row of the block may see (causal edge, window,    skip the rest
            global keys: a range, or sorted indices gathered)
        bias  = bias.block(rows, keys)      (B|1, H, rows, keys), evaluated for this block only
        mask  = mask.block(rows, keys)      (B, 1, rows, keys)
        out[rows] = sdpa(q[rows], k[keys], v[keys], bias + mask)

The same function as the naive kernel, computed a block at a time: the largest transient tensor is
one block (at most BLOCK_BYTES, base.py), never (B, H, T, S). In training, when what autograd
would keep for every block exceeds SAVE_BYTES, each block is recomputed in backward (activation
checkpointing), so learnable bias parameters (T5's table) get their exact gradients from the
recomputed blocks and memory still stays linear in T. This is what FlashAttention does inside one
kernel, done here around torch's fused sdpa, so any bias a positional scheme can describe runs
without the n×n wall (T5 and bidirectional ALiBi included).

Soft-capping (base.py) is a function of each score inside the softmax, which torch's fused sdpa
cannot apply: a soft-capped block forms its scores itself (`capped_block`: q kᵀ · scale, c ·
tanh(s / c), bias, mask, sinks, softmax, times v, in fp32 as naive.py), still one block of rows
at a time, so memory stays linear; beyond SAVE_BYTES its backward recomputes each block, as
above. Sinks ride on sdpa as one more key (base.py, `with_sink_key`). Either one turns the
Toeplitz view of offsets.py off: the block's mask is built per block instead.

`query_blocks` is the loop, shared with the ALiBi kernel (alibi.py). Global query rows
(Longformer's, masks.py) see every key, so each block is cut around them (`MaskSpec.row_runs`):
they run as their own few-row blocks and the rest of the block keeps its sparse key set.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from .. import bias as B_
from ..masks import MaskDescription
from .base import (
    BLOCK_BYTES,
    KERNELS,
    SAVE_BYTES,
    Kernel,
    KernelCaps,
    cap,
    empty_rows_value,
    full_precision,
    masked_sdpa,
)
from .base import recompute as recompute_block
from .call import AttnCall
from .offsets import OffsetPlan, offset_attention, saves_linear

BlockFn = Callable[..., torch.Tensor]  # (q rows, k range, v range, *, rows, keys) -> out rows


def rows_per_block(q: torch.Tensor, S: int, planes: int, window: int | None) -> int:
    """Query rows per block so that a (B, planes, rows, S) fp32 block fits BLOCK_BYTES; near the
    window when there is one (a block then spans about rows + window keys)."""
    rows = BLOCK_BYTES // max(1, 4 * q.shape[0] * planes * S)
    if window is not None:
        rows = min(rows, max(64, window))
    if q.element_size() < 4:
        rows = min(rows, 256)  # see alibi.py: 16-bit position channels stay exact within a block
    return max(16, rows)


class _Ranges(torch.autograd.Function):
    """x[:, :, r] for every range r, as views, with ONE backward node. Sliced one at a time, each
    slice's backward allocates a zero gradient of x's full size and autograd adds it up: for 32
    blocks at n 8,192 that memory traffic was 44 % of a sliding-window pass's forward+backward
    (profile in README, "Attention cost"). Here the gradient is allocated once and each block's
    part added into its range."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ranges: tuple[slice, ...]) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # blocks whose output is unused send None, not zeros
        ctx.shape, ctx.ranges = x.shape, ranges
        return tuple(x[:, :, r] for r in ranges)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        given = [g for g in grads if g is not None]
        if not given:
            return None, None
        dx = given[0].new_zeros(ctx.shape)
        for r, g in zip(ctx.ranges, grads, strict=True):
            if g is not None:
                dx[:, :, r] += g
        return dx, None


def _views(x: torch.Tensor, ranges: list, grads: bool) -> list[torch.Tensor | None]:
    """x[:, :, r] per block (a range, or key indices: a gather); ranges' views share one backward
    node when gradients are on (`_Ranges`)."""
    spans = tuple(r for r in ranges if isinstance(r, slice))
    if not grads or not x.requires_grad or len(spans) < 2:
        return [x[:, :, r] for r in ranges]
    it = iter(_Ranges.apply(x, spans))
    return [next(it) if isinstance(r, slice) else x[:, :, r] for r in ranges]


def query_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskDescription | None,
    block_fn: BlockFn,
    rows: int,
    saved_bytes: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run `block_fn` over blocks of `rows` query rows and concatenate: (B, H, T, D). `sinks`
    only decides what a row that sees no key outputs (base.py, `empty_rows_value`)."""
    T, H = q.shape[2], q.shape[1]
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    recompute = grads and saved_bytes > SAVE_BYTES and rows < T
    outs = []
    blocks = [slice(start, min(T, start + rows)) for start in range(0, T, rows)]
    if mask is not None:  # global query rows (Longformer) run apart: their own small blocks
        blocks = [run for block in blocks for run in mask.row_runs(block)]
    keys = [mask.visible_keys(rs) if mask is not None else B_.ALL for rs in blocks]
    # views of each block's rows and keys (a gather for index keys)
    qs, ks_, vs = (_views(x, r, grads) for x, r in ((q, blocks), (k, keys), (v, keys)))
    for i, (rs, ks) in enumerate(zip(blocks, keys, strict=True)):
        fn = partial(block_fn, rows=rs, keys=ks)
        args = (qs[i], ks_[i], vs[i])
        out = recompute_block(fn, *args) if recompute else fn(*args)
        # (a description that cannot tell, BigBird's, is checked block by block)
        if mask is not None and not mask.every_row_sees_a_key:
            # a row that sees no key (a padding query) outputs the mean of all of v (0 with
            # sinks), as the naive kernel does; set here, not left to sdpa, whose backward
            # mis-scales such rows when they are all fp32-min (its log-sum-exp absorbs the
            # log S) and which sees only `ks`
            allowed = mask.block(rs, ks)  # (B, 1, rows, keys), None when nothing is masked
            empty = None if allowed is None else ~allowed.any(dim=-1, keepdim=True)
            if empty is not None and bool(empty.any()):
                out = torch.where(empty, empty_rows_value(v, H, sinks).to(out.dtype), out)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, H, T, D)


def capped_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    extra: torch.Tensor | None,
    scale: float,
    dropout_p: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One block's attention with its scores formed here, for what sdpa cannot fuse
    (soft-capping): q (B, H, tq, D), k, v (B, H_kv, tk, D), allowed (B, 1|H, tq, tk), extra
    (B|1, H, tq, tk) -> (B, H, tq, D). The naive kernel's steps, in fp32 (or wider)."""
    B, H, tq, _ = q.shape
    H_kv = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).unflatten(1, (H_kv, H // H_kv))  # (B, H, tq, D) -> (B, H_kv, G, tq, D)
    with full_precision(q):  # autocast would run the einsum in 16 bits again
        s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(acc)) * scale  # one K/V head per group
    s = cap(s, softcap).flatten(1, 2)  # (B, H_kv, G, tq, tk) -> (B, H, tq, tk)
    if extra is not None:
        s = s + extra.to(acc)
    if allowed is not None:
        s = s.masked_fill(~allowed, torch.finfo(acc).min)
    if sinks is not None:  # the sink column (base.py): (B, H, tq, tk + 1)
        s = torch.cat((s, sinks.to(acc)[None, :, None, None].expand(B, H, tq, 1)), dim=-1)
    p = s.softmax(dim=-1)
    p = (p[..., :-1] if sinks is not None else p).to(q.dtype)  # the sink has no value
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p.unflatten(1, (H_kv, H // H_kv)), v)
    return out.flatten(1, 2)  # (B, H_kv, G, tq, D) -> (B, H, tq, D)


def _bias_block(
    q, k, v, *, rows, keys, mask, bias, scale, dropout_p, plan, softcap=None, sinks=None
) -> torch.Tensor:
    if plan is not None and isinstance(keys, slice):  # bias and mask as one Toeplitz view
        # of their offsets (offsets.py); keys are a range whenever the mask has no gaps
        return offset_attention(q, k, v, plan, rows, keys, scale, dropout_p)
    allowed = mask.block(rows, keys) if mask is not None else None  # (B, 1, rows, keys)
    extra = bias.block(rows, keys) if bias is not None else None  # (B|1, H, rows, keys)
    if softcap is not None:
        return capped_block(q, k, v, allowed, extra, scale, dropout_p, softcap, sinks)
    return masked_sdpa(q, k, v, allowed, extra, scale, dropout_p, sinks=sinks)


def chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rows`: query rows per block (None: from BLOCK_BYTES)."""
    mask, bias, scale, dropout_p = call.mask, call.bias, call.scale, call.dropout_p
    softcap, sinks = call.softcap, call.sinks
    Bsz, H, T, _ = q.shape
    S = k.shape[2]
    # the bias block and capped scores have H planes; a mask one (MaskSpec), or H when it
    # differs by head (BigBird's BlockSparseMask)
    per_head = bias is not None or softcap is not None
    planes = H if per_head else (mask.planes if mask is not None else 1)
    window = mask.window if mask is not None else None
    rows = rows or rows_per_block(q, S, planes, window)
    saved = 4 * Bsz * planes * T * S  # sdpa keeps each block's additive mask for backward
    if softcap is not None:
        saved *= 4  # autograd keeps the block's scores, tanh, probabilities and mask
    plan = None  # the Toeplitz view holds no sink column and no capped scores
    if softcap is None and sinks is None:
        plan = OffsetPlan.of(mask, bias, T, S, q.dtype)  # None: bias and mask block by block
    if plan is not None and saves_linear(plan, q, dropout_p):
        saved = 0  # the fused kernel keeps inputs, output and log-sum-exp: nothing to recompute
    fn = partial(
        _bias_block, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p, plan=plan,
        softcap=softcap, sinks=sinks,
    )  # fmt: skip
    return query_blocks(q, k, v, mask, fn, rows, saved, sinks), None


KERNELS.register("chunked")(
    Kernel(
        chunked_attention,
        caps=KernelCaps(
            bias=True, weights=False, dropout=True, backward=True, softcap=True, sinks=True
        ),
    )
)
