"""Paged KV cache: fixed-size blocks from a shared pool, a block table per row (PagedAttention,
Kwon et al. 2023, arXiv:2309.06180, section 4).

A static cache reserves max_len slots per row up front; most of them are never used when rows
stop early. Here a row owns only the blocks it has filled, taken from one pool on demand as it
grows and returned when it finishes (`free(row)`, or `finish(done)` which `generate` calls on
EOS). The only waste is the unfilled tail of each row's last block (under `block_size` tokens).

    pool   K, V  (L, H_kv, n_blocks · block_size, D)   slot s of block b at b · block_size + s
           positions, valid  (n_blocks · block_size,)   what the mask needs, stored beside K/V
    table  per row, the list of its block ids in order; logical slot j -> table[j // bs], j % bs

Beam search shares blocks instead of copying them (section 4.4): `reorder` copies block tables
and counts references; a block is copied only when a row writes into one it shares
(copy-on-write), so beams that descend from one prompt hold that prompt once. The default pool
(num_blocks=None) has room for every row to reach max_len and grows when beam search multiplies
the rows; an explicit num_blocks is a hard limit, and running out raises CacheFullError.

Trade-off: attention kernels want each row's keys contiguous, so every step gathers the rows'
blocks into a contiguous (B, H_kv, S, D) view (S rounded up to whole blocks) — one extra read
and write of the keys per layer and step, the same order of work as attention itself. A kernel
that reads through the block table (vLLM's) would avoid the copy; the memory saving does not
depend on it. The pool, its reference counts and copy-on-write are BlockPool's (blocks.py).
"""

from __future__ import annotations

import math

import torch

from .base import (
    CACHE_KINDS,
    CacheFullError,
    CacheShape,
    advance,
    check_batch,
    reorder_cross,
    stats_dict,
)
from .blocks import BlockPool, PooledCache


class PagedKVCache(PooledCache):
    def __init__(self, shape: CacheShape, block_size: int = 16, num_blocks: int | None = None):
        growable = num_blocks is None  # by default the pool grows when rows multiply
        if num_blocks is None:  # enough for every row to reach max_len
            num_blocks = shape.batch_size * math.ceil(shape.max_len / max(block_size, 1))
        super().__init__(shape, BlockPool(shape, block_size, num_blocks, growable))
        self.tables: list[list[int]] = [[] for _ in range(shape.batch_size)]
        self.live = [True] * shape.batch_size

    def stats(self) -> dict:
        """Allocated bytes (blocks held by live rows, shared blocks once) vs used bytes (their
        filled slots); `waste` is the unfilled tail of the last blocks. The pool itself
        (`pool_bytes`) is reserved up front: size it with num_blocks to the rows it must serve."""
        bs, L = self.block_size, self.length
        fill: dict[int, int] = {}  # distinct block -> filled slots (a shared block counts once)
        for t, ok in zip(self.tables, self.live, strict=True):
            for j, b in enumerate(t if ok else ()):
                fill[b] = min(bs, L - j * bs)
        held, used = len(fill), sum(fill.values())
        extra = {
            "pool_bytes": self.num_blocks * bs * self.bytes_per_token(),  # reserved up front
            "block_size": bs,
            "blocks_total": self.num_blocks,
            "blocks_used": held,
            "blocks_free": self.free_count,
        }
        return stats_dict(held * bs, used, self.bytes_per_token(), **extra)

    def _grow(self, end: int) -> None:
        """Give every live row the blocks slots length..end-1 need (all or nothing)."""
        bs, start, pool = self.block_size, self.length, self.pool
        n_new = math.ceil(end / bs) - math.ceil(start / bs)
        partial = start % bs != 0  # the row's last block gets written into: copy it if shared
        live = [r for r, ok in enumerate(self.live) if ok]
        shared = [r for r in live if partial and pool.refs[self.tables[r][-1]] > 1]
        needed = len(live) * n_new + len(shared)
        if not pool.ensure(needed):
            raise CacheFullError(
                f"paged KV cache out of blocks: {needed} blocks of {bs} tokens needed "
                f"({len(live)} rows growing to {end} tokens), {pool.free_count} free of "
                f"{self.num_blocks}: create it with model.new_cache(..., kind='paged', "
                f"num_blocks={self.num_blocks - pool.free_count + needed}) or more, "
                f"or free finished rows"
            )
        for r in shared:
            self.tables[r][-1] = pool.copy(self.tables[r][-1])
        for r in live:
            self.tables[r].extend(pool.take() for _ in range(n_new))

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for T new tokens (taking blocks as needed); returns the (B, S) position
        and validity of every key, S = the slots of whole blocks. Freed rows read and write the
        scratch block."""
        check_batch(self.batch_size, positions)
        (B, T), start = positions.shape, self.length
        end = start + T
        self._grow(end)
        self.length = end
        live = torch.tensor(self.live, device=valid.device)
        valid = valid & live[:, None]
        self.next_position = advance(self.next_position, positions, valid)
        nb, dev = math.ceil(end / self.block_size), self.k.device
        table = self.pool.table(
            [t if ok else [] for t, ok in zip(self.tables, self.live, strict=True)], nb
        )
        self.write_slots = self.pool.slots(table, torch.arange(start, end, device=dev).expand(B, T))
        j = torch.arange(nb * self.block_size, device=dev).expand(B, -1)
        self.read_slots = self.pool.slots(table, j)  # (B, S)
        self.pool.record(self.write_slots, positions, valid)
        self.begin_forward()
        return self.pool.keys(self.read_slots)

    # --- rows -----------------------------------------------------------------------------------

    def free(self, row: int) -> None:
        """Return row `row`'s blocks to the pool; the row reads nothing from now on."""
        if self.live[row]:
            for b in self.tables[row]:
                self.pool.release(b)
            self.tables[row], self.live[row] = [], False

    def finish(self, done: torch.Tensor) -> None:
        """Free every row where `done` (B,) bool is True (generate calls this on EOS)."""
        for row in done.nonzero().flatten().tolist():
            self.free(row)

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        """Row i becomes old row index[i]: tables are copied, blocks shared (no K/V copy)."""
        rows = index.tolist()
        tables = [list(self.tables[j]) for j in rows]
        live = [self.live[j] for j in rows]
        for t, ok in zip(tables, live, strict=True):
            for b in t if ok else ():
                self.pool.share(b)
        for r in range(self.batch_size):
            self.free(r)
        self.tables, self.live = tables, live
        self.next_position = self.next_position.index_select(0, index)
        self.batch_size = len(rows)
        if cross:
            reorder_cross(self.cross, index)


CACHE_KINDS.register("paged")(PagedKVCache)
