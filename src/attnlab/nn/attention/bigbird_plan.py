"""BigBird's random block plan, as transformers draws it (models/big_bird/modeling_big_bird.py:
`_get_rand_attn_plan`, `_get_single_block_row_attention`, `_bigbird_block_rand_mask_with_head`,
`_bigbird_block_rand_mask`), ported line by line for src/attnlab/nn/attention/block_sparse.py
(its module docstring, items 1 and 2, says what the plan is and where it differs from the
paper). Kept apart because it is a port to compare with its source, not attnlab's own design.
"""

from __future__ import annotations

import functools

import numpy as np


def _plan(n: int, b: int, r: int) -> tuple[list[int], list[int]]:
    """`_get_rand_attn_plan`: where the random blocks of each row may come from."""
    if (2 * r + 5) < (n // b):
        return [int((2 * r + 5) * b), n], [r, 0]
    if (r + 5) < (n // b):
        return [int((r + 5) * b), n], [r // 2, r - (r // 2)]
    return [n], [r]


def _row(rng, block_id: int, to_start: int, to_end: int, r: int) -> np.ndarray:
    """`_get_single_block_row_attention` with window 1 / 1 and global blocks 1 / 1."""
    perm = rng.permutation(np.arange(to_start, to_end, dtype=np.int32))
    illegal = [*range(block_id - 1, block_id + 2), 0, to_end - 1]
    if block_id == 1:
        illegal.append(to_end - 2)
    if block_id == to_end - 2:
        illegal.append(1)
    chosen: list[int] = []
    for i in range(to_end - to_start):
        if perm[i] not in illegal:
            chosen.append(perm[i])
        if len(chosen) == r:
            break
    return np.array(chosen, dtype=np.int32)


def _with_head(rng, n: int, b: int, heads: int, plan_len: list[int], plan_r: list[int]):
    """`_bigbird_block_rand_mask_with_head` (training mode): (H, nb - 2, r)."""
    nb, ends = n // b, np.array(plan_len) // b
    top = plan_len.index(n)
    out = np.zeros((heads, nb, int(np.sum(plan_r[: top + 1]))), dtype=np.int32)
    for p in range(top + 1):
        lo = 0
        if p > 0:
            if plan_r[p] > 0:
                lo, hi = int(np.sum(plan_r[:p])), int(np.sum(plan_r[: p + 1]))
                for row in range(1, ends[p - 1]):
                    for h in range(heads):
                        out[h, row, lo:hi] = _row(rng, row, ends[p - 1], ends[p], plan_r[p])
            for q in range(p):
                if plan_r[q] == 0:
                    continue
                for row in range(ends[p - 1], ends[p]):
                    lo = int(np.sum(plan_r[:q])) if q > 0 else 0
                    start = ends[q - 1] if q > 0 else 0
                    hi = int(np.sum(plan_r[: q + 1]))
                    for h in range(heads):
                        out[h, row, lo:hi] = _row(rng, row, start, ends[q], plan_r[q])
        if plan_r[p] == 0:
            continue
        hi = int(np.sum(plan_r[: p + 1]))
        first, start = (1, 0) if p == 0 else (ends[p - 1], ends[p - 1])
        if p > 0:
            lo = int(np.sum(plan_r[:p]))
        for row in range(first, ends[p]):
            for h in range(heads):
                out[h, row, lo:hi] = _row(rng, row, start, ends[p], plan_r[p])
    return out[:, 1 : nb - 1]


def _legacy(rng, n: int, b: int, r: int, last_idx: int) -> np.ndarray:
    """`_bigbird_block_rand_mask` (training mode, T in {1024, 3072, 4096}): (n/b - 2, r)."""
    nb = n // b
    out = np.zeros((nb - 2, r), dtype=np.int32)
    middle = np.arange(1, nb - 1, dtype=np.int32)
    last = nb - 1
    if last_idx > 2 * b:
        last = (last_idx // b) - 1
    for i in range(1, nb - 1):
        start, end = i - 2, i
        if i == 1:
            out[i - 1] = rng.permutation(middle[2:last])[:r]
        elif i == 2:
            out[i - 1] = rng.permutation(middle[3:last])[:r]
        elif i in (nb - 3, nb - 2) or start > last:  # two branches of transformers' code
            out[i - 1] = rng.permutation(middle[:last])[:r]
        elif end + 1 == last:
            out[i - 1] = rng.permutation(middle[:start])[:r]
        else:
            out[i - 1] = rng.permutation(np.concatenate((middle[:start], middle[end + 1 : last])))[
                :r
            ]
    return out


@functools.lru_cache(maxsize=64)
def random_blocks(
    n_blocks: int, block_size: int, r: int, heads: int, seed: int, training: bool, max_len: int
) -> np.ndarray:
    """(H, nb - 2, r) key block of each random block of query blocks 1 .. nb-2: transformers'
    plan for a padded length of nb·b (block_sparse.py's module docstring, items 1 and 2)."""
    n = n_blocks * block_size
    if not training:  # "During inference (eval) no randomness": block 0 everywhere
        return np.zeros((heads, n_blocks - 2, r), dtype=np.int32)
    rng = np.random.RandomState(seed)  # np.random.seed(seed) + np.random.permutation, unshared
    if n in (1024, 3072, 4096):
        plans = [_legacy(rng, max_len, block_size, r, 1024)[: n_blocks - 2] for _ in range(heads)]
        return np.stack(plans)
    return _with_head(rng, n, block_size, heads, *_plan(n, block_size, r))
