"""The paged layout through FlexAttention: the pool read in place, any pointwise mask and score
transform mapped through the rows' block tables (layout "paged", CUDA's first choice;
attention-gym's paged attention and its `convert_logical_block_mask` are the model).

The engine's one-token step (src/attnlab/cache/ragged.py) has row b attend to its first n_b
slots, which lie in the blocks of its table; the call's mask and bias descriptions say what a
kernel must compute over those keys in the row's logical order j = 0 .. S − 1 (positions 0, 1,
... in slot order). Flex reads the pool (1, H_kv, P, D) itself, one K/V batch for every query
row, and sees physical slots kv; the BlockMask tells each row which pool blocks to visit and the
functions translate kv back to j:

    kv_num_blocks[b] = ceil(n_b / bs)       kv_indices[b, i] = the row's i-th physical block
    j = ordinal[b, kv // bs] · bs + kv % bs (ordinal: a physical block's place in row b's table,
                                            −1 for blocks the row does not hold)
    mask_mod(b, h, q, kv)                   j ≥ 0, j < n_b, and the description's mask at j
                                            (causality, padding, a sliding window)
    score_mod(s, b, h, q, kv)               the soft-cap, then the description's bias at j
                                            (ALiBi, T5's buckets, a dense bias)
    sinks                                   one more key every row visits: the scratch block's
                                            SPARE slot (cache/blocks.py: never written, so its
                                            value is 0), its score the head's sink logit

Nothing is gathered or copied. The tables come from the cache (`PagedKV.blocks`, made on the
device before the step: the compiled decode step's graph takes them as inputs) or are derived
here from the step's slot table, with no host read either way. The CPU's own kernel is the
native one (paged.py); this one runs there too when named or under the compiled decode step
(flex compiled for inference: tests/nn/attention/kernels/test_paged_decode.py and
tests/decode/test_batch_step.py compare it with the dense path and `generate`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ....cache.base import BlockVisits
from ....cache.blocks import SPARE, visits
from ....graphs import bucket
from . import paged
from .base import FLOATS, KERNELS, Kernel
from .call import AttnCall
from .flex import BlockMask, _flex, _kinds
from .flex import serves as flex_serves
from .paged import one_token_step


def block_mask(
    blocks: BlockVisits,
    lengths: torch.Tensor,
    bs: int,
    n_slots: int,
    call: AttnCall | None = None,
    B: int | None = None,
    S: int | None = None,
) -> BlockMask:
    """The BlockMask of a one-token step over a pool of n_slots slots in blocks of bs: row b
    visits `blocks` (cache/blocks.py `visits`: the blocks that hold its first lengths[b] keys)
    and sees what `call`'s mask lets it see there, S keys in logical order (with sinks, the
    SPARE slot too); B: the description's rows (None: every row's)."""
    ordinal, used = blocks.ordinal, blocks.used
    logical = _logical(ordinal, bs, B or lengths.shape[0], S if S is not None else n_slots)
    mask = call.mask.mask_mod() if call is not None and call.mask is not None else None
    sinks = call is not None and call.sinks is not None
    if sinks:  # the scratch block, listed after the row's own (the indices past `used` are 0)
        used = used + 1

    def mask_mod(b, h, q_idx, kv_idx):
        b_, j = logical(b, kv_idx)
        seen = (j >= 0) & (j < lengths[b])
        if mask is not None:
            seen = seen & mask(b_, h, q_idx, j.clamp(min=0))
        return seen | (kv_idx == SPARE) if sinks else seen

    # one query block of Q_BLOCK rows holds the step's one query: CUDA's flex kernels want query
    # blocks that are multiples of their 16-row tiles (the KV tiles shrink to the pool's blocks)
    return BlockMask.from_kv_blocks(
        used[:, None, None],
        blocks.indices[:, None, None, :],
        BLOCK_SIZE=(Q_BLOCK, bs),
        mask_mod=mask_mod,
        seq_lengths=(1, n_slots),
    )


def step_visits(p, rows: int) -> tuple[BlockVisits, torch.Tensor]:
    """The blocks each of `rows` ≥ B rows visits and the rows' lengths (the rows past B read
    nothing): the cache's (`PagedKV.blocks`) where it made them for these rows, else derived
    from the slots; once per forward pass (kept in the pass's `PagedKV.step`)."""
    got = p.step.get(("flex-visits", rows))
    if got is None:
        slots, lengths = p.slots, p.lengths
        if rows > slots.shape[0]:
            slots = torch.nn.functional.pad(slots, (0, 0, 0, rows - slots.shape[0]))
            lengths = torch.nn.functional.pad(lengths, (0, rows - lengths.shape[0]))
        blocks = p.blocks if rows == p.slots.shape[0] and p.blocks is not None else None
        if blocks is None:
            bs = p.block_size
            blocks = visits(slots[:, ::bs] // bs, lengths, bs, p.k.shape[1] // bs)
        got = p.step[("flex-visits", rows)] = (blocks, lengths)
    return got


def _logical(ordinal: torch.Tensor, bs: int, B: int, S: int):
    """(b, kv) -> (b within the description's B rows, the key's logical index j: −1 and below
    where the row does not hold kv's block), clamped to read the descriptions' (B, S) tensors
    in range (padding rows past B and slots past S are masked out anyway)."""

    def logical(b, kv_idx):
        j = ordinal[b, kv_idx // bs] * bs + kv_idx % bs
        return b.clamp(max=B - 1), torch.where(j < S, j, -1)

    return logical


def score_mod(call: AttnCall, ordinal: torch.Tensor, bs: int, B: int, S: int):
    """The call's soft-cap and bias, read at each key's logical index; with sinks the SPARE
    slot's score is the head's sink logit. None: nothing to transform."""
    bias = call.bias.score_mod() if call.bias is not None else None
    c, sinks = call.softcap, call.sinks
    if bias is None and c is None and sinks is None:
        return None
    logical = _logical(ordinal, bs, B, S)
    sink = sinks.float() if sinks is not None else None

    def mod(score, b, h, q_idx, kv_idx):
        s = score if c is None else torch.tanh(score / c) * c
        if bias is not None:
            b_, j = logical(b, kv_idx)
            s = bias(s, b_, h, q_idx, j.clamp(min=0))
        if sink is not None:
            s = torch.where(kv_idx == SPARE, sink[h].to(s.dtype), s)
        return s

    return mod


Q_BLOCK = 128


def step_mask(p, rows: int, call: AttnCall) -> BlockMask:
    """`block_mask` of this step's pages over `rows` rows, built once for all the layers of the
    forward pass that share the call's mask and sinks (kept in the mask description's per-pass
    `memo`, or without a mask in the pass's `PagedKV.step`, which the cache renews every pass)."""
    memo = call.mask.memo if call.mask is not None else p.step  # both: one forward pass's
    key = ("paged-flex-block-mask", rows, call.sinks is not None)
    bm = memo.get(key)
    if bm is None:
        blocks, lengths = step_visits(p, rows)
        B, S = p.slots.shape
        bm = memo[key] = block_mask(blocks, lengths, p.block_size, p.k.shape[1], call, B, S)
    return bm


def kernel_options(block_size: int) -> dict[str, int]:
    """Triton tile sizes that torch's flex kernels accept over pages of `block_size` slots, for
    any GQA ratio. torch (inductor/kernel/flex/flex_attention.py, flex_decoding.py) demands
    SPARSE_KV_BLOCK_SIZE % BLOCK_N == 0 and SPARSE_Q_BLOCK_SIZE % BLOCK_M == 0; its decoding
    kernel clamps BLOCK_N to the page, but it runs only when H / H_kv is a power of 2 (SmolLM2's
    9 / 3, Qwen2-7B's 28 / 4 are not), and the main kernel's configs have BLOCK_N 32 to 128 and
    raise. So BLOCK_N is the largest power of 2 dividing the page, at most 128; BLOCK_M, 32 to
    128 in every config, divides Q_BLOCK (128)."""
    return {"BLOCK_N": min(block_size & -block_size, 128)}


def paged_flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, H, 1, D) -> (B, H, 1, D) over the pool (k, v: the step's own, already stored).
    Eagerly the rows are padded to a power of 2 (rows of length 0, which read nothing), so an
    engine's changing batch compiles one flex graph per bucket, not per size."""
    p = call.pages
    B = q.shape[0]
    rows = B if torch.compiler.is_compiling() else bucket(B)
    bm = step_mask(p, rows, call)
    mod = score_mod(call, step_visits(p, rows)[0].ordinal, p.block_size, B, p.slots.shape[1])
    gqa = q.shape[1] != p.k.shape[0]
    scale = call.scale
    if torch.compiler.is_compiling() and q.device.type == "cpu":
        # torch's CPU flex template reads q's own buffer as 4-D (flex.py's note): inside a
        # larger graph q may be a view of another shape's buffer (a projection's (B, H·D), a
        # rotation's (..., D/2, 2)), and inductor drops a clone of a contiguous view; q scaled
        # here (the kernel then scales by 1: the same scores) is a buffer of its own
        q, scale = q * scale, 1.0
    if rows > B:
        q = torch.cat((q, q.new_zeros(rows - B, *q.shape[1:])))  # (rows, H, 1, D)
    key = (tuple(q.shape), tuple(p.k.shape), q.dtype, q.device, p.block_size, _kinds(call))
    out = _flex(
        key, q, p.k[None], p.v[None], mod, bm, scale, enable_gqa=gqa,
        kernel_options=kernel_options(p.block_size), _kernel="paged-flex",
    )  # fmt: skip
    return out[:B].to(q.dtype), None


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall) -> str | None:
    p = call.pages
    if (why := one_token_step(q, call) or flex_serves(q, k, v, call)) is not None:
        return why  # flex's: FlexAttention here, a pointwise mask and bias
    if p.block_size < 1 or p.k.shape[1] % p.block_size:
        return "its pool does not say its block size"
    if call.sinks is not None and p.block_size < 2:
        return "sinks read the scratch block's spare slot: blocks of 2 slots or more"
    if q.device.type == "cuda" and p.block_size % 16:
        return f"its blocks of {p.block_size} slots are not whole 16-key tiles of flex on CUDA"
    return None


# every pointwise mask and bias, soft-capping and sinks, on both devices, in every float dtype
CAPS = replace(
    paged.CAPS, bias=True, softcap=True, sinks=True, devices=frozenset({"cpu", "cuda"}),
    dtypes=FLOATS,
)  # fmt: skip
KERNELS.register("paged-flex")(Kernel(paged_flex_attention, caps=CAPS, accepts=serves))
