"""Block-quantized weights: 4-bit and 8-bit blocks of 32 along K, as GGUF stores them, kept packed.

llama.cpp's files store a Linear weight W (N, K) in blocks of 32 consecutive inputs of one row
(ggml-quants.c; gguf-py `gguf/quants.py`), each with its own scale:

    Q4_0  w = d · (q − 8)     q ∈ [0, 15], d fp16            18 bytes per 32 weights
    Q4_1  w = d · q + m       q ∈ [0, 15], d, m fp16         20 bytes
    Q8_0  w = d · q           q ∈ [−127, 127], d fp16        34 bytes

`Int4Linear` holds any of the 4-bit kinds as w = d·q + m (Q4_0 is d' = d, m = −8d: exact in
fp32, d is an fp16 and q a 4-bit integer) and `BlockInt8Linear` holds Q8_0; both multiply through
the matvec kernels of src/attnlab/nn/matvec.py, which read the packed bytes, never a
dequantized matrix. They keep d and m in fp32 (24 and 36 bytes per 32 weights: 1.2× and 1.06×
the file's bytes), which the kernels read fastest.

Where the blocks come from: `pack_exact(model)` finds, for every Linear map and a tied token
table, whether its float weights *are* such blocks (a GGUF file's dequantized tensors are):
each block's scale is recovered from its extreme values (Q4_1's min has q = 0 and its max
q = 15; Q4_0's largest magnitude is −8d; Q8_0's is ±127d, as llama.cpp quantizes), rounded to
fp16, and the block is kept only if d·q + m reproduces every weight bit for bit. So a packed
model computes exactly its float model's weights (up to fp32 summation order in the matvec),
and a weight that is not such blocks stays float. A GGUF file also states its scales: `load_gguf(
packed=True)` hands them to `pack_exact` as `BlockScales` (per block of 32: Q4_0, Q4_1, Q5_0,
Q8_0 and the K-quant Q4_K, whose 8 sub-blocks of 32 per 256 have w = d·sc·q − dmin·mn, i.e.
d' = d·sc, m = −dmin·mn, both exact in fp32), so blocks a quantizer did not scale from their
extremes (Q4_K's 6-bit sub-scales, imatrix files) are found as well, and Q5_0 (w = d·q, q ∈
[−16, 15]) goes to the Q8_0 kind; the check is the same bit-for-bit one, so a stated scale only
proposes, it never decides. `al.quantize(model, "int4")` quantizes float
weights (the exact blocks where they are, else min/max 4-bit blocks with fp32 scales; a K that
is not a multiple of 32 is zero-padded).

`PackedEmbedding` is a token table kept as blocks: a lookup dequantizes only the looked-up rows,
and a tied output head multiplies by the same blocks (`lm_head`, `tied=True`), so a 4-bit or
8-bit table is stored once.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import matvec
from .weight_only import _WeightOnly

BLOCK = 32


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N, G, 32) fp32, K zero-padded to a multiple of 32."""
    w = w.float()
    pad = -w.shape[1] % BLOCK
    if pad:
        w = F.pad(w, (0, pad))
    return w.view(w.shape[0], -1, BLOCK)


