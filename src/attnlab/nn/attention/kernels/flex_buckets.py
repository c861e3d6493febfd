"""Flex calls padded to shape buckets, so a process compiles flex once per bucket, not per shape.

attnlab compiles flex with static shapes (torch's CPU template fails on dynamic ones, torch
2.13), one graph per shape (src/attnlab/graphs.py). Prompt lengths and batch sizes vary with
every request, so each call is padded up to its bucket first:

    T, S    `padded_len`: a power of 2 up to SMALL (decode steps, short chunks), then whole
            tiles of flex.BLOCK (TILE) in counts 1, 2, 3, 4, 6, 8, 12, 16, ... (at most 1.5x the
            tiles): every length from 17 to 4,096 falls in one of 10 buckets
    B       a power of 2

and the padding is never seen: padding keys are zeros marked as padding in the mask
(`padded` of the mask description: a BlockMask skips their tiles), padding queries repeat the
last query (they see what it sees, so no row is empty), padding batch rows see no key (their
tiles skipped); the caller keeps out[:B, :, :T]. The bias is padded alike (`ScoreBias.padded`);
a mask or bias kind that cannot pad leaves the call at its own shape. A length already at its
bucket still gets the padded description, so every length of a bucket traces one mask_mod.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ....graphs import bucket
from ..masks import MaskSpec
from .call import AttnCall

SMALL = 16  # lengths up to this pad to a power of 2, not to a whole tile (decode steps, chunks)
TILE = 128  # flex's BlockMask tile (flex.BLOCK, which passes its own to the functions here)


def padded_len(n: int, block: int = TILE) -> int:
    """The bucket a length n is padded to: a power of 2 up to SMALL, then whole tiles of
    `block` in counts 2^k or 3 · 2^(k-1) (at most 1.5x, ~2 buckets a doubling)."""
    if n <= SMALL:
        return bucket(n)
    tiles = -(-n // block)
    p = bucket(tiles)
    if p >= 4 and 3 * p // 4 >= tiles:
        p = 3 * p // 4
    return p * block


def bucket_shapes(q: torch.Tensor, k: torch.Tensor, block: int = TILE) -> tuple[int, ...]:
    """(B, H, T, H_kv, S, D) of the call's bucket."""
    B, H, T, D = q.shape
    return (bucket(B), H, padded_len(T, block), k.shape[1], padded_len(k.shape[2], block), D)


def to_buckets(q, k, v, call: AttnCall, mean_v: torch.Tensor | None, block: int = TILE):
    """q, k, v, the call and mean_v (the empty rows' output) over the call's bucket (module
    docstring) for tiles of `block`; unchanged where the mask or bias cannot pad."""
    B, _, T, _ = q.shape
    S = k.shape[2]
    B2, _, T2, _, S2, _ = bucket_shapes(q, k, block)
    mask = call.mask
    if mask is None:  # the padding keys still need a mask: every real key seen
        dev = q.device
        mask = MaskSpec(torch.arange(T, device=dev).expand(B, T),
                        torch.arange(S, device=dev).expand(B, S))  # fmt: skip
    key = ("flex-padded", B2, T2, S2)
    if key not in mask.memo:  # once per pass: its BlockMask is then shared by every layer
        mask.memo[key] = mask.padded(B2, T2, S2)
    bias = call.bias.padded(B2, T2, S2) if call.bias is not None else None
    if mask.memo[key] is None or (call.bias is not None and bias is None):
        return q, k, v, call, mean_v
    q = torch.cat((q, q[:, :, -1:].expand(-1, -1, T2 - T, -1)), dim=2)  # (B, H, T2, D)
    q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, 0, 0, B2 - B))  # (B2, H, T2, D)
    k, v = (torch.nn.functional.pad(t, (0, 0, 0, S2 - S, 0, 0, 0, B2 - B)) for t in (k, v))
    if mean_v is not None:
        mean_v = torch.nn.functional.pad(mean_v, (0, 0, 0, 0, 0, 0, 0, B2 - B))
    return q, k, v, replace(call, mask=mask.memo[key], bias=bias), mean_v
