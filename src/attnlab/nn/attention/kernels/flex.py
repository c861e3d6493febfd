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

Compiled, and kept compiled whether or not the caller is (torchtune's
`compile_friendly_flex_attention`): inside a compiled region (the compiled decode step) flex is
traced in place; elsewhere it runs through attnlab's own compiled graphs, one per shape bucket
(src/attnlab/graphs.py: each in a dynamo cache of its own, so no number of shapes meets dynamo's
recompile limit, past which torch would run flex unfused: the whole fp32 (B, H, T, S) scores).
Batch, query and key lengths are padded to buckets first (flex_buckets.py), so every prompt
length from 17 to 4,096 compiles at most 10 graphs a dimension, never one per length. The
BlockMask is built once per forward pass and kept in the mask description's per-pass `memo` (no
module-level state): every layer of the pass reuses it, and it is traced along inside a
compiled step. A call torch cannot compile is said once (a warning), and calls of its bucket
run on the chunked kernel from then on, which computes the same function in linear memory.

Eager flex computes the same function unfused (it builds the scores; tests use it as a second
path, `COMPILE = False`). On the CPU torch compiles flex for inference only, so the CPU selector
keeps its own kernels and flex refuses a call that needs gradients there. Every output is in
q's dtype (bf16 in, bf16 out, sinks included).
"""

from __future__ import annotations

import warnings

import torch

from ....graphs import COMPILE_ERRORS, Graphs, describe
from ..masks import MaskDescription
from .base import KERNELS, Kernel, KernelCaps
from .call import AttnCall
from .chunked import chunked_attention
from .flex_buckets import TILE, bucket_shapes, to_buckets

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5
    BlockMask = flex_attention = None
try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # torch < 2.9: return_lse
    AuxRequest = None

BLOCK = TILE  # tile side of the BlockMask (flex's default, 128)
COMPILE = True  # False: eager flex (unfused: tests compare the two)
EMPTY_SCORE = -1e30  # the extra key's score without sinks: finite, below any real score


_GRAPHS: dict[str, Graphs] = {}


def graphs(kernel: str = "flex") -> Graphs:
    """flex_attention compiled once per shape bucket, each in a dynamo cache of its own; one
    table per kernel ("flex", "paged-flex"), so one's shapes never evict the other's."""
    if kernel not in _GRAPHS:
        _GRAPHS[kernel] = Graphs(flex_attention, capacity=64, fullgraph=True, dynamic=False)
    return _GRAPHS[kernel]


def _flex(key: tuple, *args, _kernel: str = "flex", **kwargs):
    """flex_attention: traced in place inside a compiled region, eager with COMPILE off, else
    through the graph of `key` (the call's shapes) in `_kernel`'s table."""
    if not COMPILE or torch.compiler.is_compiling():
        return flex_attention(*args, **kwargs)
    return graphs(_kernel)(key, *args, **kwargs)


def _returns_lse(device: torch.device) -> bool:
    """Whether flex can return its log-sum-exp here (not compiled on the CPU)."""
    return device.type != "cpu" or not COMPILE


# --- the BlockMask, once per description and shape ----------------------------------------------


def _tables(some: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(…, nq, nk) bool -> (counts (…, nq) int32, indices (…, nq, nk) int32, listed first)."""
    counts = some.sum(dim=-1, dtype=torch.int32)
    order = torch.sort((~some).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return counts, order


def block_mask(
    mask: MaskDescription | None, T: int, S: int, extra_key: bool, device: torch.device
) -> BlockMask | None:
    """The BlockMask of `mask` for T queries × S keys (+ the extra key): kept in the
    description's per-pass `memo`, so the layers of one forward pass share it. None: nothing
    masked. Nothing here reads the device: it traces inside a compiled step."""
    mod = mask.mask_mod() if mask is not None else None
    if mod is None and not extra_key:
        return None
    key = ("flex-block-mask", T, S, extra_key, BLOCK, device)
    memo = mask.memo if mask is not None else {}
    if key in memo:
        return memo[key]
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
    if device.type == "cpu":  # the CPU template wants a masked tile: all of them, no host read
        partial, every = some, torch.zeros_like(every)
    counts, idx = _tables(partial)
    full_counts, full_idx = _tables(every)
    bm = BlockMask.from_kv_blocks(
        counts, idx, full_counts, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mod,
        seq_lengths=(T, n_keys),
    )  # fmt: skip
    memo[key] = bm
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


def _kinds(call: AttnCall) -> tuple:
    """Which kinds of mask and bias, with or without soft-cap and sinks."""
    return (type(call.mask), type(call.bias), call.softcap is None, call.sinks is None)


def _shape_key(q, k, call: AttnCall, with_lse: bool) -> tuple:
    """What one compiled flex graph is for: the shapes, dtype and device, and `_kinds` (dynamo's
    guards tell the rest apart inside one key: a window's size, causal or not)."""
    return (tuple(q.shape), tuple(k.shape), q.dtype, q.device, with_lse, _kinds(call))


def _fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall, fix: bool, mean_v
) -> torch.Tensor:
    """flex's output (B, H, T, D) for the call; `fix`: rows that may see no key get mean_v
    (or 0 with sinks), and sinks weigh in, through the log-sum-exp or the extra key."""
    B, H, T, D = q.shape
    S = k.shape[2]
    gqa = k.shape[1] != H
    mask, sinks = call.mask, call.sinks
    if fix and not _returns_lse(q.device):  # the extra key (module docstring)
        extra_v = (
            mean_v[:, :: H // v.shape[1]] if sinks is None else v.new_zeros(B, v.shape[1], 1, D)
        )
        k2 = torch.cat((k, k.new_zeros(B, k.shape[1], 1, D)), dim=2)  # (B, H_kv, S + 1, D)
        v2 = torch.cat((v, extra_v.to(v.dtype)), dim=2)
        bm = block_mask(mask, T, S, True, q.device)
        score_mod = _score_mod(call, S)
        key = _shape_key(q, k2, call, False)
        return _flex(key, q, k2, v2, score_mod, bm, call.scale, enable_gqa=gqa)
    bm = block_mask(mask, T, S, False, q.device)
    score_mod = _score_mod(call, None)
    if not fix:
        key = _shape_key(q, k, call, False)
        return _flex(key, q, k, v, score_mod, bm, call.scale, enable_gqa=gqa)
    key = _shape_key(q, k, call, True)
    if AuxRequest is not None:
        out, aux = _flex(
            key, q, k, v, score_mod, bm, call.scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
        )
        lse = aux.lse
    else:
        out, lse = _flex(key, q, k, v, score_mod, bm, call.scale, enable_gqa=gqa, return_lse=True)
    lse = lse[..., None]  # (B, H, T, 1), natural log
    if sinks is not None:  # e^lse / (e^lse + e^sink): 0 where the row sees no key
        return out * torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None, None]).to(out.dtype)
    return torch.where(torch.isneginf(lse), mean_v.to(out.dtype), out)


