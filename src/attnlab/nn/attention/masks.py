"""Masks as descriptions, not tensors.

A `MaskSpec` says which keys each query may see, in terms of explicit positions: causal
(k <= q), a sliding window (q - k < window, or |q - k| < window without causality), key padding,
global tokens, and — because q and k positions are explicit — the query offset of decoding with a
cache. A kernel can exploit the structure (sdpa's `is_causal` fast path when the mask is plain
causal); the naive kernel materialises it with `dense()`.

Global tokens (Longformer, Beltagy et al. 2020, arXiv:2004.05150, section 3.1, figure 2d): a
global query row sees every key, and every query sees a global key, on top of the window. They
are two flags, `q_global` (B, T) and `k_global` (B, S) — the same tokens in self-attention — and
only mean something for a bidirectional window (without a window every key is seen anyway; with
causality "every query sees a global key" would look ahead, so that is refused). Key padding
still wins: a padded key is never seen, global or not.

    window w, globals g:    allowed(q, k) = (|q - k| < w  or  q in g  or  k in g)  and  k real

transformers' `attention_window` W is the full width of Longformer's window, |q - k| <= W / 2,
which is `window` = W / 2 + 1 here (config/attention.py, `LongformerAttentionConfig.sliding_window`).

Blocked kernels stay sparse with globals: `visible_keys` of a block of local rows is the window's
range plus the global keys (sorted indices), and `row_runs` cuts a block of rows around the
global ones, so the few rows that see everything run as their own small blocks instead of making
a whole block dense.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import ClassVar

import torch

ALL = slice(None)
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def tile_bounds(positions: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n) positions -> (lowest, highest) of each tile of `size`, (B, ceil(n / size)) each;
    a short last tile is padded with its last position (the tile's own bounds stay)."""
    B, n = positions.shape
    pad = -n % size
    if pad:
        positions = torch.cat((positions, positions[:, -1:].expand(B, pad)), dim=1)
    tiles = positions.view(B, -1, size)  # (B, n / size, size)
    return tiles.amin(dim=-1), tiles.amax(dim=-1)


def repeat_last(positions: torch.Tensor, B: int, n: int) -> torch.Tensor:
    """(B0, m) positions -> (B, n), B ≥ B0, n ≥ m: the last column, then the last row, repeated
    (a padded pass's positions)."""
    t = torch.cat((positions, positions[:, -1:].expand(-1, n - positions.shape[1])), dim=1)
    return torch.cat((t, t[-1:].expand(B - t.shape[0], -1)), dim=0)


