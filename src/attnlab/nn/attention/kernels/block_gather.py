"""The block-gathering kernel: attention over a block-sparse layout (BigBird's,
nn/attention/block_sparse.py) as batched dense attention over gathered key blocks.

    query blocks 0 and nb-1 (global)   one sdpa call over every key (key padding only)
    query blocks 1 .. nb-2             per head, gather the m key blocks each one sees
                                       (index, valid, log count = mask.key_blocks()), then one
                                       sdpa call per chunk of query blocks: (B, H·n, b, D) queries
                                       against (B, H·n, m·b, D) keys, mask (B, H·n, 1, m·b)

This is transformers' own strategy (BigBirdBlockSparseAttention gathers its random blocks with
`torch_gather_b2` and its window by shifting), written for any layout a mask description gives as
key blocks per query block. Within a (query block, key block) pair every query sees the same keys,
so the mask is one row per query block, broadcast over its b rows: no (rows × keys) mask is built,
and a key block seen c times is one entry with log(c) on its scores (block_sparse.py, item 2).

The chunked kernel (chunked.py) computes the same function from the same description — an
elementwise mask per block of rows, each row block's keys gathered through autograd — which at
BigBird's small blocks spends its time building masks and zero-filling gradients; this kernel is
what `sdpa` dispatches such masks to. Chunks of query blocks keep each gathered (B, H·n, m·b, D)
block under BLOCK_BYTES and are recomputed in backward beyond SAVE_BYTES, as in chunked.py.
A query that sees no real key (a padding row of an all-padding sequence) outputs mean(v) over all
S keys, as in every kernel (base.py). Soft-capping and sinks (base.py) are not declared: the
attention layer runs them on `chunked`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from .base import (
    BLOCK_BYTES,
    KERNELS,
    SAVE_BYTES,
    Kernel,
    KernelCaps,
    masked_sdpa,
)
from .base import recompute as recompute_block
from .call import AttnCall


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall) -> str | None:
    """A mask that lists key blocks per query block (`caps.key_blocks`: BlockSparseMask), with
    no bias beyond its own key counts."""
    mask = call.mask
    if mask is None or not mask.caps.key_blocks:
        return "its mask lists no key blocks per query block (BigBird's BlockSparseMask does)"
    if not mask.absorbs(call.bias):
        return f"its key blocks do not carry the bias {type(call.bias).__name__}"
    return None


def _mean_v(v: torch.Tensor, H: int) -> torch.Tensor:
    """(B, H, 1, D): what a query that sees no key outputs."""
    return v.mean(dim=2, keepdim=True).repeat_interleave(H // v.shape[1], dim=1)


def _global_rows(q, k, v, real, scale, dropout_p) -> torch.Tensor:
    """Rows that see every key: (B, H, rows, D), key padding `real` (B, S) or None."""
    allowed = None if real is None else real[:, None, None, :]  # (B, 1, 1, S)
    out = masked_sdpa(q, k, v, allowed, None, scale, dropout_p)
    if real is not None:
        empty = ~real.any(dim=-1)[:, None, None, None]  # (B, 1, 1, 1): a row of padding only
        out = torch.where(empty, _mean_v(v, q.shape[1]).to(out.dtype), out)
    return out


def _middle_chunk(qc, kb, vb, *, idx, valid, logc, real, mean_v, heads_kv, scale, dropout_p):
    """qc (B, H, n, b, D) query blocks; kb, vb (B, H_kv, nb, b, D) key / value blocks; idx,
    valid, logc (H, n, m) their key blocks; real (B, nb, b) key padding. -> (B, H, n, b, D)."""
    B, H, n, b, D = qc.shape
    H_kv, nb, m = kb.shape[1], kb.shape[2], idx.shape[-1]
    # flat block ids over (H_kv, nb): index_select, whose backward is one index_add
    flat = (heads_kv[:, None, None] * nb + idx).flatten()  # (H·n·m,)
    kg = kb.reshape(B, H_kv * nb, b, D).index_select(1, flat).view(B, H * n, m * b, D)
    vg = vb.reshape(B, H_kv * nb, b, D).index_select(1, flat).view(B, H * n, m * b, D)
    allowed = valid[None, :, :, :, None].expand(B, H, n, m, b)  # (B, H, n, m, b)
    if real is not None:
        allowed = allowed & real[:, idx]  # (B, nb, b)[:, (H, n, m)] -> (B, H, n, m, b)
    allowed = allowed.reshape(B, H * n, 1, m * b)  # one mask row per query block
    extra = logc[None, :, :, :, None].expand(1, H, n, m, b).reshape(1, H * n, 1, m * b)
    out = masked_sdpa(qc.reshape(B, H * n, b, D), kg, vg, allowed, extra, scale, dropout_p)
    empty = ~allowed.any(dim=-1, keepdim=True)  # (B, H·n, 1, 1)
    out = torch.where(empty, mean_v.expand(B, H, n, 1, D).reshape(B, H * n, 1, D), out)
    return out.view(B, H, n, b, D)


def block_gather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor | None]:
    mask, scale, dropout_p = call.mask, call.scale, call.dropout_p
    B, H, T, D = q.shape
    H_kv, b = k.shape[1], mask.block_size
    nb = -(-T // b)
    real = mask.key_padding.bool() if mask.key_padding is not None else None  # (B, S)
    if nb <= 2:  # every query block is global
        return _global_rows(q, k, v, real, scale, dropout_p), None
    last = (nb - 1) * b
    first_rows = _global_rows(q[:, :, :b], k, v, real, scale, dropout_p)  # (B, H, b, D)
    last_rows = _global_rows(q[:, :, last:], k, v, real, scale, dropout_p)  # (B, H, T - last, D)
    pad = nb * b - T  # the last block made whole with masked keys
    if pad:
        k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))  # (B, H_kv, nb·b, D)
    kb, vb = k.view(B, H_kv, nb, b, D), v.view(B, H_kv, nb, b, D)  # key / value blocks
    keep = real if real is not None else torch.ones(B, T, dtype=torch.bool, device=q.device)
    keep = F.pad(keep, (0, pad), value=False).view(B, nb, b) if (pad or real is not None) else None
    qm = q[:, :, b:last].view(B, H, nb - 2, b, D)  # the middle query blocks
    idx, valid, logc = mask.key_blocks()  # (H, nb - 2, m) each
    m = idx.shape[-1]
    per_block = 4 * B * H * m * b * D  # one query block's gathered keys, fp32
    n = max(1, BLOCK_BYTES // per_block)
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    recompute = grads and 2 * per_block * (nb - 2) > SAVE_BYTES and n < nb - 2
    fn = partial(
        _middle_chunk,
        real=keep,
        mean_v=_mean_v(v[:, :, :T], H)[:, :, None],  # (B, H, 1, 1, D), the real S keys
        heads_kv=torch.arange(H, device=q.device) // (H // H_kv),
        scale=scale,
        dropout_p=dropout_p,
    )
    outs = []
    for c in range(0, nb - 2, n):
        cs = slice(c, min(nb - 2, c + n))
        part = partial(fn, idx=idx[:, cs], valid=valid[:, cs], logc=logc[:, cs])
        args = (qm[:, :, cs], kb, vb)
        outs.append(recompute_block(part, *args) if recompute else part(*args))
    middle = torch.cat(outs, dim=2).view(B, H, (nb - 2) * b, D)
    return torch.cat([first_rows, middle, last_rows], dim=2), None  # (B, H, T, D)


KERNELS.register("block-gather")(
    Kernel(
        block_gather_attention,
        caps=KernelCaps(bias=True, weights=False, dropout=True, backward=True),
        accepts=applies,
    )
)
