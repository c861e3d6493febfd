"""FlexAttention from attnlab's own descriptions: any pointwise mask and score transform, fused,
in linear memory (torch.nn.attention.flex_attention; Dong et al. 2024, arXiv:2412.05496).

The mask and bias descriptions (masks.py, bias.py) already say, per (b, h, q, kv), what a kernel
must compute; FlexAttention takes exactly that as two functions and compiles them into one
FlashAttention-style kernel:

    mask_mod(b, h, q, kv)          MaskSpec: causal / window / padding / global tokens from the
                                   positions; BigBird: its block table at (q // b, kv // b)
    score_mod(s, b, h, q, kv)      cap(s) + bias: ALiBi's slope · (k − q), T5's table at
                                   bucket(k − q), a dense tensor's entry, BigBird's key counts
    BlockMask                      from the description's `block_tables` (per tile of 128 × 128:
                                   skipped, full, or masked), built once per forward pass and
                                   shared by every layer that gets the same description

so no (T, S) tensor exists at any length, tiles no query sees are skipped (a window, BigBird and
Longformer stay sparse), and the bias is evaluated inside the kernel. GQA / MQA run without
repeating K/V (`enable_gqa`).

Two conventions of base.py that flex does not have itself, kept exactly:
- sinks: out · σ(lse − sink_h) = out · e^lse / (e^lse + e^sink_h), from the log-sum-exp flex
  returns; a row that sees no key has lse = −∞ and outputs 0.
- a query that sees no key outputs mean(v) (flex gives 0): replaced where lse = −∞.
Where flex cannot return the log-sum-exp (compiled on the CPU), both ride on one extra key at
index S: its score is sink_h (value 0), or, without sinks, a finite −1e30 (value mean(v)), which
every row sees; a row with any real key gives it weight e^(−1e30 − max) = 0 exactly, a row with
none gives it all.

Compiled once per shape with `dynamic=False` and kept compiled whether or not the caller is
(torchtune's `compile_friendly_flex_attention`): inside a compiled region flex is traced in
place. Eager flex computes the same function unfused (it builds the scores; tests use it as a
second path, `COMPILE = False`). On the CPU torch compiles flex for inference only, so the CPU
selector keeps its own kernels and flex refuses a call that needs gradients there.
"""

from __future__ import annotations

import weakref
from functools import cache

import torch

from ..masks import MaskDescription
from .base import KERNELS, Kernel, KernelCaps
from .call import AttnCall

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5
    BlockMask = flex_attention = None
try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch < 2.9: return_lse
    AuxRequest = None

BLOCK = 128  # tile side of the BlockMask (flex's default)
COMPILE = True  # False: eager flex (unfused: tests compare the two)
EMPTY_SCORE = -1e30  # the extra key's score without sinks: finite, below any real score


@cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def _flex(*args, **kwargs):
    if not COMPILE or torch.compiler.is_compiling():
        return flex_attention(*args, **kwargs)
    return _compiled()(*args, **kwargs)


def _returns_lse(device: torch.device) -> bool:
    """Whether flex can return its log-sum-exp here (not compiled on the CPU)."""
    return device.type != "cpu" or not COMPILE


# --- the BlockMask, once per description and shape ----------------------------------------------

_MASKS: dict[int, tuple[weakref.ref, tuple, BlockMask]] = {}


