"""BigBird's block-sparse attention (Zaheer et al. 2020, arXiv:2007.14062, section 2 and appendix
D, the "ITC" form), as a mask description and the layer that builds it.

The sequence is cut into blocks of b tokens (nb = ceil(T / b) blocks). Per head, query block i
sees the key blocks

    i-1, i, i+1           the sliding window of 3 blocks
    0, nb-1               the global blocks: every query sees them ...
    all, for i in {0, nb-1}                 ... and they see every key
    rand[h, i-1, :]       r random blocks of this head and row, for 1 <= i <= nb-2

so a query sees about (5 + r)·b keys whatever T is:

    key block →  0 1 2 3 4 5 6 7
    query   0    ■ ■ ■ ■ ■ ■ ■ ■     global row
    block   1    ■ ■ ■ · · r · ■
            2    ■ ■ ■ ■ · · · ■     (r: a random block of one head)
            3    ■ r ■ ■ ■ · · ■
            ...
            7    ■ ■ ■ ■ ■ ■ ■ ■     global row

`BlockSparseMask` evaluates this per block of queries × keys like `MaskSpec` (masks.py): a
(1 | B, H, tq, tk) bool, one plane per head because the random blocks differ by head. The blocked
kernels therefore never build (B, H, T, S): `visible_keys` is the union over heads of what a run of
rows sees, and `row_runs` cuts the two global row blocks apart.

What transformers computes (models/big_bird/modeling_big_bird.py, BigBirdBlockSparseAttention and
BigBirdModel.forward), which this reproduces, and where that differs from the paper:

1. The random plan. numpy's legacy generator is re-seeded with the layer index at every forward
   pass in training mode (`np.random.seed(self.seed)`), so the "random" blocks are one fixed
   pattern per layer and length, not fresh draws. For T not in {1024, 3072, 4096}
   (`_get_rand_attn_plan`, `_bigbird_block_rand_mask_with_head`) every random block is drawn from
   the first 2r + 5 blocks only; for those three lengths (`_bigbird_block_rand_mask`, "old plans
   used in paper") from the first 1024 tokens of a plan as long as max_position_embeddings, the
   same draw for each head in turn. `random_blocks` (bigbird_plan.py) is a line-by-line port, on
   its own `np.random.RandomState` (the same stream, without touching numpy's global state). The
   paper draws r blocks uniformly.
2. Eval mode has no randomness: every random block is block 0. Block 0 then enters each middle
   row's softmax 1 + r times (its keys are gathered r more times), i.e. weight (1 + r)·e^s. This
   multiplicity is kept as a score bias of log(count) (`KeyCountBias`), exact since e^(s + log c)
   = c·e^s. The legacy 1024-token plan can likewise repeat the last block.
3. No attention dropout on the block-sparse path (only the full-attention fallback drops).
4. Short inputs: for T <= (5 + 2r)·b transformers switches to full attention with a warning
   (`set_attention_type("original_full")`, which then stays switched for every later call); the
   layer does the same per call (`BlockSparseAttention.min_sparse_len`).
5. Padding. transformers pads T up to a multiple of b with pad tokens; here the last block is
   short instead — the same function, since a pad key is a masked key. Either way "the last
   block" is the last of the padded batch, not of each row's real tokens, so a right-padded row
   does not compute what it would alone (the global block may be padding). Masked keys get
   −10000 added in transformers and are excluded here: the same weights in fp32 wherever a query
   sees a real key, i.e. at every real query (its own block). Padding queries differ (transformers
   zeroes them, attnlab averages v) and are ignored downstream.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ...cache.base import LayerKV
from .bias import ScoreBias, as_bias
from .bigbird_plan import random_blocks
from .layer import ATTENTIONS, Attention, AttnContext
from .masks import MaskCaps, MaskDescription, tile_any_all

ALL = slice(None)
RUN_BLOCKS = 8


# --- the description ----------------------------------------------------------------------------


def _indices(sel: slice | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """A slice of range(n), or key indices, as an index tensor."""
    if isinstance(sel, torch.Tensor):
        return sel
    return torch.arange(n, device=device)[sel]


@dataclass(frozen=True)
class BlockSparseMask(MaskDescription):
    """Which keys each query sees under BigBird's pattern, per head, from block-level tables:
    `counts` (H, nb, nb) says how often each key block enters a query block's softmax (0 = not at
    all, > 1 for the repeated blocks of item 2 in the module docstring); `seen` is counts > 0 and
    `log_counts` its log, kept so that evaluating a block is one gather."""

    counts: torch.Tensor  # (H, nb, nb) int: query block x key block
    seen: torch.Tensor  # (H, nb, nb) bool
    log_counts: torch.Tensor  # (H, nb, nb) float32, 0 where a block is seen once or not at all
    block_size: int
    length: int  # T = S: the (unpadded) sequence length
    key_padding: torch.Tensor | None = None  # (B, S) bool, True = real token
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # nothing causal, no window (MaskDescription's answers); its keys listed per query block
    caps: ClassVar[MaskCaps] = MaskCaps(offsets=False, key_blocks=True, pointwise=True)

    @property
    def planes(self) -> int:
        """Mask planes per block: one per head (a blocked kernel sizes its blocks by it)."""
        return self.counts.shape[0]

    @classmethod
    def bigbird(
        cls,
        length: int,
        block_size: int,
        rand: torch.Tensor,
        key_padding: torch.Tensor | None = None,
    ) -> BlockSparseMask:
        """The pattern of a sequence of `length` tokens; `rand` (H, nb - 2, r) from
        `random_blocks`."""
        H, nb = rand.shape[0], -(-length // block_size)
        i = torch.arange(nb, device=rand.device)
        seen = (i[:, None] - i[None, :]).abs() <= 1  # (nb, nb): the 3-block window
        seen[:, [0, nb - 1]] = True  # global key blocks
        seen[[0, nb - 1], :] = True  # global query blocks
        counts = seen.long().repeat(H, 1, 1)  # (H, nb, nb)
        extra = torch.zeros_like(counts[:, 1 : nb - 1])  # (H, nb - 2, nb)
        extra.scatter_add_(2, rand.long(), torch.ones_like(rand, dtype=torch.long))
        counts[:, 1 : nb - 1] += extra  # the random blocks of rows 1 .. nb-2
        log_counts = counts.clamp(min=1).float().log()
        return cls(counts, counts > 0, log_counts, block_size, length, key_padding)

    def _blocks(self, sel: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token indices, their block indices) of a slice of T or of key indices."""
        idx = _indices(sel, self.length, self.counts.device)
        return idx, torch.div(idx, self.block_size, rounding_mode="floor")

    def _gather(self, table: torch.Tensor, q: slice, k: slice | torch.Tensor) -> torch.Tensor:
        """table (H, nb, nb) -> (H, tq, tk): each query's and key's block entry."""
        _, qb = self._blocks(q)
        _, kb = self._blocks(k)
        return table[:, qb[:, None], kb[None, :]]

    def block(self, q: slice, k: slice | torch.Tensor, padding: bool = True) -> torch.Tensor | None:
        """(B | 1, H, tq, tk) bool for queries `q` × keys `k` (a slice of S or key indices), True
        = may attend; None when every pair may (a run of rows over the keys it sees, unpadded)."""
        kidx, kb = self._blocks(k)
        real = None
        if padding and self.key_padding is not None:
            real = self.key_padding[:, kidx].bool()  # (B, tk)
            real = None if bool(real.all()) else real
        _, qb = self._blocks(q)
        if qb.numel() and bool(self.seen[:, qb.unique()][:, :, kb.unique()].all()) and real is None:
            return None
        allowed = self.seen[:, qb[:, None], kb[None, :]][None]  # (1, H, tq, tk)
        if real is not None:
            allowed = allowed & real[:, None, None, :]  # (B, H, tq, tk)
        return allowed

    def visible_keys(self, rows: slice) -> slice | torch.Tensor:
        """The keys some query of `rows` sees in some head (padding aside): a slice when they
        are contiguous, else their sorted indices; slice(None) when that is every key."""
        _, qb = self._blocks(rows)
        if qb.numel() == 0:
            return ALL
        seen = self.seen[:, qb.unique()].any(dim=(0, 1))  # (nb,) key blocks
        if bool(seen.all()):
            return ALL
        b = self.block_size
        blocks = seen.nonzero().flatten()  # (n_seen,) sorted
        idx = (blocks[:, None] * b + torch.arange(b, device=blocks.device)).flatten()
        idx = idx[idx < self.length]  # the last block may be short
        first, last = int(idx[0]), int(idx[-1])
        return slice(first, last + 1) if last - first + 1 == idx.numel() else idx

    def row_runs(self, rows: slice) -> list[slice]:
        """`rows` cut at block edges: each query block runs alone over the few key blocks it
        sees (a run of several would see the union of their windows and random blocks), and the
        two global blocks, which see every key, do not make their neighbours dense."""
        start, stop, _ = rows.indices(self.length)
        b, nb = self.block_size, self.counts.shape[1]
        run = b * RUN_BLOCKS
        inner = range((start // run + 1) * run, stop, run)
        cuts = sorted({start, stop, *inner} | {e for e in (b, (nb - 1) * b) if start < e < stop})
        return [slice(a, z) for a, z in itertools.pairwise(cuts) if z > a]

    def mask_mod(self):
        """block()'s rule for one (b, h, q, kv) index: the head's table at (q's block, kv's
        block), and key padding."""
        seen, size, real = self.seen, self.block_size, self.key_padding

        def mask_mod(b, h, q, kv):
            allowed = seen[h, q // size, kv // size]
            return allowed if real is None else allowed & real[b, kv]

        return mask_mod

    def block_tables(self, bq: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table pooled onto tiles of bq × bk tokens: a tile is `some` where one of
        the pattern's blocks it touches is seen, `every` where all are (then key padding):
        (B | 1, H, nq, nk). BigBird's sparsity stays (its blocks of 64 in tiles of 128: each
        tile touches 2 × 2 of them)."""
        nb = self.seen.shape[1]
        device, b, n = self.seen.device, self.block_size, self.length
        tokens = torch.arange(n, device=device) // b  # (n,) each token's pattern block

        def touches(size: int) -> torch.Tensor:  # (tiles, nb) float: tile i holds block a
            tiles = torch.arange(n, device=device) // size
            m = torch.zeros(-(-n // size), nb, device=device)
            return m.index_put_((tiles, tokens), torch.ones(n, device=device))

        tq, tk = touches(bq), touches(bk)  # (nq, nb), (nk, nb)
        hits = tq @ self.seen.float() @ tk.t()  # (H, nq, nk): seen (q-block, k-block) pairs
        pairs = tq.sum(dim=1)[:, None] * tk.sum(dim=1)[None, :]  # (nq, nk): all pairs touched
        some, every = (hits > 0)[None], (hits == pairs)[None]  # (1, H, nq, nk)
        if self.key_padding is not None:
            real_some, real_every = tile_any_all(self.key_padding.bool(), bk)  # (B, nk)
            some = some & real_some[:, None, None, :]
            every = every & real_every[:, None, None, :]
        return some, every

    def key_blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The structure a gathering kernel exploits (kernels/block_gather.py): for each head and
        middle query block 1 .. nb-2, the m distinct key blocks it sees, in block order, padded
        to the most any row sees: (index (H, nb-2, m) long, valid (H, nb-2, m) bool, log count
        (H, nb-2, m) float32). Query blocks 0 and nb-1 see every key."""
        nb = self.counts.shape[1]
        mid = self.seen[:, 1 : nb - 1]  # (H, nb - 2, nb)
        m = int(mid.sum(dim=-1).max()) if mid.numel() else 0
        order = torch.sort((~mid).to(torch.int8), dim=-1, stable=True).indices[..., :m]
        return order, mid.gather(-1, order), self.log_counts[:, 1 : nb - 1].gather(-1, order)

    def absorbs(self, bias: ScoreBias | None) -> bool:
        """Whether `key_blocks` already carries `bias`: none, or this mask's own key counts."""
        return bias is None or (isinstance(bias, KeyCountBias) and bias.mask is self)

    def bias(self) -> KeyCountBias | None:
        """log(count) where a key enters a softmax more than once; None when none does."""
        return KeyCountBias(self) if bool((self.counts > 1).any()) else None


@dataclass(frozen=True)
class KeyCountBias(ScoreBias):
    """log(count) on the scores: a key counted c times in a softmax weighs c·e^s (item 2)."""

    mask: BlockSparseMask

    def block(self, q: slice, k: slice | torch.Tensor) -> torch.Tensor:
        return self.mask._gather(self.mask.log_counts, q, k)[None]  # (1, H, tq, tk)

    def score_mod(self):
        table, size = self.mask.log_counts, self.mask.block_size  # (H, nb, nb)

        def score_mod(score, b, h, q, kv):
            return score + table[h, q // size, kv // size]

        return score_mod


@dataclass(frozen=True)
class SumBias(ScoreBias):
    """Two score biases added (a positional scheme's and the key counts)."""

    first: ScoreBias
    second: ScoreBias

    def block(self, q: slice, k: slice | torch.Tensor) -> torch.Tensor:
        return self.first.block(q, k) + self.second.block(q, k)

    def score_mod(self):
        first, second = self.first.score_mod(), self.second.score_mod()
        if first is None or second is None:
            return None
        return lambda score, b, h, q, kv: second(first(score, b, h, q, kv), b, h, q, kv)


# --- the layer ----------------------------------------------------------------------------------


@ATTENTIONS.register("block-sparse")
class BlockSparseAttention(Attention):
    """Softmax attention under BigBird's block-sparse pattern; the projections are
    `Attention`'s (q_proj, k_proj, v_proj, o_proj), so BERT-style weights map one to one.
    Bidirectional self-attention over a whole sequence only: no memory, no cache."""

    fusable = False  # its own forward; transformers' BigBird has no fused form to match

    def __init__(
        self,
        *,
        block_size: int = 64,
        num_random_blocks: int = 3,
        seed: int = 0,
        legacy_plan_len: int = 4096,
        layer_index: int = 0,
        **attention: Any,
    ) -> None:
        """Args: those of `Attention` (dropout: of the full-attention fallback only), and
        block_size: b, tokens per block.
        num_random_blocks: r, random key blocks per query block and head.
        seed: added to `layer_index` for the training-mode plan (transformers' seed is the
            layer index alone: seed 0).
        legacy_plan_len: transformers' max_position_embeddings, the length of the plan its
            training mode draws from when T is 1024, 3072 or 4096.
        layer_index: this layer's place in its stack (build.py passes it).
        """
        super().__init__(**attention)
        if block_size < 1 or num_random_blocks < 0:
            raise ValueError(
                f"block_size ({block_size}) must be >= 1 and num_random_blocks "
                f"({num_random_blocks}) >= 0"
            )
        self.block_size, self.num_random_blocks = block_size, num_random_blocks
        self.seed, self.legacy_plan_len = seed + layer_index, legacy_plan_len

    @property
    def min_sparse_len(self) -> int:
        """The shortest T that runs block-sparse: (5 + 2r)·b + 1 (module docstring, item 4)."""
        return (5 + 2 * self.num_random_blocks) * self.block_size + 1

    def pattern(self, T: int, key_padding: torch.Tensor | None, device) -> BlockSparseMask:
        """The mask description of one forward pass over T tokens."""
        nb = -(-T // self.block_size)
        rand = random_blocks(
            nb,
            self.block_size,
            self.num_random_blocks,
            self.n_heads,
            self.seed,
            self.training,
            self.legacy_plan_len,
        )
        return BlockSparseMask.bigbird(
            T, self.block_size, torch.from_numpy(rand).to(device), key_padding
        )

    def dropout_p(self, ctx: AttnContext) -> float:
        if isinstance(ctx.mask, BlockSparseMask):
            return 0.0  # transformers' block-sparse path has no attention dropout (item 3)
        return super().dropout_p(ctx)

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        memory: torch.Tensor | None = None,
        cache: LayerKV | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d_model) -> (B, T, d_model); full attention under ctx's mask for
        T < min_sparse_len, else the block-sparse pattern with ctx's key padding."""
        if memory is not None or cache is not None:
            raise ValueError(
                "block-sparse attention is bidirectional self-attention over a whole sequence "
                "(BigBird's encoder): it takes no memory and no cache; use attention.kind "
                "'softmax' for a decoder"
            )
        if ctx.mask is not None and ctx.mask.causal:
            raise ValueError(
                "block-sparse attention is bidirectional: the stack must not be causal"
            )
        n = x.shape[1]  # T
        if n < self.min_sparse_len:  # transformers' fallback to full attention
            return super().forward(x, ctx, need_weights=need_weights)
        padding = ctx.mask.key_padding if ctx.mask is not None else None
        mask = self.pattern(n, padding, x.device)
        bias, counts = as_bias(ctx.bias), mask.bias()
        if bias is not None and counts is not None:
            bias = SumBias(bias, counts)
        sparse = AttnContext(mask, bias if bias is not None else counts, ctx.rotation)
        return super().forward(x, sparse, need_weights=need_weights)
