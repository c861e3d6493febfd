"""A pool of fixed-size K/V blocks with reference counts: the storage both paged caches share
(PagedAttention, Kwon et al. 2023, arXiv:2309.06180, section 4). `PagedKVCache` (paged.py)
decodes one batch that starts together, beams sharing blocks; `RaggedPagedCache` (ragged.py)
holds the engine's rows of their own lengths. Each holds a `BlockPool`; the block tables, which
say what a row's blocks are, are theirs.

    k, v               (L, H_kv, n_slots, D)   slot s of block b at b · block_size + s
    positions, valid   (n_slots,)              what the mask needs, stored beside K/V
    refs               per block, how many tables hold it; at 0 it is back on the free list

    take()     a fresh block (one holder, its slots invalid)
    share(b)   one more holder (a beam copying its parent's table)
    release(b) one holder fewer
    copy(b)    copy-on-write: a private copy of shared block b, which loses that holder
    ensure(n)  n free blocks, growing a growable pool; False if they cannot be had
    extend(n)  n more blocks

Block 0 is the scratch block: never handed out and always invalid, it is where rows with
nothing to write (finished rows, padding) write (its slot 0) and what short rows read past their
end. Its slot SPARE (1) is never written: zeros, which a kernel may visit as a key of its own
(paged_flex.py's sinks: a zero value whose score is the sink logit).
A future prefix cache shares prompt blocks between requests through the same `share` and
`release`.
"""

from __future__ import annotations

import math

import torch

from .base import BlockVisits, CacheBase, CacheFullError, CacheShape, KVView, LayerView, PagedKV

SCRATCH = 0
SPARE = 1  # slot 1 of the scratch block (block 0, blocks of 2 slots or more): never written


