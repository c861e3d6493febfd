"""The paged layout on a GPU: FlexAttention over the pool in place, its BlockMask from the rows'
block tables (layout "paged", CUDA's first choice; attention-gym's paged attention is the model).

The engine's one-token step (src/attnlab/cache/ragged.py) has row b attend to exactly its first
n_b slots, which lie in the blocks of its table. Flex reads the pool (1, H_kv, P, D) itself, one
K/V batch for every query row, and the BlockMask tells each row which pool blocks to visit:

    kv_num_blocks[b] = ceil(n_b / bs)      kv_indices[b, j] = the row's j-th physical block
    mask_mod(b, h, q, kv)                  slot kv is the row's logical slot
                                           ordinal[b, kv // bs] · bs + kv % bs, seen if < n_b

where `ordinal` (B, blocks) maps a physical block back to its place in row b's table (−1 for
blocks the row does not hold). Nothing is gathered or copied; the tables are built on the device
from the step's slot table (`PagedKV.slots`), so the step needs no host read. The CPU's own
kernel is the native one (paged.py); this one runs there too when named (flex compiled for
inference, or eager: tests/nn/attention/kernels/test_paged_decode.py compares both with the dense
path).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ....graphs import bucket
from . import paged
from .base import FLOATS, KERNELS, Kernel
from .call import AttnCall
from .flex import BlockMask, _flex
from .paged import one_token_step


def block_mask(slots: torch.Tensor, lengths: torch.Tensor, bs: int, n_slots: int) -> BlockMask:
    """The BlockMask of a one-token step over a pool of n_slots slots in blocks of bs: row b
    visits the blocks of its slot table `slots` (B, S) that hold its first lengths[b] keys."""
    B, S = slots.shape
    n_blocks = n_slots // bs
    dev = slots.device
    width = -(-S // bs)  # the rows' table width in blocks
    table = slots[:, ::bs] // bs  # (B, width): physical block of logical block j
    used = -(-lengths // bs)  # (B,) blocks each row reads
    j = torch.arange(width, device=dev)
    held = j[None, :] < used[:, None]  # (B, width): the row's own entries
    # physical block -> its index in the row's table (-1: not the row's); padding entries are
    # scattered into one spare column, dropped after
    ordinal = torch.full((B, n_blocks + 1), -1, dtype=torch.long, device=dev)
    ordinal.scatter_(1, torch.where(held, table, n_blocks), j.expand(B, width).clone())
    ordinal = ordinal[:, :n_blocks]
    indices = torch.zeros(B, n_blocks, dtype=torch.int32, device=dev)
    indices[:, :width] = torch.where(held, table, 0).to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        o = ordinal[b, kv_idx // bs]
        return (o >= 0) & (o * bs + kv_idx % bs < lengths[b])

    # one query block of Q_BLOCK rows holds the step's one query: CUDA's flex kernels want query
    # blocks that are multiples of their 16-row tiles (the KV tiles shrink to the pool's blocks)
    return BlockMask.from_kv_blocks(
        used.to(torch.int32)[:, None, None],
        indices[:, None, None, :],
        BLOCK_SIZE=(Q_BLOCK, bs),
        mask_mod=mask_mod,
        seq_lengths=(1, n_slots),
    )


Q_BLOCK = 128


def step_mask(p, rows: int) -> BlockMask:
    """`block_mask` of this step's pages over `rows` ≥ B rows (the rows past B read nothing),
    built once for all the layers of the forward pass (kept in the pass's `PagedKV.step`,
    which the cache owns and renews every pass)."""
    bm = p.step.get("flex-block-mask")
    if bm is None:
        slots, lengths = p.slots, p.lengths
        if rows > slots.shape[0]:
            slots = torch.nn.functional.pad(slots, (0, 0, 0, rows - slots.shape[0]))
            lengths = torch.nn.functional.pad(lengths, (0, rows - lengths.shape[0]))
        bm = p.step["flex-block-mask"] = block_mask(slots, lengths, p.block_size, p.k.shape[1])
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
    bm = step_mask(p, rows)
    gqa = q.shape[1] != p.k.shape[0]
    if rows > B:
        q = torch.cat((q, q.new_zeros(rows - B, *q.shape[1:])))  # (rows, H, 1, D)
    key = (tuple(q.shape), tuple(p.k.shape), q.dtype, q.device, p.block_size)
    out = _flex(
        key, q, p.k[None], p.v[None], block_mask=bm, scale=call.scale, enable_gqa=gqa,
        kernel_options=kernel_options(p.block_size), _kernel="paged-flex",
    )  # fmt: skip
    return out[:B].to(q.dtype), None


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall) -> str | None:
    p = call.pages
    if BlockMask is None:
        return "this torch has no FlexAttention (torch >= 2.5)"
    if (why := one_token_step(q, call)) is not None:
        return why
    if p.block_size < 1 or p.k.shape[1] % p.block_size:
        return "its pool does not say its block size"
    if q.device.type == "cuda" and p.block_size % 16:
        return f"its blocks of {p.block_size} slots are not whole 16-key tiles of flex on CUDA"
    return None


# the native paged kernel's capabilities on both devices, in every float dtype
CAPS = replace(paged.CAPS, devices=frozenset({"cpu", "cuda"}), dtypes=FLOATS)
KERNELS.register("paged-flex")(Kernel(paged_flex_attention, caps=CAPS, accepts=serves))