def tile_any_all(flags: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n) bool -> whether some / every entry of each tile of `size` is True, (B, tiles)."""
    B, n = flags.shape
    pad = -n % size
    tiles = torch.nn.functional.pad(flags, (0, pad)).view(B, -1, size)
    some = tiles.any(dim=-1)
    every = torch.nn.functional.pad(flags, (0, pad), value=True).view(B, -1, size).all(dim=-1)
    return some, every


@dataclass(frozen=True, kw_only=True)
class MaskCaps:
    """The structure a kind of mask description lays open to kernels beyond `block`, by name
    (as `KernelCaps` for kernels, kernels/base.py): a kernel asks `mask.caps.offsets`, never
    whether a method happens to exist."""

    offsets: bool  # per-token positions and `offset_allowed(lo, hi)` (kernels/offsets.py)
    key_blocks: bool  # `key_blocks()` and `absorbs(bias)`: keys listed per query block
    # (BigBird's BlockSparseMask, kernels/block_gather.py)
    pointwise: bool = False  # `mask_mod()` and `block_tables()` (FlexAttention, kernels/flex.py)


class MaskDescription:
    """What every kernel may ask of any mask description, with the answers that are safe when a
    kind knows no better: nothing causal, no window, no key padding, one plane for every head,
    and "a row may see no key", so blocked kernels check each block. A kind overrides what it
    knows (`MaskSpec` below, `BlockSparseMask` in block_sparse.py) and declares in `caps` which
    further structure it offers."""

    caps: ClassVar[MaskCaps] = MaskCaps(offsets=False, key_blocks=False)
    causal: bool = False
    window: int | None = None
    key_padding: torch.Tensor | None = None  # (B, S) bool, True = real token
    q_global: torch.Tensor | None = None  # (B, T) bool: global queries (Longformer), or none
    k_global: torch.Tensor | None = None  # (B, S) bool: global keys
    is_empty: bool = False  # every query sees every key
    is_plain_causal: bool = False  # the lower triangle of a square, unpadded, uncached sequence
    is_structured: bool = True  # keys limited by position or layout, beyond padding
    every_row_sees_a_key: bool = False  # known without evaluating a block (False: unknown)
    planes: int = 1  # mask planes of a block: 1 for every head, or H when it differs by head
    # what kernels derive from the description once per forward pass and every layer reuses
    # (flex's BlockMask, its padded copy): a description is made anew each pass (nn/stack.py),
    # so this is the pass's attention metadata, carried with the call (vLLM's per-batch
    # metadata), never a module-level table keyed by id(); each kind gives it a fresh dict
    memo: dict

    def padded(self, B: int, T: int, S: int) -> MaskDescription | None:
        """The same mask over B ≥ B0 rows, T ≥ T0 queries × S ≥ S0 keys: keys past S0 never
        seen, queries past T0 as the last one, rows past B0 seeing no key (the caller drops
        what is past B0 and T0); None when the kind cannot say (a kernel then runs at the
        exact shape: kernels/flex_buckets.py)."""
        return None

    def block(self, q: slice, k: slice | torch.Tensor, padding: bool = True) -> torch.Tensor | None:
        """(B | 1, planes, tq, tk) bool for queries `q` × keys `k` (a slice of S, or key
        indices), True = may attend; None when nothing is masked."""
        raise NotImplementedError(f"{type(self).__name__} must define block()")

    def dense(self) -> torch.Tensor | None:
        """(B | 1, planes, T, S) bool, the whole mask; None when nothing is masked. For the naive
        kernel, and sdpa on calls of at most DENSE_ROWS query rows (kernels/base.py)."""
        return self.block(ALL, ALL)

    def visible_keys(self, rows: slice) -> slice | torch.Tensor:
        """Keys some query of `rows` may see (padding aside): a slice, or sorted key indices;
        slice(None) when that is every key, the safe answer."""
        return ALL

    def row_runs(self, rows: slice) -> list[slice]:
        """`rows` cut into runs that a blocked kernel should run as blocks of their own."""
        return [rows]

    def mask_mod(self) -> MaskMod | None:
        """The mask as FlexAttention's `mask_mod(b, h, q_idx, kv_idx) -> bool` (pointwise, from
        the description's own tensors: kernels/flex.py); None when this kind is not pointwise."""
        return None

    def block_tables(self, bq: int, bk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(some, every): (B | 1, planes, ceil(T / bq), ceil(S / bk)) bool, whether some /
        every (query, key) pair of a tile of bq queries × bk keys may attend — a superset and a
        subset of the truth, from the structure alone (kernels/flex.py makes its BlockMask of
        them: tiles in neither are skipped, tiles in `every` run without mask_mod); None when
        the kind cannot say."""
        return None


@dataclass(frozen=True)
class MaskSpec(MaskDescription):
    caps: ClassVar[MaskCaps] = MaskCaps(offsets=True, key_blocks=False, pointwise=True)

    q_positions: torch.Tensor  # (B, T) position of each query
    k_positions: torch.Tensor  # (B, S) position of each key
    causal: bool = False
    window: int | None = None
    key_padding: torch.Tensor | None = None  # (B, S) bool, True = real token
    aligned: bool = False  # q and k positions are both 0..T-1 in every row (no cache, no offset)
    q_global: torch.Tensor | None = None  # (B, T) bool, True = a global query: sees every key
    k_global: torch.Tensor | None = None  # (B, S) bool, True = a global key: every query sees it
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.causal and (self.q_global is not None or self.k_global is not None):
            raise ValueError(
                "global tokens need a bidirectional mask (causal is True): every query seeing a "
                "global key would look ahead; drop global_attention_mask or use an encoder"
            )

    @property
    def is_plain_causal(self) -> bool:
        """Exactly the lower-triangular mask of a square, unpadded, uncached sequence."""
        return self.causal and self.aligned and self.window is None and self.key_padding is None

    @property
    def is_empty(self) -> bool:
        """Every query sees every key (global tokens add nothing without a window)."""
        return not self.causal and self.window is None and self.key_padding is None

    @property
    def every_row_sees_a_key(self) -> bool:
        """Known without evaluating a block: square and unpadded, each query sees its own key
        (causal, window and global tokens all allow the diagonal)."""
        return self.aligned and self.key_padding is None

    @property
    def is_structured(self) -> bool:
        """Whether the mask limits keys by position (causal or window), beyond padding."""
        return self.causal or self.window is not None

    def block(self, q: slice, k: slice | torch.Tensor, padding: bool = True) -> torch.Tensor | None:
        """(B, 1, tq, tk) bool for queries `q` (a slice of T) × keys `k` (a slice of S, or key
        indices), True = may attend; None when nothing is masked. `padding` False leaves key
        padding out (the positional part alone, which decides what keys a block can skip)."""
        if self.is_empty or (not padding and not self.is_structured):
            return None
        qp = self.q_positions[:, q, None]  # (B, T) -> (B, tq, 1)
        kp = self.k_positions[:, None, k]  # (B, S) -> (B, 1, tk)
        allowed = None  # (B, tq, tk) by broadcasting, from the first rule that applies
        if self.causal:
            allowed = kp <= qp
        if self.window is not None:
            dist = qp - kp if self.causal else (qp - kp).abs()  # (B, tq, tk)
            near = dist < self.window
            allowed = near if allowed is None else allowed & near
        if allowed is None:  # key padding alone
            shape = (qp.shape[0], qp.shape[1], kp.shape[2])
            allowed = torch.ones(shape, dtype=torch.bool, device=qp.device)
        if self.q_global is not None:
            allowed = allowed | self.q_global[:, q, None].bool()  # (B, tq, 1): the whole row
        if self.k_global is not None:
            allowed = allowed | self.k_global[:, None, k].bool()  # (B, 1, tk): the whole column
        if padding and self.key_padding is not None:
            allowed = allowed & self.key_padding[:, None, k].bool()  # (B, tk) -> (B, 1, tk)
        return allowed[:, None]  # (B, tq, tk) -> (B, 1, tq, tk): one mask for every head

    def mask_mod(self) -> MaskMod | None:
        """block()'s rule for one (b, h, q, kv) index, for FlexAttention; None when nothing is
        masked."""
        if self.is_empty:
            return None
        qpos, kpos, causal, window = self.q_positions, self.k_positions, self.causal, self.window
        real, q_global, k_global = self.key_padding, self.q_global, self.k_global

        def mask_mod(b, h, q, kv):
            qp, kp = qpos[b, q], kpos[b, kv]
            allowed = kp == kp  # True, as a tensor of the index's shape
            if causal:
                allowed = kp <= qp
            if window is not None:
                dist = qp - kp if causal else (qp - kp).abs()
                allowed = allowed & (dist < window)
            if q_global is not None:
                allowed = allowed | q_global[b, q]
            if k_global is not None:
                allowed = allowed | k_global[b, kv]
            if real is not None:
                allowed = allowed & real[b, kv]
            return allowed

        return mask_mod

    def block_tables(self, bq: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """From each tile's lowest and highest query and key position (so exact in `every` and
        a superset in `some` whatever the positions), key padding per key tile, and global
        tokens, which make their tiles partial."""
        q_lo, q_hi = (t[:, :, None] for t in tile_bounds(self.q_positions, bq))  # (B, nq, 1)
        k_lo, k_hi = (t[:, None, :] for t in tile_bounds(self.k_positions, bk))  # (B, 1, nk)
        some = torch.ones(q_lo.shape[0], q_lo.shape[1], k_lo.shape[2], dtype=torch.bool,
                          device=q_lo.device)  # fmt: skip
        every = some.clone()
        if self.causal:
            some, every = some & (k_lo <= q_hi), every & (k_hi <= q_lo)
        if self.window is not None:
            w = self.window
            if self.causal:  # 0 <= q - k < w
                some, every = some & (q_lo - k_hi < w), every & (q_hi - k_lo < w)
            else:  # |q - k| < w
                some = some & (q_lo - k_hi < w) & (k_lo - q_hi < w)
                every = every & (q_hi - k_lo < w) & (k_hi - q_lo < w)
        if self.q_global is not None:  # a global query row sees every key: partial tiles
            g, _ = tile_any_all(self.q_global.bool(), bq)
            some = some | g[:, :, None]
        if self.k_global is not None:
            g, _ = tile_any_all(self.k_global.bool(), bk)
            some = some | g[:, None, :]
        if self.key_padding is not None:
            real_some, real_every = tile_any_all(self.key_padding.bool(), bk)  # (B, nk)
            some, every = some & real_some[:, None, :], every & real_every[:, None, :]
        return some[:, None], every[:, None]  # (B, 1, nq, nk): one plane for every head

    def padded(self, B: int, T: int, S: int) -> MaskSpec:
        """Positions repeat the last one (a padding query sees what the last query sees, so no
        real-row query is left without keys), padding keys and padding rows' keys are marked
        as padding."""
        B0, T0 = self.q_positions.shape
        S0 = self.k_positions.shape[1]
        real = self.key_padding
        if real is None:
            real = torch.ones(B0, S0, dtype=torch.bool, device=self.k_positions.device)
        pad = torch.nn.functional.pad
        return MaskSpec(
            repeat_last(self.q_positions, B, T),
            repeat_last(self.k_positions, B, S),
            self.causal,
            self.window,
            pad(real.bool(), (0, S - S0, 0, B - B0), value=False),
            q_global=None
            if self.q_global is None
            else pad(self.q_global.bool(), (0, T - T0, 0, B - B0)),
            k_global=None
            if self.k_global is None
            else pad(self.k_global.bool(), (0, S - S0, 0, B - B0)),
        )

    def offset_allowed(self, lo: int, hi: int) -> torch.Tensor | None:
        """(hi − lo + 1,) bool: whether a key at offset k − q in [lo, hi] may be seen, when the
        mask is a function of the offset alone (causal, window: no padding, no global tokens);
        None otherwise. With consecutive positions a block of it is a Toeplitz matrix (bias.py)."""
        if self.key_padding is not None or self.q_global is not None or self.k_global is not None:
            return None
        rel = torch.arange(lo, hi + 1, device=self.q_positions.device)  # (L,) offsets k − q
        allowed = torch.ones_like(rel, dtype=torch.bool)
        if self.causal:
            allowed = rel <= 0
        if self.window is not None:
            dist = -rel if self.causal else rel.abs()
            allowed = allowed & (dist < self.window)
        return allowed

    def visible_keys(self, rows: slice) -> slice | torch.Tensor:
        """Keys some query of `rows` may see by position (causal edge, window, global keys;
        padding aside), so that a blocked kernel can skip the rest: a slice when they are
        contiguous, else their sorted indices (a pattern with gaps); slice(None) when that is
        every key. Computed per key from the block's lowest and highest query position, in
        O(B·S) rather than O(B·rows·S): exact for consecutive positions (training, a cache), a
        superset otherwise — the kernels still apply `block()`, so a superset costs only time."""
        if not self.is_structured:
            return ALL
        if self.q_global is not None and bool(self.q_global[:, rows].any()):
            return ALL  # a global query row sees every key
        qp = self.q_positions[:, rows]  # (B, tq)
        lo, hi = qp.amin(dim=1, keepdim=True), qp.amax(dim=1, keepdim=True)  # (B, 1) each
        kp = self.k_positions  # (B, S)
        seen = torch.ones_like(kp, dtype=torch.bool)  # (B, S)
        if self.causal:
            seen = seen & (kp <= hi)
        if self.window is not None:
            seen = seen & (kp > lo - self.window)  # lo - k < window for the lowest query
            if not self.causal:
                seen = seen & (kp < hi + self.window)
        if self.k_global is not None:
            seen = seen | self.k_global.bool()
        idx = seen.any(dim=0).nonzero().flatten()  # (n_seen,) key indices, sorted
        n, S = idx.numel(), kp.shape[1]
        if n in (0, S):  # nothing seen (rows of padding) or everything: no skipping
            return ALL
        first, last = int(idx[0]), int(idx[-1])
        return slice(first, last + 1) if last - first + 1 == n else idx

    def row_runs(self, rows: slice) -> list[slice]:
        """`rows` cut into runs that are all global queries or all local ones (a row global in
        any batch row counts as global), so a blocked kernel gives the rows that see every key
        their own block and the local rows keep the window's sparse key set."""
        if self.q_global is None or not self.is_structured:
            return [rows]
        flags = self.q_global[:, rows].any(dim=0)  # (rows,) bool
        if not bool(flags.any()):
            return [rows]
        start = rows.start or 0
        cuts = (flags[1:] != flags[:-1]).nonzero().flatten() + 1  # where a run ends
        edges = [0, *cuts.tolist(), flags.numel()]
        return [slice(start + a, start + b) for a, b in pairwise(edges)]

    def local(self) -> MaskSpec:
        """The same mask with every query treated as local: the window and the global keys
        (Longformer's local rows; its global rows are computed apart, with their own
        projections, see nn/attention/longformer.py)."""
        return self if self.q_global is None else replace(self, q_global=None)

    def select_rows(self, rows: GlobalRows) -> MaskSpec:
        """The mask of the query rows `rows` gathers, (B, G) of them: the same keys, each slot
        keeping its row's position and global flag (an unused slot is a local row)."""
        q_global = None
        if self.q_global is not None:
            q_global = rows.gather(self.q_global) & rows.valid
        return replace(
            self, q_positions=rows.gather(self.q_positions), q_global=q_global, aligned=False
        )


