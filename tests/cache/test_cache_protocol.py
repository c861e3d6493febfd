"""The cache protocol's order and the block pool under the paged caches.

- Order (attnlab.cache.base.ForwardCache): a forward pass calls `append` once, then each layer's
  `update` once; an update with no append before it, or a second one after a single append,
  raises for every kind, instead of writing over other tokens' slots.
- The paged and ragged caches are siblings over one BlockPool, each keeping the protocol it
  promises (KVCache; ForwardCache without reorder).
- BlockPool (attnlab.cache.blocks): blocks are handed out 1, 2, ... (never the scratch block 0),
  counted per holder, back on the free list at zero holders, invalid when taken again; copy-on-
  write copies K/V, positions and validity and moves one hold; a fixed pool is a hard limit, a
  growable one at least doubles.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attnlab.cache import (
    BlockPool,
    CacheFullError,
    CacheShape,
    ForwardCache,
    KVCache,
    RaggedPagedCache,
    new_cache,
)

SHAPE = CacheShape(n_layers=2, batch_size=2, max_len=8, n_kv_heads=1, head_dim=4)
KV_KINDS = {
    "static": {},
    "sliding": {},
    "paged": {"block_size": 2},
    "latent": {},
    "memory": {"mem_len": 4},
}


def _cache(kind: str):
    shape = replace(SHAPE, window=4) if kind == "sliding" else SHAPE
    return new_cache(shape, kind, **KV_KINDS.get(kind, {}))


def _append(cache, T: int = 1) -> None:
    pos = cache.next_position[:, None] + torch.arange(T)
    cache.append(pos, torch.ones_like(pos, dtype=torch.bool))


@pytest.mark.parametrize("kind", KV_KINDS)
def test_update_needs_an_append_first(kind):
    cache = _cache(kind)
    kv = torch.randn(2, 1, 1, 4)
    with pytest.raises(RuntimeError, match=r"layers\[0\].update\(\) without a preceding"):
        cache.layers[0].update(kv, kv)
    _append(cache)
    for layer in cache.layers:  # once per layer: the protocol
        layer.update(kv, kv)
    with pytest.raises(RuntimeError, match="already stored after the last append"):
        cache.layers[1].update(kv, kv)
    _append(cache)  # the next pass opens every layer again
    k_all, _ = cache.layers[1].update(kv, kv)
    assert k_all.shape[2] >= 2  # both tokens are attended to


def test_the_ragged_cache_checks_the_order_too():
    cache = RaggedPagedCache(SHAPE, block_size=2, num_blocks=4)
    cache.add(7)
    assert cache.reserve(7, 3)
    cache.select([7])
    kv = torch.randn(1, 1, 3, 4)
    with pytest.raises(RuntimeError, match="without a preceding"):
        cache.layers[0].update(kv, kv)
    _append(cache, 3)
    k_all, _ = cache.layers[0].update(kv, kv)
    assert torch.equal(k_all[:, :, :3], kv)  # its own slots, in order
    with pytest.raises(RuntimeError, match="already stored"):
        cache.layers[0].update(kv, kv)


def test_the_paged_caches_are_siblings_with_the_protocols_they_keep():
    """Both hold a BlockPool; the paged cache is a KVCache (beams: reorder), the ragged one
    only a ForwardCache (rows are requests: no reorder to refuse)."""
    paged, ragged = new_cache(SHAPE, "paged"), RaggedPagedCache(SHAPE, num_blocks=4)
    assert isinstance(paged.pool, BlockPool) and isinstance(ragged.pool, BlockPool)
    assert not isinstance(ragged, type(paged)) and not isinstance(paged, type(ragged))
    assert isinstance(paged, KVCache) and isinstance(ragged, ForwardCache)
    assert not isinstance(ragged, KVCache)


def test_recurrent_state_is_written_after_an_append():
    cache = new_cache(SHAPE, "recurrent")
    s, z = cache.layers[0].read_state()
    with pytest.raises(RuntimeError, match="without a preceding"):
        cache.layers[0].write_state(s, z)
    _append(cache)
    cache.layers[0].write_state(s + 1, z)
    assert bool((cache.layers[0].read_state()[0] == 1).all())


def _block(pool: BlockPool, b: int) -> slice:
    return slice(b * pool.block_size, (b + 1) * pool.block_size)


def test_block_pool_counts_holders_and_frees_at_zero():
    pool = BlockPool(SHAPE, block_size=2, num_blocks=3)
    taken = [pool.take() for _ in range(3)]
    assert taken == [1, 2, 3] and pool.free_count == 0  # block 0 is scratch, never handed out
    with pytest.raises(CacheFullError, match="block pool empty"):
        pool.take()
    a = taken[0]
    pool.record(
        torch.tensor([[2 * a, 2 * a + 1]]),
        torch.tensor([[5, 6]]),
        torch.ones(1, 2, dtype=torch.bool),
    )
    pool.share(a)  # a second holder (a beam copying a table)
    pool.release(a)
    assert (pool.refs[a], pool.free_count) == (1, 0)  # still held once
    pool.release(a)
    assert (pool.refs[a], pool.free_count) == (0, 1)
    with pytest.raises(ValueError, match="released more often"):
        pool.release(a)
    assert pool.take() == a and not bool(pool.valid[_block(pool, a)].any())  # fresh: invalid


def test_block_pool_copy_on_write_copies_and_moves_one_hold():
    pool = BlockPool(SHAPE, block_size=2, num_blocks=4)
    a = pool.take()
    slots = torch.tensor([[2 * a, 2 * a + 1]])
    pool.record(slots, torch.tensor([[3, 4]]), torch.tensor([[True, False]]))
    pool.k[:, :, _block(pool, a)] = torch.randn(2, 1, 2, 4)
    pool.share(a)
    b = pool.copy(a)
    assert b != a and (pool.refs[a], pool.refs[b]) == (1, 1)
    for t in (pool.k, pool.v):
        assert torch.equal(t[:, :, _block(pool, b)], t[:, :, _block(pool, a)])
    assert pool.positions[_block(pool, b)].tolist() == [3, 4]
    assert pool.valid[_block(pool, b)].tolist() == [True, False]


def test_a_fixed_pool_is_a_limit_and_a_growable_one_doubles():
    fixed = BlockPool(SHAPE, block_size=2, num_blocks=2)
    assert fixed.ensure(2) and not fixed.ensure(3) and fixed.num_blocks == 2
    grows = BlockPool(SHAPE, block_size=2, num_blocks=3, growable=True)
    held = grows.take()
    grows.k[:, :, _block(grows, held)] = 1.0
    assert grows.ensure(3) and grows.num_blocks == 6  # one block short: it doubles, 3 -> 6
    assert grows.free_count == 5 and grows.k.shape[2] == (6 + 1) * 2
    assert bool((grows.k[:, :, _block(grows, held)] == 1).all())  # what was stored stays
    assert sorted(grows.take() for _ in range(5)) == [2, 3, 4, 5, 6]
