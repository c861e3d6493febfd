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

`graph_view(rows, width)` is the cache as a compiled decode step sees it
(src/attnlab/decode/batch_step.py): static buffers of `rows` rows and `width` blocks a row, which
`load` fills on the host (each row's token, position, write slot and table, padding rows on the
scratch block), and a forward that reads nothing from the host. Its layers hand attention the
pool in place (a `KVView` whose `pages` a paged kernel reads: no per-layer gather), as `append`'s
one-token steps do.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .base import BlockVisits, CacheFullError, CacheShape, KVView, PagedKV, stats_dict
from .blocks import SCRATCH, BlockPool, PooledCache, gather, visits
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
        self.graph_views: dict[tuple[int, int], PoolGraphView] = {}  # graph_view's, by size

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

    # --- the compiled decode step's view ------------------------------------------------------

    def graph_view(self, rows: int, width: int) -> PoolGraphView:
        """The view of `rows` rows of `width` blocks each (kept: its buffers are a compiled,
        on CUDA captured, graph's inputs, so they keep their addresses)."""
        key = (rows, width)
        if key not in self.graph_views:
            self.graph_views[key] = PoolGraphView(self, rows, width)
        return self.graph_views[key]


class _GraphBuffers:
    """A graph view's static inputs: B_b rows, W_b blocks a row (S_b = W_b · block_size slots).
    What the step's attention reads (its mask's positions and validity, the rows' lengths and
    block visits) is made here before the step, on the device: a graph then takes each as an
    input of its own (torch 2.13's CPU flex template cannot lower a mask function over a
    tensor computed inside the graph)."""

    def __init__(self, rows: int, width: int, block_size: int, n_blocks: int, device) -> None:
        long = dict(dtype=torch.long, device=device)
        S = width * block_size
        self.tokens = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)  # each row's new token's position
        self.write = torch.zeros(rows, **long)  # the pool slot it goes to
        self.live = torch.zeros(rows, dtype=torch.bool, device=device)  # False: a padding row
        self.table = torch.zeros(rows, width, **long)  # (B_b, W_b) block ids
        self.offsets = torch.arange(block_size, **long)
        self.block_size = block_size
        # made from the above before each step (`PoolGraphView._prepare`)
        self.q_positions = torch.zeros(rows, 1, **long)  # the queries' positions (B_b, 1)
        self.lengths = torch.zeros(rows, **long)  # keys each row reads: its first n_b slots
        self.read = torch.zeros(rows, S, **long)  # each row's slots in table order
        self.k_positions = torch.zeros(rows, S, **long)  # their positions and validity
        self.k_valid = torch.zeros(rows, S, dtype=torch.bool, device=device)
        self.visits = BlockVisits(  # the blocks each row visits (blocks.py `visits`)
            torch.zeros(rows, dtype=torch.int32, device=device),
            torch.zeros(rows, n_blocks, dtype=torch.int32, device=device),
            torch.zeros(rows, n_blocks, **long),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        v = self.visits
        return (self.tokens, self.positions, self.write, self.live, self.table, self.offsets,
                self.q_positions, self.lengths, self.read, self.k_positions, self.k_valid,
                v.used, v.indices, v.ordinal)  # fmt: skip


class _GraphLayer:
    """One layer of the pool in a graph view: the step's rows written at their slots; the pool
    handed on in place (`KVView.pages`), gathered only if a kernel needs the dense pair."""

    ready = False

    def __init__(self, view: PoolGraphView, layer: int) -> None:
        self.view, self.layer = view, layer

    def update(self, k: torch.Tensor, v: torch.Tensor) -> KVView:
        """k, v (B, H_kv, 1, D) stored; every row's keys and values: the pool as it is."""
        view, layer = self.view, self.layer
        b, pool_k, pool_v = view.buffers, view.k_layers[layer], view.v_layers[layer]
        for pool, new in ((pool_k, k), (pool_v, v)):  # (B, H_kv, 1, D) -> (H_kv, B, D)
            pool.index_copy_(1, b.write, new[:, :, 0].transpose(0, 1).to(pool.dtype))
        pages = PagedKV(pool_k, pool_v, b.read, b.lengths, b.block_size, view.step, b.visits)
        return KVView(pages, lambda: view.gather(layer, b.read))

    def remember(self, x: torch.Tensor) -> None:
        return None


class PoolGraphView:
    """The pool as a compiled decode step sees it (the stack's cache protocol with
    `fixed_shape`): the buffers say what each row writes and reads; nothing here reads the
    device or changes Python state from step to step, so one graph serves every step of its
    size. A padding row writes the scratch block as invalid and reads the scratch slot it
    wrote as its one key, so its values stay finite."""

    fixed_shape = True
    cross = None

    def __init__(self, cache: RaggedPagedCache, rows: int, width: int) -> None:
        self.cache, self.pool = cache, cache.pool
        n_blocks = cache.num_blocks + 1  # the scratch block too
        self.buffers = _GraphBuffers(rows, width, cache.block_size, n_blocks, cache.k.device)
        # each layer's K/V (H_kv, P, D), sliced here, outside any graph: a graph then takes
        # them as inputs of their own (torch 2.13's CPU flex template reads a view made inside
        # the graph from its buffer's start, so every layer would read layer 0's keys)
        self.k_layers = list(cache.pool.k.unbind(0))
        self.v_layers = list(cache.pool.v.unbind(0))
        if cache.k.device.type == "cuda":  # a captured graph reads them at fixed addresses
            pool = cache.pool
            for t in (*self.buffers.tensors(), *self.k_layers, *self.v_layers, pool.k, pool.v,
                      pool.positions, pool.valid):  # fmt: skip
                torch._dynamo.mark_static_address(t)
        self.layers = [_GraphLayer(self, i) for i in range(len(self.k_layers))]
        self.step: dict = {}  # what a kernel derives once per forward (PagedKV.step)

    @property
    def next_position(self) -> torch.Tensor:
        return self.buffers.positions

    @property
    def q_positions(self) -> torch.Tensor:
        """(B_b, 1): the step's positions, as the forward takes them."""
        return self.buffers.q_positions

    def load(self, rids: list[int], tokens: list[int], starts: list[int]) -> None:
        """The host's half of a step: row i of `rids` feeds tokens[i] after starts[i] tokens
        (a block reserved for it); the rest of the rows pad. Copies into the buffers, reads
        nothing from the device; the rows are the cache's selection and advance by one."""
        c, b, bs = self.cache, self.buffers, self.cache.block_size
        rows, width = b.table.shape
        tables = [c.row_tables[r] for r in rids]
        for r, start, table in zip(rids, starts, tables, strict=True):
            if c.blocks_for(start + 1) > len(table):
                raise CacheFullError(
                    f"row {r} decodes after {start} tokens without a reserved block: "
                    f"call reserve({r}, 1) first"
                )
        pad = rows - len(rids)
        host = dict(
            tokens=[*tokens, *[0] * pad],
            positions=[*starts, *[0] * pad],
            write=[t[p // bs] * bs + p % bs for t, p in zip(tables, starts, strict=True)]
            + [SCRATCH * bs] * pad,
            live=[True] * len(rids) + [False] * pad,
            table=[t + [SCRATCH] * (width - len(t)) for t in tables] + [[SCRATCH] * width] * pad,
        )
        for name, values in host.items():  # host -> the static buffers: copies, no reads
            buf = getattr(b, name)
            buf.copy_(torch.tensor(values, dtype=buf.dtype), non_blocking=True)
        self._prepare()
        c.selected, c.batch_size = list(rids), len(rids)
        for r, start in zip(rids, starts, strict=True):
            c.row_lengths[r] = start + 1

    def _prepare(self) -> None:
        """From the loaded rows, on the device (no host read), before the graph runs: each
        row's new slot's position and validity into the pool, and what attention reads: the
        queries' positions, each row's slots, their positions and validity (a padding row's one
        key: the scratch slot it writes), the keys each row reads and the blocks it visits."""
        b, pool, bs = self.buffers, self.pool, self.buffers.block_size
        pool.positions.index_copy_(0, b.write, b.positions)
        pool.valid.index_copy_(0, b.write, b.live)
        # (B, W, 1) * bs + (bs,) -> (B, W * bs): each row's slots in table order
        b.read.copy_((b.table[:, :, None] * bs + b.offsets).flatten(1))
        b.k_positions.copy_(pool.positions[b.read])
        b.k_valid.copy_(pool.valid[b.read])
        b.k_valid[:, 0] |= ~b.live
        b.q_positions.copy_(b.positions[:, None])
        b.lengths.copy_(b.positions + 1)
        visits(b.table, b.lengths, bs, b.visits.indices.shape[1], out=b.visits)

    def gather(self, layer: int, read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values of slots read (B, S) as (B, H_kv, S, D): the dense
        pair, for a kernel that does not read the pool in place."""
        return gather(self.k_layers[layer], self.v_layers[layer], read)

    def pad_only(self) -> None:
        """Every row a padding row (writes and reads the scratch block): a capture's run."""
        b = self.buffers
        for t, value in ((b.tokens, 0), (b.positions, 0), (b.live, False),
                         (b.write, SCRATCH * b.block_size), (b.table, SCRATCH)):  # fmt: skip
            t.fill_(value)
        self._prepare()

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key's position and validity (B, S), S = W_b · block_size: the rows' slots were
        written by `load` (`_prepare`), which is what `positions` and `valid` say."""
        self.step = {}  # a new forward pass: nothing derived yet
        return self.buffers.k_positions, self.buffers.k_valid