class BlockPool:
    def __init__(
        self, shape: CacheShape, block_size: int, num_blocks: int, growable: bool = False
    ) -> None:
        """num_blocks blocks of block_size slots (plus the scratch block) for a decoder of
        `shape` (its batch size and max_len are not used). growable: `ensure` may extend it."""
        if block_size < 1:
            raise ValueError(f"block_size ({block_size}) must be >= 1")
        if num_blocks < 0:
            raise ValueError(f"num_blocks ({num_blocks}) must be >= 0")
        self.block_size, self.num_blocks, self.growable = block_size, num_blocks, growable
        n_slots = (num_blocks + 1) * block_size  # + the scratch block
        dev = shape.device
        pool = (shape.n_layers, shape.n_kv_heads, n_slots, shape.head_dim)
        self.k = torch.zeros(pool, dtype=shape.dtype, device=dev)
        self.v = torch.zeros(pool, dtype=shape.dtype, device=dev)
        self.positions = torch.zeros(n_slots, dtype=torch.long, device=dev)
        self.valid = torch.zeros(n_slots, dtype=torch.bool, device=dev)
        self.free_blocks = list(range(num_blocks, 0, -1))  # pop() hands out 1, 2, ...
        self.refs = [0] * (num_blocks + 1)

    @property
    def free_count(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    # --- blocks and their holders ---------------------------------------------------------------

    def take(self) -> int:
        if not self.free_blocks:
            raise CacheFullError(
                f"block pool empty ({self.num_blocks} blocks of {self.block_size} tokens): "
                "call ensure(n) before taking n blocks, or free rows first"
            )
        b = self.free_blocks.pop()
        self.refs[b] = 1
        self.valid[b * self.block_size : (b + 1) * self.block_size] = False
        return b

    def share(self, b: int) -> None:
        self.refs[b] += 1

    def release(self, b: int) -> None:
        if self.refs[b] < 1:
            raise ValueError(f"block {b} released more often than it was taken or shared")
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free_blocks.append(b)

    def copy(self, src: int) -> int:
        """Copy-on-write: a private copy of shared block `src`; the caller's hold on `src`
        moves to the copy."""
        dst, bs = self.take(), self.block_size
        s, d = slice(src * bs, (src + 1) * bs), slice(dst * bs, (dst + 1) * bs)
        self.k[:, :, d], self.v[:, :, d] = self.k[:, :, s], self.v[:, :, s]
        self.positions[d], self.valid[d] = self.positions[s], self.valid[s]
        self.release(src)
        return dst

    def ensure(self, n: int) -> bool:
        """True if n blocks are free, after growing a growable pool (at least twofold, so
        beam search's growth costs few reallocations); a fixed pool is a hard limit."""
        short = n - self.free_count
        if short > 0 and self.growable:
            self.extend(max(short, self.num_blocks))
        return n <= self.free_count

    def extend(self, n: int) -> None:
        """n more blocks: one reallocation of the pool."""
        first, extra = self.num_blocks + 1, n * self.block_size
        L, H, _, D = self.k.shape
        self.k = torch.cat((self.k, self.k.new_zeros(L, H, extra, D)), 2)
        self.v = torch.cat((self.v, self.v.new_zeros(L, H, extra, D)), 2)
        self.positions = torch.cat((self.positions, self.positions.new_zeros(extra)))
        self.valid = torch.cat((self.valid, self.valid.new_zeros(extra)))
        self.free_blocks[:0] = range(first + n - 1, first - 1, -1)
        self.refs += [0] * n
        self.num_blocks += n

    # --- slots ----------------------------------------------------------------------------------

    def table(self, tables: list[list[int]], width: int) -> torch.Tensor:
        """(B, width) block ids of each row's table, padded with the scratch block."""
        rows = [t + [SCRATCH] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.long, device=self.k.device).reshape(len(rows), width)

    def slots(self, table: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Flat pool slots (B, T) of logical slots j (B, T) of each row of table (B, nb)."""
        bs = self.block_size
        return table.gather(1, j // bs) * bs + j % bs

    def record(self, slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Store the positions and validity (B, T) of the tokens written to slots (B, T)."""
        w = slots.reshape(-1)
        self.positions.index_copy_(0, w, positions.reshape(-1))
        self.valid.index_copy_(0, w, valid.reshape(-1))
        self.valid[SCRATCH * self.block_size : (SCRATCH + 1) * self.block_size] = False

    def keys(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (B, S) positions and validity of the keys in slots (B, S)."""
        return self.positions[slots], self.valid[slots]

    def write(self, layer: int, write: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer `layer`: K/V (B, H_kv, T, D) into slots write (B, T)."""
        B, H_kv, T, D = k.shape
        w = write.reshape(-1)  # flat pool slots (B·T,)
        self.k[layer].index_copy_(1, w, k.to(self.k.dtype).transpose(0, 1).reshape(H_kv, B * T, D))
        self.v[layer].index_copy_(1, w, v.to(self.v.dtype).transpose(0, 1).reshape(H_kv, B * T, D))

    def gather(self, layer: int, read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`: the keys and values of slots read (B, S) as (B, H_kv, S, D),
        gathered contiguous for the kernel."""
        return gather(self.k[layer], self.v[layer], read)


def gather(
    k: torch.Tensor, v: torch.Tensor, read: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's pool K and V (H_kv, P, D) at slots read (B, S), as (B, H_kv, S, D)."""
    B, S = read.shape
    H_kv, _, D = k.shape
    r = read.reshape(-1)  # flat pool slots (B·S,)
    k_all = k.index_select(1, r).view(H_kv, B, S, D).transpose(0, 1)
    v_all = v.index_select(1, r).view(H_kv, B, S, D).transpose(0, 1)
    return k_all, v_all


def visits(table: torch.Tensor, lengths: torch.Tensor, block_size: int, n_blocks: int,
           out: BlockVisits | None = None) -> BlockVisits:  # fmt: skip
    """The blocks rows of `table` (B, W) physical block ids in table order visit to read their
    first lengths[b] slots, over a pool of n_blocks blocks: on the device, no host read. `out`:
    buffers to write into (a captured graph's inputs keep their addresses)."""
    B, W = table.shape
    dev = table.device
    used = -(-lengths // block_size)  # (B,) blocks each row reads
    j = torch.arange(W, device=dev)
    held = j[None, :] < used[:, None]  # (B, W): the row's own entries
    # physical block -> its index in the row's table (-1: not the row's); entries past `used`
    # are scattered into one spare column, dropped after
    ordinal = torch.full((B, n_blocks + 1), -1, dtype=torch.long, device=dev)
    ordinal.scatter_(1, torch.where(held, table, n_blocks), j.expand(B, W).clone())
    indices = torch.zeros(B, n_blocks, dtype=torch.int32, device=dev)
    indices[:, :W] = torch.where(held, table, 0).to(torch.int32)
    if out is None:
        return BlockVisits(used.to(torch.int32), indices, ordinal[:, :n_blocks])
    out.used.copy_(used)
    out.indices.copy_(indices)
    out.ordinal.copy_(ordinal[:, :n_blocks])
    return out


class _PoolLayer(LayerView):
    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | KVView:
        """The new K/V into the slots `append` chose; then the slots read, gathered — or, on a
        one-token step whose rows see exactly their own first n_b slots (the engine's decode,
        ragged.py), a KVView: the pool K and V (H_kv, P, D), the rows' slots (B, S) and n
        (B,) for attention that reads the pool in place, the gather done only if unpacked."""
        c, layer = self.cache, self.layer
        pool, read = c.pool, c.read_slots
        pool.write(layer, c.write_slots, k, v)
        if c.decode_lengths is None:
            return pool.gather(layer, read)
        pages = PagedKV(
            pool.k[layer], pool.v[layer], read, c.decode_lengths, pool.block_size, c.step_memo
        )
        return KVView(pages, lambda: pool.gather(layer, read))


class PooledCache(CacheBase):
    """What the two paged caches share: a BlockPool, the layer view over it, and the slots
    each forward pass writes and reads (set by the kind's `append`, read by `update`)."""

    def __init__(self, shape: CacheShape, pool: BlockPool) -> None:
        super().__init__(shape, _PoolLayer)
        self.pool = pool
        empty = torch.empty(0, 0, dtype=torch.long, device=shape.device)
        self.write_slots, self.read_slots = empty, empty  # (B, T) and (B, S)
        self.decode_lengths: torch.Tensor | None = None  # (B,) keys per row of a one-token step
        self.step_memo: dict = {}  # what the kernels derive once per forward pass (PagedKV.step)

    @property
    def k(self) -> torch.Tensor:
        return self.pool.k

    @property
    def v(self) -> torch.Tensor:
        return self.pool.v

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def free_count(self) -> int:
        return self.pool.free_count

    def blocks_for(self, n_tokens: int) -> int:
        return self.pool.blocks_for(n_tokens)
