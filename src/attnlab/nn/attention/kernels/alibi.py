"""ALiBi on torch's fused sdpa, exactly, without an n×n bias (Press et al. 2022, arXiv:2108.12409).

A causal ALiBi score is q·k·scale + m_h·(k − q). Along one softmax row q is fixed, so m_h·(−q) is
a constant the softmax ignores, and what remains is linear in the key position: one extra channel
carries it through the dot product,

    q' = [q, m_h]        k' = [k, (k_pos − c) / scale]        v' = [v, 0]
    scale · q'·k' = q·k·scale + m_h·(k_pos − c)

so a plain sdpa call — torch's fused flash kernel — computes exact ALiBi attention, forward and
backward, and the bias never exists as a tensor. fp32 holds ~7 significant digits: with c = 0 the
added term reaches m_h·n (4,096 at n = 8,192 for the first head) and the scores near the diagonal,
the ones that matter, lose ~2e-4. So the rows go in blocks (chunked.py's loop), each centred on its
own last query position c: near the diagonal |k_pos − c| ≤ rows, and the far keys, whose terms are
large, carry weights of e^(−m·distance). Each block sees its keys through the mask description
(causal edge, padding, window, a cache's positions alike); a mask that depends on the offset alone
(causal, window) goes in as a Toeplitz view of its offsets, never built per block (offsets.py). 16-bit dtypes keep positions exact only
up to 256, so their blocks are at most 256 rows.

Bidirectional ALiBi (−m·|k − q|) is not linear in k, and soft-capping and sinks (base.py) are not
declared: the selector (select.py) gives such calls to another kernel.
"""

from __future__ import annotations

from functools import partial

import torch

from .. import bias as B_
from .base import KERNELS, Kernel, KernelCaps, masked_sdpa
from .call import AttnCall
from .chunked import query_blocks, rows_per_block
from .offsets import OffsetPlan, offset_attention, saves_linear


def _alibi_block(q, k, v, *, rows, keys, mask, bias, scale, dropout_p, plan) -> torch.Tensor:
    Bsz, H, tq, D = q.shape
    H_kv, tk = k.shape[1], k.shape[2]
    k_pos = bias.k_positions[:, keys].float()  # (B, tk)
    centre = bias.q_positions[:, rows].amax(dim=1, keepdim=True).float()  # (B, 1), per row
    k_ch = ((k_pos - centre) / scale)[:, None, :, None].expand(Bsz, H_kv, tk, 1)  # every head
    q_ch = bias.slopes[None, :, None, None].expand(Bsz, H, tq, 1)  # m_h for head h
    q2 = torch.cat((q, q_ch.to(q.dtype)), dim=-1)  # (B, H, tq, D + 1)
    k2 = torch.cat((k, k_ch.to(k.dtype)), dim=-1)  # (B, H_kv, tk, D + 1)
    v2 = torch.cat((v, v.new_zeros(Bsz, H_kv, tk, 1)), dim=-1)  # (B, H_kv, tk, D + 1)
    if plan is not None and isinstance(keys, slice):  # the mask as a Toeplitz view (offsets.py)
        return offset_attention(q2, k2, v2, plan, rows, keys, scale, dropout_p)[..., :D]
    allowed = mask.block(rows, keys) if mask is not None else None  # (B, 1, tq, tk)
    return masked_sdpa(q2, k2, v2, allowed, None, scale, dropout_p)[..., :D]  # (B, H, tq, D)


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall) -> str | None:
    b = call.bias
    if isinstance(b, B_.LinearBias) and b.causal:
        return None
    return "it folds only causal ALiBi (a causal LinearBias) into sdpa"


def alibi_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal ALiBi through sdpa; `rows` query rows per block (None: from BLOCK_BYTES)."""
    mask, bias, scale, dropout_p = call.mask, call.bias, call.scale, call.dropout_p
    Bsz, _, T, _ = q.shape
    S = k.shape[2]
    window = mask.window if mask is not None else None
    rows = rows or rows_per_block(q, S, 1, window)
    saved = 4 * Bsz * T * S // 2  # the (B, 1, rows, keys) masks sdpa keeps, keys ≈ S/2 on average
    plan = OffsetPlan.of(mask, None, q.shape[2], S, q.dtype)  # the mask alone, if positional
    if plan is not None and saves_linear(plan, q, dropout_p):
        saved = 0  # the masks are views of one vector: nothing to recompute
    fn = partial(_alibi_block, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p, plan=plan)
    return query_blocks(q, k, v, mask, fn, rows, saved), None


KERNELS.register("alibi-sdpa")(
    Kernel(
        alibi_attention,
        caps=KernelCaps(bias=True, weights=False, dropout=True, backward=True),
        accepts=applies,
    )
)