_FAILED: set[tuple] = set()  # the calls' keys torch could not compile: chunked at once
_SAID: set[str] = set()  # the compile errors already said (one warning each)
FALLBACKS = {"calls": 0}  # calls that ran on the chunked kernel for want of a compiled flex


def _run(q, k, v, call: AttnCall, pad: bool) -> torch.Tensor:
    """flex's output (B, H, T, D) for the call, over the call's buckets with `pad`
    (flex_buckets.py: one compiled graph per bucket), else at its own shapes."""
    B, H, T, _ = q.shape
    mask, sinks = call.mask, call.sinks
    fix = sinks is not None or (mask is not None and not mask.every_row_sees_a_key)
    # (B, H, 1, D): what a row that sees no key outputs without sinks, from the real keys only
    mean_v = v.mean(dim=2, keepdim=True).repeat_interleave(H // v.shape[1], dim=1) if fix else None
    if pad:
        q, k, v, call, mean_v = to_buckets(q, k, v, call, mean_v, BLOCK)
    return _fused(q, k, v, call, fix, mean_v)[:B, :, :T]


def flex_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not COMPILE or torch.compiler.is_compiling():  # eager, or traced at the caller's shapes
        if torch.compiler.is_compiling() and q.device.type == "cpu":
            # torch's CPU flex template reads each input's own buffer as 4-D (inductor/codegen/
            # cpp_flex_attention_template.py, choose_flex_template); inside a larger graph q, k
            # and v are views of the projections (B, T, H·D): copies make them buffers
            q, k, v = (t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
        return _run(q, k, v, call, pad=False).to(q.dtype), None
    failed = (bucket_shapes(q, k, BLOCK), q.dtype, q.device, _kinds(call))
    if failed not in _FAILED:
        try:
            return _run(q, k, v, call, pad=True).to(q.dtype), None
        except COMPILE_ERRORS as err:  # said once; the same function in linear memory instead
            _FAILED.add(failed)
            why = describe(err)
            if why not in _SAID:
                _SAID.add(why)
                warnings.warn(
                    f"FlexAttention could not be compiled for this call ({why}); such calls "
                    "run on the chunked kernel (the same function, in linear memory) instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
    FALLBACKS["calls"] += 1
    return chunked_attention(q, k, v, call)


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
