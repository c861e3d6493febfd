"""The tiled kernel: FlashAttention's online softmax written out in plain torch, the teaching
version (Dao et al. 2022, arXiv:2205.14135: section 3.1, Algorithm 1 for the forward pass; the
backward pass of its appendix B, in the form of FlashAttention-2, Dao 2023, arXiv:2307.08691,
Algorithm 2). Exact, memory O(T·D + tile²) beyond the inputs, and slow: each tile is a few torch
calls from a Python loop. Read it (and test against it); run `sdpa` or `chunked`.

The idea (section 3.1, "Tiling"). A softmax row seems to need the whole row at once:
softmax(x) = f(x) / ℓ(x) with m(x) = max_i x_i, f(x) = e^(x − m(x)), ℓ(x) = Σ_i f(x)_i. But for
a row cut in two, x = [x¹ x²], the pieces combine exactly:

    m(x) = max(m(x¹), m(x²))
    f(x) = [e^(m(x¹) − m(x)) f(x¹),  e^(m(x²) − m(x)) f(x²)]
    ℓ(x) = e^(m(x¹) − m(x)) ℓ(x¹) + e^(m(x²) − m(x)) ℓ(x²)

so a row can be read one tile of keys at a time, keeping only its running max m and running sum
ℓ; whatever was accumulated before a tile that raises the max is rescaled by e^(m_old − m_new).

Forward, Algorithm 1 (its line numbers in brackets). Q is cut into tiles of TILE_Q rows (B_r),
K and V into tiles of TILE_K keys (B_c) [3-4]; O = 0, ℓ = 0, m = −∞ for every row [2]. With
keys outside and queries inside, as in the paper, O, ℓ and m of every row live in memory
("HBM"; here tensors of T rows) and are read and written once per tile:

    for each key tile j:                                                            [5-6]
        for each query tile i:                                                      [7-8]
            S_ij = scale · Q_i K_jᵀ + bias_ij, masked                               [9]
            m̃ = rowmax(S_ij);   P̃ = exp(S_ij − m̃);   ℓ̃ = rowsum(P̃)                 [10]
            m_new = max(m_i, m̃);   ℓ_new = e^(m_i − m_new) ℓ_i + e^(m̃ − m_new) ℓ̃    [11]
            O_i ← (ℓ_i e^(m_i − m_new) O_i + e^(m̃ − m_new) P̃ V_j) / ℓ_new            [12]
            m_i ← m_new;   ℓ_i ← ℓ_new                                              [13]

Only L = m + log ℓ, each row's log-sum-exp, is kept for backward (FlashAttention-2's one
statistic where FlashAttention-1 keeps m and ℓ).

Backward (appendix B.2 / Algorithm 4; FlashAttention-2's Algorithm 2). No (T, S) P is stored:
each tile's P is recomputed exactly from L, and softmax's Jacobian needs only one number per row,
D_i = Σ_k P_ik dP_ik = rowsum(dO_i ∘ O_i), computed once before the loop:

    for each key tile j:                    dK_j, dV_j accumulate over the query tiles
        for each query tile i:
            P_ij  = exp(S_ij − L_i)          the forward's probabilities
            dV_j += P_ijᵀ dO_i
            dP_ij = dO_i V_jᵀ
            dS_ij = P_ij ∘ (dP_ij − D_i)
            dQ_i += scale · dS_ij K_j
            dK_j += scale · dS_ijᵀ Q_i
            dbias_ij = dS_ij                 routed into the bias description (below)

What differs from the paper, and why:
- Bias and mask are descriptions (bias.py, masks.py), evaluated per tile: `bias.block(i, j)`,
  `mask.block(i, j)` — one plane for every head, or one per head (BigBird's pattern). A tile none
  of whose (query, key) pairs is allowed (beyond the causal edge, outside a window, all padding,
  outside a sparse pattern) is skipped in both passes: Algorithm 2's MASK plus the block
  sparsity of section 3.3.
- Masked scores are the most negative finite fp32 value, not −∞ (as in every attnlab kernel,
  base.py): a row whose keys in one tile are all masked then gets m̃ = finfo.min and weight
  e^(finfo.min − m_new) = 0 once any allowed key has been seen, and no −∞ − (−∞) = NaN arises.
- A query that may see no key at all (a padding query) outputs mean(v) over all S keys, the
  naive kernel's uniform softmax; such rows are set after the Function (autograd then gives v
  its 1/S share and q, k nothing), and their L is +∞ so that backward's P is zero there.
- GQA / MQA: query heads are viewed as (H_kv, G) so that one K/V tile serves its G query heads
  by broadcasting (einsum); K and V are never repeated.
- Bias gradients (T5's table): the bias's tensors that need a gradient are found in the
  description (`bias_leaves`) and passed to the Function as inputs; backward re-evaluates each
  bias tile with autograd on and pulls dS_ij through it (`torch.autograd.grad`), which sums the
  tiles' contributions into the table exactly as the naive kernel's dense bias would.
- Scores, softmax and accumulators are fp32 (or the inputs' dtype if wider), like naive.py.
- No dropout (the paper's Algorithm 2 has it; this version leaves it out): use `chunked`.
- Soft-capping (base.py; Gemma 2): each tile's scaled scores R_ij pass through c · tanh(R_ij / c)
  before the bias and mask, and backward multiplies dS_ij by tanh's derivative,
  dR_ij = dS_ij ∘ (1 − tanh²(R_ij / c)), before it reaches dQ and dK (the bias gradient is dS_ij,
  as the bias is added after the cap).
- Sinks (base.py; GPT-OSS): a logit per head in every row's denominator with no value is a tile
  that came first: m starts at sink_h and ℓ at 1 instead of −∞ and 0, O at 0. L then includes it,
  and backward's P_sink = exp(sink_h − L_i) gives dsink_h = Σ_i P_sink,i (0 − D_i) (its dP is 0:
  it has no value). A row that sees no key outputs 0 (all its weight is the sink's).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .. import bias as B_
from .base import KERNELS, Kernel, KernelCaps
from .call import AttnCall

TILE_Q = 128  # B_r, query rows per tile; on a GPU set by on-chip SRAM, here loop overhead only
TILE_K = 128  # B_c, keys per tile


def tiles(n: int, size: int) -> list[slice]:
    return [slice(start, min(n, start + size)) for start in range(0, n, size)]


def bias_leaves(bias: B_.ScoreBias | None) -> list[torch.Tensor]:
    """The tensors a bias description's gradient must reach: those among its fields that require
    grad, the parameters of modules it holds (T5's table lives in its scheme), and the same for
    descriptions it holds."""
    found: dict[int, torch.Tensor] = {}
    for value in vars(bias).values() if bias is not None else ():
        if isinstance(value, nn.Module):
            found.update((id(p), p) for p in value.parameters() if p.requires_grad)
        elif isinstance(value, torch.Tensor) and value.requires_grad:
            found[id(value)] = value
        elif isinstance(value, B_.ScoreBias):
            found.update((id(t), t) for t in bias_leaves(value))
    return list(found.values())


def grouped(t: torch.Tensor, H_kv: int) -> torch.Tensor:
    """A bias or mask tile by K/V head: (B|1, H, tq, tk) -> (B|1, H_kv, G, tq, tk), or
    (B|1, 1, tq, tk) -> (B|1, 1, 1, tq, tk) when one plane serves every head."""
    return t[:, :, None] if t.shape[1] == 1 else t.unflatten(1, (H_kv, -1))


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    allowed: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """S_ij of one tile, (B, H_kv, G, tq, tk): from q (B, H_kv, G, tq, D) and k (B, H_kv, tk, D)
    in the accumulation dtype, the bias tile (B|1, H, tq, tk) and the mask tile (B|1, 1|H, tq,
    tk; one plane per head for BigBird's pattern), soft-capped before the bias; and, with
    `softcap`, the tile's tanh(R_ij / c) that backward differentiates (else None)."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale  # one K/V head serves its G query heads
    t = None
    if softcap is not None:
        t = torch.tanh(s / softcap)
        s = t * softcap  # base.py's cap(s, softcap), keeping tanh for backward
    if bias is not None:
        s = s + grouped(bias, k.shape[1])
    if allowed is not None:
        s = s.masked_fill(~grouped(allowed, k.shape[1]), torch.finfo(s.dtype).min)
    return s, t


class TiledAttention(torch.autograd.Function):
    """q (B, H_kv, G, T, D), k and v (B, H_kv, S, D) -> (out (B, H_kv, G, T, D), empty
    (B, H_kv, G, T) bool: the rows that may see no key, whose output the caller sets)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, scale, tile_q, tile_k, softcap, sinks, *leaves):
        acc = torch.promote_types(q.dtype, torch.float32)
        T, S = q.shape[-2], k.shape[-2]
        o = torch.zeros(q.shape, dtype=acc, device=q.device)  # O, (B, H_kv, G, T, D)    [2]
        ell = torch.zeros(q.shape[:-1], dtype=acc, device=q.device)  # (B, H_kv, G, T)
        m = torch.full_like(ell, -torch.inf)  # running max per row
        if sinks is not None:  # the sink as a first tile: m = sink_h, ℓ = e^0 = 1, O = 0
            m = m.copy_(sinks.to(acc).view(1, *q.shape[1:3], 1).expand_as(m))  # (H,) by head
            ell = ell.fill_(1.0)
        seen = torch.zeros(ell.shape, dtype=torch.bool, device=q.device)  # saw any key
        for ks in tiles(S, tile_k):  #                                                     [5]
            k_j, v_j = k[:, :, ks].to(acc), v[:, :, ks].to(acc)  # (B, H_kv, tk, D)        [6]
            for rs in tiles(T, tile_q):  #                                                 [7]
                allowed = mask.block(rs, ks) if mask is not None else None  # (B|1, 1|H, tq, tk)
                if allowed is not None and not bool(allowed.any()):
                    continue  # no pair of this tile may attend: it adds nothing
                b_ij = bias.block(rs, ks) if bias is not None else None  # (B|1, H, tq, tk)
                s, _ = scores(q[..., rs, :].to(acc), k_j, allowed, b_ij, scale, softcap)  # [9]
                m_tile = s.amax(dim=-1)  # (B, H_kv, G, tq)                                [10]
                p = torch.exp(s - m_tile[..., None])  # (B, H_kv, G, tq, tk)
                ell_tile = p.sum(dim=-1)
                m_i, ell_i = m[..., rs], ell[..., rs]
                m_new = torch.maximum(m_i, m_tile)  #                                      [11]
                old, new = torch.exp(m_i - m_new), torch.exp(m_tile - m_new)  # rescalings
                ell_new = old * ell_i + new * ell_tile
                pv = torch.einsum("bhgqk,bhkd->bhgqd", p, v_j)  # (B, H_kv, G, tq, D)
                o[..., rs, :] = (  #                                                       [12]
                    (old * ell_i)[..., None] * o[..., rs, :] + new[..., None] * pv
                ) / ell_new[..., None]
                m[..., rs], ell[..., rs] = m_new, ell_new  #                               [13]
                if allowed is None:
                    seen[..., rs] = True
                else:  # (B|1, 1|H, tq, tk) -> (B|1, 1|H_kv, 1|G, tq)
                    seen[..., rs] |= grouped(allowed, k.shape[1]).any(dim=-1)
        empty = ~seen  # (B, H_kv, G, T): rows that may see no key
        L = (m + torch.log(ell)).masked_fill(empty, torch.inf)  # log-sum-exp; +∞: P = 0
        out = o.masked_fill(empty[..., None], 0).to(q.dtype)
        saved_sinks = () if sinks is None else (sinks,)
        ctx.save_for_backward(q, k, v, out, L, *saved_sinks, *leaves)
        ctx.mask, ctx.bias, ctx.scale, ctx.tile_q, ctx.tile_k = mask, bias, scale, tile_q, tile_k
        ctx.softcap, ctx.has_sinks = softcap, sinks is not None
        ctx.mark_non_differentiable(empty)
        return out, empty

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, _d_empty):
        q, k, v, out, L, *leaves = ctx.saved_tensors
        sinks = leaves.pop(0) if ctx.has_sinks else None
        mask, bias, scale, softcap = ctx.mask, ctx.bias, ctx.scale, ctx.softcap
        bias_grads = any(ctx.needs_input_grad[10:])
        acc = L.dtype
        T, S = q.shape[-2], k.shape[-2]
        dO = d_out.to(acc)  # (B, H_kv, G, T, D)
        delta = (dO * out.to(acc)).sum(dim=-1)  # D = rowsum(dO ∘ O), (B, H_kv, G, T)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        d_leaves = [torch.zeros_like(t) for t in leaves]
        d_sinks = None
        if sinks is not None:  # dsink_h = −Σ_i exp(sink_h − L_i) D_i over batch and rows
            p_sink = torch.exp(sinks.to(acc).view(1, *q.shape[1:3], 1) - L)  # (B, H_kv, G, T)
            d_sinks = -(p_sink * delta).sum(dim=(0, 3)).flatten().to(sinks.dtype)  # (H,)
        for ks in tiles(S, ctx.tile_k):
            k_j, v_j = k[:, :, ks].to(acc), v[:, :, ks].to(acc)  # (B, H_kv, tk, D)
            for rs in tiles(T, ctx.tile_q):
                allowed = mask.block(rs, ks) if mask is not None else None
                if allowed is not None and not bool(allowed.any()):
                    continue  # skipped in forward: P_ij = 0
                with torch.set_grad_enabled(bias_grads):  # the bias tile's graph, for dbias
                    b_ij = bias.block(rs, ks) if bias is not None else None
                q_i, do_i = q[..., rs, :].to(acc), dO[..., rs, :]  # (B, H_kv, G, tq, D)
                b_fixed = b_ij.detach() if b_ij is not None else None
                s, t = scores(q_i, k_j, allowed, b_fixed, scale, softcap)  # (B, H_kv, G, tq, tk)
                p = torch.exp(s - L[..., rs, None])  # masked entries and empty rows: 0
                dv[:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", p, do_i)  # G heads summed
                dp = torch.einsum("bhgqd,bhkd->bhgqk", do_i, v_j)
                ds = p * (dp - delta[..., rs, None])  # (B, H_kv, G, tq, tk)
                dr = ds if t is None else ds * (1 - t * t)  # through c · tanh(R / c)
                dq[..., rs, :] += torch.einsum("bhgqk,bhkd->bhgqd", dr, k_j) * scale
                dk[:, :, ks] += torch.einsum("bhgqk,bhgqd->bhkd", dr, q_i) * scale
                if bias_grads and b_ij is not None and b_ij.requires_grad:
                    # the bias was added to S unscaled: dbias_ij = dS_ij, summed over a batch
                    # of one where the bias broadcasts; autograd maps it onto the table
                    d_bias = ds.flatten(1, 2).sum_to_size(b_ij.shape).to(b_ij.dtype)
                    found = torch.autograd.grad(b_ij, leaves, d_bias, allow_unused=True)
                    for total, g in zip(d_leaves, found, strict=True):
                        if g is not None:
                            total += g
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None,
                None, d_sinks, *d_leaves)  # fmt: skip


def tiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor | None]:
    mask, bias, scale, softcap, sinks = call.mask, call.bias, call.scale, call.softcap, call.sinks
    H, H_kv = q.shape[1], k.shape[1]
    leaves = bias_leaves(bias)
    probe = bias is not None and not leaves and torch.is_grad_enabled() and q.shape[2] > 0
    if probe and bias.block(slice(0, 1), slice(0, 1)).requires_grad:  # a 1 x 1 tile
        raise ValueError(
            f"the tiled kernel cannot find the tensors that {type(bias).__name__}'s gradient "
            "must reach (it looks for tensors, modules and descriptions among the bias' "
            "fields): use kernel 'chunked', which differentiates through the bias directly"
        )
    qg = q.unflatten(1, (H_kv, H // H_kv))  # (B, H, T, D) -> (B, H_kv, G, T, D), no copy
    out, empty = TiledAttention.apply(
        qg, k, v, mask, bias, scale, TILE_Q, TILE_K, softcap, sinks, *leaves
    )
    if sinks is None and bool(empty.any()):  # as naive: a query that sees no key averages all
        # S values (with sinks it outputs 0, as the Function left it)
        mean_v = v.mean(dim=2, keepdim=True)[:, :, None]  # (B, H_kv, 1, 1, D)
        out = torch.where(empty[..., None], mean_v.to(out.dtype), out)
    return out.flatten(1, 2), None  # (B, H_kv, G, T, D) -> (B, H, T, D)


KERNELS.register("tiled")(
    Kernel(
        tiled_attention,
        caps=KernelCaps(
            bias=True, weights=False, dropout=False, backward=True, softcap=True, sinks=True
        ),
    )
)
