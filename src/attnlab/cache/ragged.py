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

With `prefix_caching`, full blocks stay in a PrefixIndex (prefix.py) after their row leaves:
`attach(rid, tokens, limit)` gives a new row the cached blocks its context starts with (shared,
read-only: the row only ever writes after them), `register(rid, tokens)` indexes a row's newly
filled blocks, and `reserve` evicts cached blocks no row holds when the pool runs short.

Reads gather each selected row's blocks into (B, S) slots, S = the longest row's blocks, shorter
rows padded with scratch slots (invalid). A row's positions are 0, 1, ... in slot order, so the
mask needs nothing else. Storage, the per-layer view and the block hand-out are the BlockPool's
(blocks.py), which PagedKVCache uses too; the two caches are siblings.

Protocol: a forward pass's (`ForwardCache`, base.py: `append`, then each layer's `update`),
plus `finish`, `stats` and `bytes_per_token`. Not `reorder`: rows here are requests, not
beams, so this is not a `KVCache` and beam search cannot take it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .base import CacheFullError, CacheShape, stats_dict
from .blocks import SCRATCH, BlockPool, PooledCache
from .prefix import ROOT, PrefixIndex


class RaggedPagedCache(PooledCache):
    def __init__(
        self,
        shape: CacheShape,
        block_size: int = 16,
        num_blocks: int = 256,
        prefix_caching: bool = False,
    ) -> None:
        """`shape.batch_size` and `shape.max_len` are ignored: rows come and go, and the pool
        (num_blocks blocks of block_size tokens) is the only limit. prefix_caching: keep full
        blocks for later rows with the same context start (the module docstring)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 1")
        shape = replace(shape, batch_size=0, max_len=0)
        super().__init__(shape, BlockPool(shape, block_size, num_blocks))
        self.row_tables: dict[int, list[int]] = {}
        self.row_lengths: dict[int, int] = {}
        self.row_nodes: dict[int, list[int]] = {}  # the index's node of each registered block
        self.selected: list[int] = []
        self.prefix = PrefixIndex(self.pool) if prefix_caching else None

    @property
    def available(self) -> int:
        """Blocks a row can get: the free ones and the cached ones no row holds."""
        return self.free_count + (self.prefix.evictable if self.prefix is not None else 0)

    def attach(self, rid: int, tokens: list[int], limit: int) -> int:
        """Give empty row `rid` the cached full blocks `tokens` starts with (at most `limit`);
        returns how many tokens they hold (0 without prefix caching)."""
        if self.prefix is None or self.row_lengths[rid]:
            return 0
        hits = self.prefix.match(tokens, limit)
        for _, block in hits:
            self.pool.share(block)
        self.row_tables[rid] = [b for _, b in hits]
        self.row_nodes[rid] = [n for n, _ in hits]
        self.row_lengths[rid] = len(hits) * self.block_size
        return self.row_lengths[rid]

    def unregistered(self, rid: int) -> bool:
        """Whether row `rid` has full blocks the prefix index does not know yet."""
        nodes = self.row_nodes.get(rid, [])
        return self.prefix is not None and self.row_lengths[rid] // self.block_size > len(nodes)

    def register(self, rid: int, tokens: list[int]) -> None:
        """Index row `rid`'s full blocks, `tokens` being its context."""
        bs, table = self.block_size, self.row_tables[rid]
        nodes = self.row_nodes.setdefault(rid, [])
        for i in range(len(nodes), self.row_lengths[rid] // bs):
            parent = nodes[-1] if nodes else ROOT
            nodes.append(self.prefix.insert(parent, tuple(tokens[i * bs : (i + 1) * bs]), table[i]))

    # --- rows -----------------------------------------------------------------------------------

    def add(self, rid: int) -> None:
        if rid in self.row_tables:
            raise ValueError(f"row {rid} is already in the cache")
        self.row_tables[rid], self.row_lengths[rid] = [], 0

    def reserve(self, rid: int, n_new: int) -> bool:
        """Give row `rid` the blocks for n_new more tokens; False (and nothing taken) if the pool
        has too few free blocks."""
        table = self.row_tables[rid]
        need = self.blocks_for(self.row_lengths[rid] + n_new) - len(table)
        if not self.pool.ensure(need) and self.prefix is not None:
            self.prefix.evict(need - self.free_count)  # cached blocks no row holds, oldest first
        if not self.pool.ensure(need):
            return False
        table.extend(self.pool.take() for _ in range(max(need, 0)))
        return True

    def remove(self, rid: int) -> None:
        """Row `rid`'s blocks back to the pool at once (an unknown row: nothing to do)."""
        for b in self.row_tables.pop(rid, ()):
            self.pool.release(b)
        self.row_lengths.pop(rid, None)
        self.row_nodes.pop(rid, None)
        if rid in self.selected:
            self.selected = [r for r in self.selected if r != rid]
            self.batch_size = len(self.selected)

    def select(self, rids: list[int], lengths: list[int] | None = None) -> None:
        """The rows of the next forward pass, in this order; sets next_position to their
        lengths. lengths: where each row's tokens end, as its owner counts them (the engine's
        plan, src/attnlab/decode/scheduler.py: a step writes from there); None: as the cache
        counted them."""
        missing = [r for r in rids if r not in self.row_tables]
        if missing:
            raise ValueError(f"rows {missing} are not in the cache: add them first")
        if lengths is not None:
            for r, n in zip(rids, lengths, strict=True):
                if not 0 <= n <= len(self.row_tables[r]) * self.block_size:
                    raise ValueError(
                        f"row {r} holds {len(self.row_tables[r])} blocks: it cannot end at {n}"
                    )
                self.row_lengths[r] = n
        self.selected, self.batch_size = list(rids), len(rids)
        lengths = [self.row_lengths[r] for r in rids]
        self.next_position = torch.tensor(lengths, dtype=torch.long, device=self.k.device)

    def finish(self, done: torch.Tensor) -> None:
        """Remove the selected rows where `done` (B,) is True."""
        for b in done.nonzero().flatten().tolist():
            self.remove(self.selected[b])

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
        table = self.pool.table([self.row_tables[r] for r in self.selected], nb)  # (B, nb)
        j = torch.tensor(starts, device=dev)[:, None] + torch.arange(T, device=dev)  # (B, T)
        j = j.clamp(max=nb * bs - 1)  # padding past the last block: masked out below anyway
        write = self.pool.slots(table, j)
        self.write_slots = torch.where(valid, write, SCRATCH * bs)  # padding -> a scratch slot
        self.read_slots = self.pool.slots(table, torch.arange(nb * bs, device=dev).expand(B, -1))
        self.pool.record(self.write_slots, positions, valid)  # scratch slots: always invalid
        # a one-token step: row b's keys are its first n_b slots, positions 0 .. n_b - 1, all at
        # or before its query's (the layers may read the pool in place: blocks.py, a KVView)
        one = T == 1 and all(counts)
        self.decode_lengths = (
            torch.tensor([self.row_lengths[r] for r in self.selected], device=dev) if one else None
        )
        self.step_memo = {}  # a new forward pass: nothing derived yet
        self.length = nb * bs
        self.begin_forward()
        return self.pool.keys(self.read_slots)

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
            blocks_free=self.free_count,
            rows=len(self.row_tables),
            **(
                {
                    "blocks_cached": len(self.prefix.entries),
                    "prefix_hit_blocks": self.prefix.hits,
                    "prefix_lookup_blocks": self.prefix.lookups,
                }
                if self.prefix is not None
                else {}
            ),
        )