@dataclass(frozen=True)
class GlobalRows:
    """The rows flagged in a (B, T) bool tensor, packed into (B, G) slots, G the most flags of
    any batch row: `gather` packs any (B, T, ...) tensor, `scatter` writes (B, G, ...) back."""

    batch: torch.Tensor  # (N,) batch index of each flagged row
    row: torch.Tensor  # (N,) its index in T
    slot: torch.Tensor  # (N,) its slot in G
    valid: torch.Tensor  # (B, G) bool: slots holding a flagged row
    width: int  # G

    @classmethod
    def of(cls, flags: torch.Tensor) -> GlobalRows:
        flags = flags.bool()  # (B, T)
        batch, row = flags.nonzero(as_tuple=True)  # (N,) each, row-major: slots in order
        slot = (flags.long().cumsum(dim=1) - 1)[batch, row]  # (N,) rank within its batch row
        width = int(flags.sum(dim=1).max()) if flags.numel() else 0
        valid = torch.arange(width, device=flags.device) < flags.sum(dim=1, keepdim=True)
        return cls(batch, row, slot, valid, width)  # valid: (G,) < (B, 1) -> (B, G)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (B, G, ...); unused slots are zero."""
        out = t.new_zeros(t.shape[0], self.width, *t.shape[2:])
        return out.index_put((self.batch, self.slot), t[self.batch, self.row])

    def scatter(self, into: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`into` (B, T, ...) with its flagged rows replaced by `values` (B, G, ...)."""
        return into.index_put((self.batch, self.row), values[self.batch, self.slot])
