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
depend on it. Block 0 is a scratch block: finished rows read and write there, always invalid.
"""

from __future__ import annotations

import math

import torch

from .base import (
    CACHE_KINDS,
    CacheBase,
    CacheFullError,
    CacheShape,
    LayerView,
    advance,
    check_batch,
    reorder_cross,
    stats_dict,
)

SCRATCH = 0


class _PagedLayer(LayerView):
    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, i = self.cache, self.layer
        B, H_kv, T, D = k.shape
        w, r = c._write.view(-1), c._read.view(-1)  # flat pool slots (B·T,), (B·S,)
        c.k[i].index_copy_(1, w, k.to(c.k.dtype).transpose(0, 1).reshape(H_kv, B * T, D))
        c.v[i].index_copy_(1, w, v.to(c.v.dtype).transpose(0, 1).reshape(H_kv, B * T, D))
        S = c._read.shape[1]
        k_all = c.k[i].index_select(1, r).view(H_kv, B, S, D).transpose(0, 1)
        v_all = c.v[i].index_select(1, r).view(H_kv, B, S, D).transpose(0, 1)
        return k_all, v_all  # (B, H_kv, S, D)


class PagedKVCache(CacheBase):
    def __init__(self, shape: CacheShape, block_size: int = 16, num_blocks: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size ({block_size}) must be >= 1")
        super().__init__(shape, _PagedLayer)
        B = shape.batch_size
        self.growable = num_blocks is None  # by default the pool grows when rows multiply
        if num_blocks is None:  # enough for every row to reach max_len
            num_blocks = B * math.ceil(shape.max_len / block_size)
        self.block_size, self.num_blocks = block_size, num_blocks
        n_slots = (num_blocks + 1) * block_size  # + the scratch block
        pool = (shape.n_layers, shape.n_kv_heads, n_slots, shape.head_dim)
        dev = shape.device
        self.k = torch.zeros(pool, dtype=shape.dtype, device=dev)
        self.v = torch.zeros(pool, dtype=shape.dtype, device=dev)
        self.slot_positions = torch.zeros(n_slots, dtype=torch.long, device=dev)
        self.slot_valid = torch.zeros(n_slots, dtype=torch.bool, device=dev)
        self.free_blocks = list(range(num_blocks, 0, -1))  # pop() hands out 1, 2, ...
        self.refs = [0] * (num_blocks + 1)
        self.tables: list[list[int]] = [[] for _ in range(B)]
        self.live = [True] * B
        self._write = self._read = torch.empty(0, 0, dtype=torch.long, device=dev)

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
            "blocks_free": len(self.free_blocks),
        }
        return stats_dict(held * bs, used, self.bytes_per_token(), **extra)

    # --- blocks ---------------------------------------------------------------------------------

    def _take(self) -> int:
        b = self.free_blocks.pop()
        self.refs[b] = 1
        self.slot_valid[b * self.block_size : (b + 1) * self.block_size] = False
        return b

    def _release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free_blocks.append(b)

    def _extend(self, n: int) -> None:
        """Grow a default-sized pool by n blocks (beam search multiplies rows after prefill): one
        reallocation, amortised by growing at least twofold. A given num_blocks is a hard limit."""
        first = self.num_blocks + 1
        extra = n * self.block_size
        self.k = torch.cat((self.k, self.k.new_zeros(*self.k.shape[:2], extra, self.k.shape[3])), 2)
        self.v = torch.cat((self.v, self.v.new_zeros(*self.v.shape[:2], extra, self.v.shape[3])), 2)
        self.slot_positions = torch.cat((self.slot_positions, self.slot_positions.new_zeros(extra)))
        self.slot_valid = torch.cat((self.slot_valid, self.slot_valid.new_zeros(extra)))
        self.free_blocks[:0] = range(first + n - 1, first - 1, -1)
        self.refs += [0] * n
        self.num_blocks += n

    def _copy_block(self, src: int) -> int:
        """Copy-on-write: a private copy of shared block `src`."""
        dst, bs = self._take(), self.block_size
        s, d = slice(src * bs, (src + 1) * bs), slice(dst * bs, (dst + 1) * bs)
        self.k[:, :, d], self.v[:, :, d] = self.k[:, :, s], self.v[:, :, s]
        self.slot_positions[d], self.slot_valid[d] = self.slot_positions[s], self.slot_valid[s]
        self._release(src)
        return dst

    def _grow(self, end: int) -> None:
        """Give every live row the blocks slots length..end-1 need (all or nothing)."""
        bs, start = self.block_size, self.length
        n_new = math.ceil(end / bs) - math.ceil(start / bs)
        partial = start % bs != 0  # the row's last block gets written into: copy it if shared
        live = [r for r, ok in enumerate(self.live) if ok]
        shared = [r for r in live if partial and self.refs[self.tables[r][-1]] > 1]
        needed = len(live) * n_new + len(shared)
        if needed > len(self.free_blocks) and self.growable:
            self._extend(max(needed - len(self.free_blocks), self.num_blocks))
        if needed > len(self.free_blocks):
            raise CacheFullError(
                f"paged KV cache out of blocks: {needed} blocks of {bs} tokens needed "
                f"({len(live)} rows growing to {end} tokens), {len(self.free_blocks)} free of "
                f"{self.num_blocks}: create it with model.new_cache(..., kind='paged', "
                f"num_blocks={self.num_blocks - len(self.free_blocks) + needed}) or more, "
                f"or free finished rows"
            )
        for r in shared:
            self.tables[r][-1] = self._copy_block(self.tables[r][-1])
        for r in live:
            self.tables[r].extend(self._take() for _ in range(n_new))

    def _slots(self, start: int, end: int) -> torch.Tensor:
        """(B, end - start) flat pool slots of logical slots start..end-1 (scratch if freed)."""
        bs, nb = self.block_size, math.ceil(end / self.block_size)
        table = [
            t + [SCRATCH] * (nb - len(t)) if ok else [SCRATCH] * nb
            for t, ok in zip(self.tables, self.live, strict=True)
        ]
        table = torch.tensor(table, dtype=torch.long, device=self.k.device)  # (B, nb)
        j = torch.arange(start, end, device=self.k.device)
        return table[:, j // bs] * bs + j % bs

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for T new tokens (taking blocks as needed); returns the (B, S) position
        and validity of every key, S = the slots of whole blocks."""
        check_batch(self.batch_size, positions)
        T, start = positions.shape[1], self.length
        end = start + T
        self._grow(end)
        self.length = end
        live = torch.tensor(self.live, device=valid.device)
        self.next_position = advance(self.next_position, positions, valid & live[:, None])
        self._write = self._slots(start, end)  # (B, T)
        self._read = self._slots(0, math.ceil(end / self.block_size) * self.block_size)
        w = self._write.view(-1)
        self.slot_positions.index_copy_(0, w, positions.reshape(-1))
        self.slot_valid.index_copy_(0, w, (valid & live[:, None]).reshape(-1))  # scratch: False
        return self.slot_positions[self._read], self.slot_valid[self._read]

    # --- rows -----------------------------------------------------------------------------------

    def free(self, row: int) -> None:
        """Return row `row`'s blocks to the pool; the row reads nothing from now on."""
        if self.live[row]:
            for b in self.tables[row]:
                self._release(b)
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
                self.refs[b] += 1
        for r in range(self.batch_size):
            self.free(r)
        self.tables, self.live = tables, live
        self.next_position = self.next_position.index_select(0, index)
        self.batch_size = len(rows)
        if cross:
            reorder_cross(self.cross, index)


CACHE_KINDS.register("paged")(PagedKVCache)
