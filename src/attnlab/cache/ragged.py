"""Rows of their own lengths in one paged pool: the cache of the continuous-batching engine
(src/attnlab/decode/engine.py; PagedAttention, Kwon et al. 2023, arXiv:2309.06180, section 4.5).

`PagedKVCache` (paged.py) decodes a batch that starts together: every row has the same number of
slots, left padding fills the gaps. Under continuous batching requests join and leave at any
step, so here each row (keyed by the engine's request id) has its own length and its own block
table, and a forward runs over any subset of rows (`select`):

    add(rid)              a new, empty row
    reserve(rid, n)       blocks for n more tokens, all or nothing (False: the pool is short)
    select(rids)          the rows (in this order) of the next forward
    append(...)           row b's valid tokens (a prefix of its T; right padding) take its next
                          slots; padding tokens write to the scratch block, never valid
    remove(rid)           its blocks back to the pool at once

Reads gather each selected row's blocks into (B, S) slots, S = the longest row's blocks, shorter
rows padded with scratch slots (invalid). A row's positions are 0, 1, ... in slot order, so the
mask needs nothing else. Storage, the per-layer view and the block hand-out are paged.py's.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .base import CacheFullError, CacheShape, stats_dict
from .paged import SCRATCH, PagedKVCache


class RaggedPagedCache(PagedKVCache):
    def __init__(self, shape: CacheShape, block_size: int = 16, num_blocks: int = 256) -> None:
        """`shape.batch_size` and `shape.max_len` are ignored: rows come and go, and the pool
        (num_blocks blocks of block_size tokens) is the only limit."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 1")
        super().__init__(replace(shape, batch_size=0, max_len=0), block_size, num_blocks)
        self.row_tables: dict[int, list[int]] = {}
        self.row_lengths: dict[int, int] = {}
        self.selected: list[int] = []

    # --- rows -----------------------------------------------------------------------------------

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    @property
    def free_count(self) -> int:
        return len(self.free_blocks)

    def add(self, rid: int) -> None:
        if rid in self.row_tables:
            raise ValueError(f"row {rid} is already in the cache")
        self.row_tables[rid], self.row_lengths[rid] = [], 0

    def reserve(self, rid: int, n_new: int) -> bool:
        """Give row `rid` the blocks for n_new more tokens; False (and nothing taken) if the pool
        has too few free blocks."""
        table = self.row_tables[rid]
        need = self.blocks_for(self.row_lengths[rid] + n_new) - len(table)
        if need > len(self.free_blocks):
            return False
        table.extend(self._take() for _ in range(max(need, 0)))
        return True

    def remove(self, rid: int) -> None:
        for b in self.row_tables.pop(rid, ()):
            self._release(b)
        self.row_lengths.pop(rid, None)
        if rid in self.selected:
            self.selected = [r for r in self.selected if r != rid]
            self.batch_size = len(self.selected)

    def free(self, row: int) -> None:
        self.remove(row)

    def select(self, rids: list[int]) -> None:
        missing = [r for r in rids if r not in self.row_tables]
        if missing:
            raise ValueError(f"rows {missing} are not in the cache: add them first")
        self.selected, self.batch_size = list(rids), len(rids)
        lengths = [self.row_lengths[r] for r in rids]
        self.next_position = torch.tensor(lengths, dtype=torch.long, device=self.k.device)

    def finish(self, done: torch.Tensor) -> None:
        for b in done.nonzero().flatten().tolist():
            self.remove(self.selected[b])

    def reorder(self, index: torch.Tensor, cross: bool = True) -> None:
        raise NotImplementedError("the ragged cache serves the engine, not beam search")

    # --- one forward ----------------------------------------------------------------------------

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's first valid[b].sum() tokens take its next slots (blocks reserved before);
        returns the (B, S) position and validity of every key of the selected rows."""
        B, T = positions.shape
        if len(self.selected) != B:
            raise ValueError(f"{len(self.selected)} rows selected, got a batch of {B}")
        dev, bs = self.k.device, self.block_size
        counts = valid.sum(dim=1).tolist()
        starts = [self.row_lengths[r] for r in self.selected]
        for r, s, n in zip(self.selected, starts, counts, strict=True):
            if self.blocks_for(s + n) > len(self.row_tables[r]):
                raise CacheFullError(
                    f"row {r} writes {n} tokens after {s} without reserved blocks: "
                    f"call reserve({r}, {n}) first"
                )
            self.row_lengths[r] = s + n
        nb = max(len(self.row_tables[r]) for r in self.selected)
        table = torch.tensor(
            [
                self.row_tables[r] + [SCRATCH] * (nb - len(self.row_tables[r]))
                for r in self.selected
            ],
            dtype=torch.long,
            device=dev,
        )  # (B, nb)
        j = torch.tensor(starts, device=dev)[:, None] + torch.arange(T, device=dev)  # (B, T)
        j = j.clamp(max=nb * bs - 1)  # padding past the last block: masked out below anyway
        write = table.gather(1, j // bs) * bs + j % bs
        self._write = torch.where(valid, write, SCRATCH * bs)  # padding -> a scratch slot
        s_all = torch.arange(nb * bs, device=dev)
        self._read = table[:, s_all // bs] * bs + s_all % bs  # (B, S)
        w = self._write.view(-1)
        self.slot_positions.index_copy_(0, w, positions.reshape(-1))
        self.slot_valid.index_copy_(0, w, valid.reshape(-1))  # scratch slots: always False
        self.slot_valid[SCRATCH * bs : (SCRATCH + 1) * bs] = False
        self.length = nb * bs
        return self.slot_positions[self._read], self.slot_valid[self._read]

    def stats(self) -> dict:
        held = sum(len(t) for t in self.row_tables.values())
        used = sum(self.row_lengths.values())
        return stats_dict(
            held * self.block_size,
            used,
            self.bytes_per_token(),
            block_size=self.block_size,
            blocks_total=self.num_blocks,
            blocks_used=held,
            blocks_free=len(self.free_blocks),
            rows=len(self.row_tables),
        )