def _tables(some: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(…, nq, nk) bool -> (counts (…, nq) int32, indices (…, nq, nk) int32, listed first)."""
    counts = some.sum(dim=-1, dtype=torch.int32)
    order = torch.sort((~some).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return counts, order


def block_mask(
    mask: MaskDescription | None, T: int, S: int, extra_key: bool, device: torch.device
) -> BlockMask | None:
    """The BlockMask of `mask` for T queries × S keys (+ the extra key): cached on the
    description object, so the layers of one forward pass share it. None: nothing masked."""
    mod = mask.mask_mod() if mask is not None else None
    if mod is None and not extra_key:
        return None
    key = (T, S, extra_key, BLOCK, device)
    hit = _MASKS.get(id(mask))
    if hit is not None and hit[0]() is mask and hit[1] == key:
        return hit[2]
    n_keys = S + 1 if extra_key else S
    nq, nk = -(-T // BLOCK), -(-n_keys // BLOCK)
    if mod is None:  # nothing masked but the extra key: every tile full but its own
        some = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device)
        every = some.clone()
    else:
        some, every = mask.block_tables(BLOCK, BLOCK)  # (B|1, planes, nq, nk(S))
        if some.shape[-1] < nk:  # the extra key opens a tile of its own
            some = torch.nn.functional.pad(some, (0, 1), value=True)
            every = torch.nn.functional.pad(every, (0, 1), value=False)
    if extra_key:  # the extra key's tile is always partial (its mask differs from the rest)
        last = S // BLOCK
        some[..., last], every[..., last] = True, False
        mod = _with_extra_key(mod, S)
    partial = some & ~every
    if device.type == "cpu" and not bool(partial.any()):
        partial, every = some, torch.zeros_like(every)  # the CPU template needs one masked tile
    counts, idx = _tables(partial)
    full_counts, full_idx = _tables(every)
    bm = BlockMask.from_kv_blocks(
        counts, idx, full_counts, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mod,
        seq_lengths=(T, n_keys),
    )  # fmt: skip
    if len(_MASKS) > 16:
        _MASKS.clear()
    if mask is not None:
        _MASKS[id(mask)] = (weakref.ref(mask), key, bm)
    return bm


def _with_extra_key(mod, S: int):
    if mod is None:
        return lambda b, h, q, kv: kv <= S  # every key, the extra one included
    # the description's tensors hold S keys: index S is read as S - 1, and overridden
    return lambda b, h, q, kv: (kv == S) | mod(b, h, q, torch.clamp(kv, max=S - 1))


# --- the kernel ---------------------------------------------------------------------------------


def _score_mod(call: AttnCall, S: int | None):
    """cap, then the bias, then (with the extra key at index S) the extra key's score."""
    bias = call.bias.score_mod() if call.bias is not None else None
    c, sinks = call.softcap, call.sinks
    if bias is None and c is None and S is None:
        return None
    extra = None
    if S is not None:
        extra = sinks.float() if sinks is not None else None

    def score_mod(score, b, h, q, kv):
        s = score if c is None else torch.tanh(score / c) * c
        if bias is not None:  # the extra key's own index read as S - 1, its score replaced
            s = bias(s, b, h, q, kv if S is None else torch.clamp(kv, max=S - 1))
        if S is not None:
            s = torch.where(kv == S, extra[h] if extra is not None else EMPTY_SCORE, s)
        return s

    return score_mod


def flex_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, H, T, D = q.shape
    S = k.shape[2]
    gqa = k.shape[1] != H
    mask, sinks = call.mask, call.sinks
    fix = sinks is not None or (mask is not None and not mask.every_row_sees_a_key)
    if fix and not _returns_lse(q.device):  # the extra key (module docstring)
        extra_v = v.new_zeros(B, v.shape[1], 1, D) if sinks is not None else v.mean(2, True)
        k2 = torch.cat((k, k.new_zeros(B, k.shape[1], 1, D)), dim=2)  # (B, H_kv, S + 1, D)
        v2 = torch.cat((v, extra_v), dim=2)
        bm = block_mask(mask, T, S, True, q.device)
        out = _flex(q, k2, v2, _score_mod(call, S), bm, call.scale, enable_gqa=gqa)
        return out, None
    bm = block_mask(mask, T, S, False, q.device)
    score_mod = _score_mod(call, None)
    if not fix:
        return _flex(q, k, v, score_mod, bm, call.scale, enable_gqa=gqa), None
    if AuxRequest is not None:
        out, aux = _flex(
            q, k, v, score_mod, bm, call.scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
        )
        lse = aux.lse
    else:
        out, lse = _flex(q, k, v, score_mod, bm, call.scale, enable_gqa=gqa, return_lse=True)
    lse = lse[..., None]  # (B, H, T, 1), natural log
    if sinks is not None:  # e^lse / (e^lse + e^sink): 0 where the row sees no key
        return out * torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None, None]), None
    mean_v = v.mean(dim=2, keepdim=True).repeat_interleave(H // v.shape[1], dim=1)  # (B, H, 1, D)
    return torch.where(torch.isneginf(lse), mean_v.to(out.dtype), out), None


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall) -> str | None:
    if flex_attention is None:
        return "this torch has no FlexAttention (torch >= 2.5)"
    if call.mask is not None and not call.mask.caps.pointwise:
        return f"its mask kind ({type(call.mask).__name__}) offers no mask_mod and block tables"
    if call.bias is not None and call.bias.score_mod() is None:
        return f"its bias ({type(call.bias).__name__}) offers no score_mod (not pointwise)"
    return None


CAPS = KernelCaps(
    bias=True,
    weights=False,
    dropout=False,
    backward=True,
    softcap=True,
    sinks=True,
    backward_devices=frozenset({"cuda"}),  # torch compiles flex for inference only on the CPU
)
KERNELS.register("flex")(Kernel(flex_kernel, caps=CAPS, accepts=serves))