def _q4_candidate(wg: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """q for given per-block d, m (N, G), and whether d·q + m reproduces each block exactly."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((wg - m[..., None]) / safe[..., None]).clamp(0, 15)
    exact = (q * d[..., None] + m[..., None] == wg).all(-1)
    return q, exact


# a block's key: its 32 fp32 bit patterns (as 0 ... 2^32 − 1) times fixed odd numbers below 2^25,
# summed in int64 (below 2^62: no overflow); equal blocks have equal keys, and a collision only
# proposes a wrong scale, which the bit-for-bit check then refuses
_MIX = torch.randint(0, 2**24, (BLOCK,), generator=torch.Generator().manual_seed(0)) * 2 + 1
_KEY_CHUNK = 1 << 16  # blocks keyed at a time: the int64 copy of a chunk is 16 MB


def _block_keys(wg: torch.Tensor) -> torch.Tensor:
    """(..., 32) fp32 blocks -> (...,) int64 keys (_MIX)."""
    flat = wg.reshape(-1, BLOCK)
    keys = torch.empty(flat.shape[0], dtype=torch.int64)
    for at in range(0, flat.shape[0], _KEY_CHUNK):
        bits = flat[at : at + _KEY_CHUNK].contiguous().view(torch.int32).long() & 0xFFFFFFFF
        keys[at : at + _KEY_CHUNK] = (bits * _MIX).sum(-1)
    return keys.view(wg.shape[:-1])


class BlockScales:
    """The scales a GGUF file stores, per block of 32 weights, for `pack_exact` to propose (the
    module docstring): kind "q4" (w = d·q + m, q ∈ [0, 15]: the pair (d, m)) or "q8" (w = d·q,
    q ∈ [−127, 127]: the pair (d of elements 0-15, d of 16-31), equal but for Q6_K's scales per
    16), found again by the blocks' values, so any reordering of rows (llama.cpp's Q/K
    permutation, fused projections, stacked experts) keeps them."""

    def __init__(self) -> None:
        self._parts: dict[str, list] = {"q4": [], "q8": []}
        self._tables: dict[str, tuple[torch.Tensor, ...]] = {}

    def add(
        self,
        kind: Literal["q4", "q8"],
        values: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor | None = None,
    ) -> None:
        """values (..., K) fp32 as the file dequantizes them (K a multiple of 32); d, m: one per
        block of 32 in memory order (for "q8" m is the second half's d; omitted: d's)."""
        if kind not in self._parts:
            raise ValueError(f"BlockScales kind must be 'q4' or 'q8', not {kind!r}")
        if values.shape[-1] % BLOCK:
            raise ValueError(
                f"BlockScales.add: rows of {values.shape[-1]} values, not blocks of 32"
            )
        keys = _block_keys(values.reshape(-1, BLOCK))
        d = d.reshape(-1).float()
        m = (torch.zeros_like(d) if kind == "q4" else d) if m is None else m.reshape(-1).float()
        if not keys.shape == d.shape == m.shape:
            raise ValueError(
                f"BlockScales.add: {keys.numel()} blocks of 32 values but {d.numel()} scales"
            )
        if kind in self._tables:  # a table built already goes back to the parts it joins
            self._parts[kind].append(self._tables.pop(kind))
        self._parts[kind].append((keys, d, m))

    def __len__(self) -> int:
        held = [*self._tables.values(), *(p for parts in self._parts.values() for p in parts)]
        return sum(keys.numel() for keys, _, _ in held)

    def lookup(
        self, kind: Literal["q4", "q8"], wg: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks wg (N, G, 32) -> the pair stated for each, as two (N, G) tensors; NaN where
        no scale is stated for a block."""
        if kind not in self._tables:
            parts = self._parts[kind]
            if not parts:
                nan = torch.full(wg.shape[:-1], float("nan"))
                return nan, nan
            keys, d, m = (torch.cat(x) for x in zip(*parts, strict=True))
            parts.clear()  # the table holds them now (a 7B model's are GBs)
            keys, order = keys.sort()
            self._tables[kind] = (keys, d[order], m[order])
        keys, d, m = self._tables[kind]
        want = _block_keys(wg)
        at = torch.searchsorted(keys, want).clamp(max=keys.numel() - 1)
        found = keys[at] == want
        nan = torch.tensor(float("nan"))
        return torch.where(found, d[at], nan), torch.where(found, m[at], nan)


def _all_exact(wg: torch.Tensor, candidates, fit):
    """`_first_exact` where every block of wg is reproduced, else None. The first row goes
    first: a map of another kind fails there, before its whole check (a 4-bit check of an 8-bit
    map had been most of loading a K-quant file packed)."""
    if not bool(_first_exact(wg[:1], candidates, fit)[3].all()):
        return None
    q, d, m, ok = _first_exact(wg, candidates, fit)
    return (q, d, m) if bool(ok.all()) else None


def _first_exact(wg: torch.Tensor, candidates, fit):
    """Each block of wg (N, G, 32) under the first of `candidates` (callables wg -> per-block
    d, m (N, G)) whose `fit` (-> q, exact) reproduces it bit for bit: (q, d, m, exact)."""
    q = d = m = ok = None
    for candidate in candidates:
        if ok is not None and bool(ok.all()):
            break
        dc, mc = candidate(wg)
        qc, okc = fit(wg, dc, mc)
        if ok is None:
            q, d, m, ok = qc, dc, mc, okc
            continue
        new = okc & ~ok
        q = torch.where(new[..., None], qc, q)
        d, m, ok = torch.where(new, dc, d), torch.where(new, mc, m), ok | okc
    return q, d, m, ok


