"""Prefix caching over a BlockPool (vLLM's automatic prefix caching, Kwon et al. 2023,
arXiv:2309.06180, section 4.4; SGLang's RadixAttention, Zheng et al. 2024, arXiv:2312.07104):
full blocks of K/V are kept after their request leaves, addressed by their content, and a later
request whose context starts with the same tokens takes them instead of recomputing them.

A block's address is (its parent's node id, its block_size tokens): exact, no hash collisions,
and a chain, since the same tokens after a different prefix have different keys. Node ids are
never reused, so an entry whose parent was evicted can no longer be reached. The index holds one
reference to each block it knows (BlockPool.share), so a row leaving does not free it; blocks
only the index holds are evicted least recently used first when the pool needs room.

    match(tokens)          the longest chain of cached full blocks `tokens` starts with
    insert(parent, toks, b) remember block b (full, holding toks after parent)
    evict(n)               free up to n blocks only the index holds, oldest use first
    evictable              how many it could free
"""

from __future__ import annotations

from collections import OrderedDict

from .blocks import BlockPool

ROOT = 0  # the parent of a context's first block


class PrefixIndex:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.entries: OrderedDict[tuple[int, tuple[int, ...]], tuple[int, int]] = OrderedDict()
        self.blocks: dict[int, tuple[int, tuple[int, ...]]] = {}  # node -> its key
        self._nodes = 0
        self.hits = self.lookups = 0  # blocks found / blocks looked up

    def match(self, tokens: list[int], limit: int) -> list[tuple[int, int]]:
        """(node, block) of the cached full blocks `tokens` starts with, at most `limit`; each
        found one becomes the most recently used."""
        bs, out, parent = self.pool.block_size, [], ROOT
        for i in range(min(limit, len(tokens) // bs)):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            self.lookups += 1
            hit = self.entries.get(key)
            if hit is None:
                break
            self.entries.move_to_end(key)
            self.hits += 1
            out.append(hit)
            parent = hit[0]
        return out

    def insert(self, parent: int, tokens: tuple[int, ...], block: int) -> int:
        """Remember full `block` (holding `tokens` after node `parent`); returns its node (an
        existing one when the same content is cached already: then `block` is not kept)."""
        key = (parent, tokens)
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key][0]
        self._nodes += 1
        self.entries[key] = (self._nodes, block)
        self.blocks[self._nodes] = key
        self.pool.share(block)  # the index's own hold
        return self._nodes

    @property
    def evictable(self) -> int:
        return sum(1 for _, b in self.entries.values() if self.pool.refs[b] == 1)

    def evict(self, n: int) -> int:
        """Free up to n blocks that only the index holds, least recently used first; returns
        how many were freed."""
        freed = 0
        for key, (node, block) in list(self.entries.items()):
            if freed >= n:
                break
            if self.pool.refs[block] == 1:
                del self.entries[key], self.blocks[node]
                self.pool.release(block)
                freed += 1
        return freed