def exact_q4(
    w: torch.Tensor, scales: BlockScales | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """W (N, K) as 4-bit blocks (q (N, G, 32) uint8, d, m (N, G) fp32) reproducing it bit for
    bit (Q4_1's or Q4_0's scales, recovered as the module docstring says, else those `scales`
    states), or None."""
    if w.shape[1] % BLOCK:
        return None

    def q4_1(wg):  # the min has q = 0, the max q = 15
        lo, hi = wg.amin(-1), wg.amax(-1)
        return ((hi - lo) / 15).half().float(), lo

    def q4_0(wg):  # the largest magnitude is q = 0
        v = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))[..., 0]
        d = (v / -8).half().float()
        return d, -8 * d

    candidates = [q4_1, q4_0] + ([lambda wg: scales.lookup("q4", wg)] if scales else [])
    found = _all_exact(_blocks(w), candidates, _q4_candidate)
    return None if found is None else (found[0].to(torch.uint8), *found[1:])


def exact_q8(
    w: torch.Tensor, scales: BlockScales | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """W (N, K) as 8-bit blocks (q (N, G, 32) int8, d fp32) reproducing it bit for bit, or None:
    d = max|w| / 127 per block (Q8_0), else the scales `scales` states (Q5_0's, w = d·q with
    q ∈ [−16, 15]; Q6_K's, one d per 16 with q ∈ [−32, 31]). d is (N, G), or (N, 2G) (the two
    halves' scales of each block in turn) when some block's halves differ."""
    if w.shape[1] % BLOCK:
        return None

    def largest(wg):  # the largest magnitude is ±127·d
        d = wg.abs().amax(-1) / 127
        return d, d

    candidates = [largest] + ([lambda wg: scales.lookup("q8", wg)] if scales else [])
    found = _all_exact(_blocks(w), candidates, _q8_candidate)
    if found is None:
        return None
    q, lo, hi = found
    d = lo if torch.equal(lo, hi) else torch.stack((lo, hi), -1).flatten(1)
    return q.to(torch.int8), d


def _q8_candidate(wg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """q for given per-block scales of each block's first and second 16 elements (N, G), and
    whether they reproduce each block exactly."""
    d = _halves(torch.stack((lo, hi), -1))
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(wg / safe).clamp(-127, 127)
    return q, (q * d == wg).all(-1)


def _halves(d: torch.Tensor) -> torch.Tensor:
    """Scales (..., G, 2), one per 16 elements, -> (..., G, 32), each repeated over its 16."""
    return d.repeat_interleave(BLOCK // 2, -1)


def quantize_q4(
    w: torch.Tensor, scales: BlockScales | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W (N, K) -> its exact 4-bit blocks if it has them (`exact_q4`), else min/max blocks:
    d = (max − min)/15, m = min, q = round((w − m)/d) (a padded column quantizes with its block
    and multiplies 0)."""
    found = exact_q4(w, scales)
    if found is not None:
        return found
    wg = _blocks(w)
    lo, hi = wg.amin(-1), wg.amax(-1)
    d = (hi - lo) / 15
    q, _ = _q4_candidate(wg, d, lo)
    return q.to(torch.uint8), torch.where(d == 0, torch.ones_like(d), d), lo


def _fp32_cpu(*scales: torch.Tensor) -> bool:
    """Whether the kernels can read these scales (a model cast with .half() / .to("cuda") cannot:
    it takes torch's path, the dequantized matmul)."""
    return all(s.dtype == torch.float32 and s.device.type == "cpu" for s in scales)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q (N, G, 32) in [0, 15] -> (N, G, 16) uint8: element j low, element j + 16 high (GGUF's
    Q4_0/Q4_1 byte order)."""
    return q[..., :16] | (q[..., 16:] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    return torch.cat((p & 15, p >> 4), -1)  # (N, G, 16) -> (N, G, 32)


class _Blocks(_WeightOnly):
    """The shared part of the block kinds: their kernels (`mv`, `dequant`: names in
    src/attnlab/nn/csrc/matvec.cpp), the tensors those read (`blocks()`: the packed weights, then
    the fp32 scales) and torch's formula for the same values (`_values`)."""

    mv: str
    mv_x8: str  # the same product with int8 activation blocks (`int8_activations`)
    mm: str  # more rows: tiles of W dequantized in cache, each times x by torch's GEMM
    dequant: str
    activations = "fp32"  # or "int8": set by `int8_activations`

    def blocks(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError  # each kind names its tensors

    def _values(self, sel) -> torch.Tensor:
        raise NotImplementedError  # each kind's formula: blocks[sel] -> (..., G, 32) floats

    def own_scales(self) -> BlockScales | None:
        """The blocks held now, as stated scales: loading this module's own state dict finds
        them again (Q4_K's, Q5_0's and Q6_K's blocks, which their values alone do not reveal)."""
        raise NotImplementedError  # each kind states its scales

    def dequantized(self) -> torch.Tensor:
        b = self.blocks()
        w = matvec.run(self.dequant, *b) if _fp32_cpu(*b[1:]) else None
        if w is None:
            w = self._values(slice(None)).flatten(1)
        return w[:, : self.in_features]  # (N, K)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W dequantized: (...,) -> (..., K)."""
        return self._values(ids).flatten(-2)[..., : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.blocks()
        if matvec.fp32_rows(x, self.in_features) and _fp32_cpu(*b[1:]):
            xs = matvec.pad_to(matvec.rows_of(x), b[0].shape[1] * BLOCK)
            if xs.shape[0] <= matvec.MAX_ROWS:
                kernel = self.mv_x8 if self.activations == "int8" else self.mv
            else:  # a batched decode step, a prefill: compute-bound, torch's GEMM per tile
                kernel = self.mm
            y = matvec.run(kernel, xs, *b)
            if y is not None:
                return self._finish(y.view(*x.shape[:-1], self.out_features))
        if not matvec.available():
            return self._dense_fallback(x)
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)


class Int4Linear(_Blocks):
    """y = x · Wᵀ + b with W in 4-bit blocks of 32: w = d·q + m (the module docstring)."""

    mv, mv_x8, mm, dequant = "mv_q4", "mv_q4_x8", "mm_q4", "dequant_q4"

    def store(self, w: torch.Tensor) -> None:
        q, d, m = quantize_q4(w, self.own_scales())
        self.set_blocks(q, d, m)

    def own_scales(self) -> BlockScales | None:
        if "d" not in self._buffers:
            return None
        scales = BlockScales()
        scales.add("q4", self._values(slice(None)).flatten(1), self.d, self.m)
        return scales

    def set_blocks(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        self.__dict__.pop("_dense", None)  # a fallback copy of the old weights
        self.register_buffer("packed", pack_nibbles(q).contiguous())  # (N, G, 16) uint8
        self.register_buffer("d", d.float().contiguous())  # (N, G)
        self.register_buffer("m", m.float().contiguous())

    def blocks(self) -> tuple[torch.Tensor, ...]:
        return self.packed, self.d, self.m

    def _values(self, sel) -> torch.Tensor:
        q = unpack_nibbles(self.packed[sel]).float()  # (..., G, 32)
        return q * self.d[sel][..., None] + self.m[sel][..., None]


class BlockInt8Linear(_Blocks):
    """y = x · Wᵀ + b with W in 8-bit blocks of 32: w = d·q, one d per block (Q8_0, Q5_0) or one
    per 16 elements (Q6_K: d (N, 2G))."""

    mv, mv_x8, mm, dequant = "mv_q8", "mv_q8_x8", "mm_q8", "dequant_q8"

    def store(self, w: torch.Tensor) -> None:
        found = exact_q8(w, self.own_scales())
        if found is None:
            raise ValueError(
                "BlockInt8Linear keeps weights that already are 8-bit blocks (a GGUF file's "
                "Q8_0 / Q5_0 / Q6_K, or the blocks it holds); these are not: load them into a "
                "float model and quantize it with al.quantize(model, 'int8') instead"
            )
        self.set_blocks(*found)

    def own_scales(self) -> BlockScales | None:
        if "d" not in self._buffers:
            return None
        d = self.d.view(self.d.shape[0], self.qweight.shape[1], -1)  # (N, G, 1 or 2)
        scales = BlockScales()
        scales.add("q8", self._values(slice(None)).flatten(1), d[..., 0], d[..., -1])
        return scales

    def set_blocks(self, q: torch.Tensor, d: torch.Tensor) -> None:
        self.__dict__.pop("_dense", None)
        self.register_buffer("qweight", q.contiguous())  # (N, G, 32) int8
        self.register_buffer("d", d.float().contiguous())  # (N, G), or (N, 2G): a scale per 16

    def blocks(self) -> tuple[torch.Tensor, ...]:
        return self.qweight, self.d

    def _values(self, sel) -> torch.Tensor:
        q, d = self.qweight[sel].float(), self.d[sel]
        if d.shape[-1] == q.shape[-2]:
            return q * d[..., None]
        return q * _halves(d.unflatten(-1, (-1, 2)))


def int8_activations(model: nn.Module, on: bool = True) -> nn.Module:
    """Multiply the block-quantized maps of `model` (4-bit and 8-bit, a packed token table's head
    included) with int8 activations, as llama.cpp does: a decode step's x is quantized per block
    of 32 (x ≈ dx·xq, dx = max|x|/127, round half to even; the 4-bit m term keeps x's exact block
    sums) and each block's product is an integer one (src/attnlab/nn/csrc/rows.h: VNNI or AVX2's
    u8×s8 sums), ~1.5x faster than widening every weight to fp32. The values are no longer the
    dequantized model's exactly: each product carries x's rounding, |Δx| ≤ dx/2 per element
    (tests/nn/test_quant_blocks.py checks the kernels against that formula in float64;
    benchmarks/cpu_decode.py reports tokens and perplexity against fp32). Prefills (more than
    `matvec.MAX_ROWS` rows) keep fp32 activations. `on=False` switches back."""
    for module in model.modules():
        if isinstance(module, _Blocks):
            module.activations = "int8" if on else "fp32"
    return model


class PackedEmbedding(nn.Module):
    """A token table kept as blocks (`table`, an Int4Linear or BlockInt8Linear of shape (V, D)):
    a lookup dequantizes the rows it reads. `state_dict()` gives the dequantized table as
    `weight`, as nn.Embedding's."""

    def __init__(self, table: _WeightOnly, padding_idx: int | None = None) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self.padding_idx = padding_idx
        self.float_dtype = table.float_dtype

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (V, D): a copy, made on every access."""
        return self.table.dequantized().to(self.float_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids).to(self.float_dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        shape = (self.num_embeddings, self.embedding_dim)
        if tuple(state_dict[key].shape) != shape:
            errors.append(
                f"size mismatch for {key}: {tuple(state_dict[key].shape)} in the state dict, "
                f"{shape} in the model"
            )
            return
        try:
            with torch.no_grad():
                self.table.store(state_dict[key].to(self.float_dtype))
        except ValueError as err:  # a Q8_0 table given weights that are not Q8_0 blocks
            errors.append(f"{key}: {err}")
        for k in list(state_dict):
            if k.startswith(prefix + "table."):
                unexpected_keys.append(k)


def _block_kind(w: torch.Tensor, scales: BlockScales | None = None):
    """The block module that holds W exactly: Int4Linear, BlockInt8Linear, or None."""
    q4 = exact_q4(w, scales)
    if q4 is not None:
        return Int4Linear, q4
    q8 = exact_q8(w, scales)
    if q8 is not None:
        return BlockInt8Linear, q8
    return None, None


def same_block_kind(scales: BlockScales | None = None):
    """For `fuse(model, alike=...)`: whether a group of weights ([q, k, v] or [gate, up]) would
    be held by one kind (all 4-bit blocks, all 8-bit blocks, or all float), so fusing them keeps
    them packed."""

    def kind(w: torch.Tensor) -> str:
        if exact_q4(w, scales) is not None:
            return "q4"
        return "q8" if exact_q8(w, scales) is not None else "float"

    return lambda weights: len({kind(w) for w in weights}) == 1


def _packed(
    lin: nn.Linear, tied: bool = False, scales: BlockScales | None = None
) -> _WeightOnly | None:
    kind, blocks = _block_kind(lin.weight.detach(), scales)
    if kind is None:
        return None
    mod = kind.__new__(kind)
    mod.take_shape(lin, tied)  # _WeightOnly.__init__ without quantizing: the blocks are found
    mod.set_blocks(*blocks)
    return mod


def pack_exact(model: nn.Module, scales: BlockScales | None = None) -> dict[str, int]:
    """Keep every Linear map (routers aside) and a decoder's tied token table whose float weights
    are exactly GGUF-style 4-bit or 8-bit blocks as those blocks, in place (the module docstring);
    `scales`: the blocks' scales as a GGUF file states them (`load_gguf(packed=True)` passes
    them). Returns how many maps went to each kind ("Int4Linear", "BlockInt8Linear", "float")."""
    from .model import DecoderOnlyModel

    counts = {"Int4Linear": 0, "BlockInt8Linear": 0, "float": 0}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or name == "router":
                continue
            mod = _packed(child, scales=scales)
            counts[type(mod).__name__ if mod is not None else "float"] += 1
            if mod is not None:
                setattr(parent, name, mod)
    emb = getattr(model, "embed_tokens", None)
    if (
        isinstance(model, DecoderOnlyModel)
        and isinstance(emb, nn.Embedding)
        and model.lm_head is None
        and model.logit_scale == 1.0
    ):
        w = emb.weight.detach()
        shell = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        shell.weight = nn.Parameter(w, requires_grad=False)
        table = _packed(shell, tied=True, scales=scales)
        if table is not None:
            model.embed_tokens = PackedEmbedding(table, emb.padding_idx)
            model.lm_head = table  # the same blocks: tied, no state dict entry of its own
            counts[type(table).__name__] += 1
    return counts
