"""The decode matvec kernels (src/attnlab/nn/matvec.py, csrc/matvec.cpp) against float64 references.

- every kernel ("mv_f32", "mv_int8", "mv_q4", "mv_q8"; the tiled GEMMs "mm_q4", "mm_q8" for M in
  {1, 9, 40}) for M in {1, 3, 8} rows and odd shapes (N
  from 1 to 300; K from 1 to 577 where a kernel takes any K, multiples of 32 for the blocks): the
  reference is plain torch in float64 on the documented weights (s ⊙ q; d·q + m per block of 32
  with the nibble layout decoded here, not by the module; d·q), the bound Higham's γ_n times the
  sum of the magnitudes of the terms the kernel adds (tests/helpers/tolerance.py), so it holds for
  every summation order (AVX-512, AVX2, plain loops, any thread split). Inputs hold a zero row of x,
  a zero row of weights, rows of magnitude 2^40 and 2^60, negative and zero scales, int8 -128,
  storage offsets; splitting rows over threads changes no bit.
- `dequant_q4` / `dequant_q8` (a prefill's whole-matrix dequantization) equal torch's fp32
  d·q + m / d·q bit for bit (what pack_exact's exactness is checked with).
- the 4-bit layout: blocks packed from known q by `pack_nibbles` (element j low nibble, j + 16
  high) give the kernel the values of the formula w = d·q + m.
- `linear`: F.linear within the bound for 1..8 rows (through the kernel: a spy on `run` says so),
  and exactly F.linear (torch's path) for 9 rows, float64, inputs that need a gradient (which
  flows), non-contiguous weights; the bias is added; KernelLinear is `linear`.
- `ATTNLAB_KERNELS=0`: available() and ready() False, run() None, linear exactly F.linear.
- `isa_flags` follows ATEN_CPU_CAPABILITY, and a subprocess under ATEN_CPU_CAPABILITY=avx2 builds
  the AVX2 variant on this machine and passes the same kernel checks (skipped without AVX2/FMA/F16C).
- bad arguments (dtype, non-contiguous, wrong K, wrong rank, wrong scale sizes) raise RuntimeError
  naming the kernel (TORCH_CHECK), for the matvecs and the dequantizations.

The tests that need the kernels skip where they cannot be built (no C++ compiler) or are off.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.nn import matvec
from attnlab.nn.quant_blocks import pack_nibbles
from helpers.tolerance import gamma

ROWS = (1, 3, 8)  # a decode step's rows: one request, a few, matvec.MAX_ROWS
NS = (1, 7, 33, 300)
BLOCK_KS = (32, 64, 96, 576)  # 576: SmolLM2-135M's d_model
ANY_KS = (1, 5, 31, 32, 33, 64, 96, 100, 576, 577)  # tails past each 64 / 32 / 8-lane chunk
# mv_q8h / mm_q8h: mv_q8 / mm_q8 with a scale per 16 elements (d (N, 2G): Q6_K's sub-blocks)
KERNELS = ("mv_f32", "mv_int8", "mv_q4", "mv_q8", "mm_q4", "mm_q8", "mv_q8h", "mm_q8h")
MM_ROWS = (1, 9, 40)  # the tiled GEMMs: one row, a batched decode step, more than a tile's width


@pytest.fixture(scope="module")
def built():
    """The kernels, built on first use (~30 s once per machine, then cached)."""
    if not matvec.ready():
        pytest.skip("the matvec kernels are off or cannot be built here (src/attnlab/nn/matvec.py)")


# --- references ----------------------------------------------------------------------------------


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    """(m, k) fp32 activations: row 1 all zero, row 2 of magnitude 2^60 (exact scalings, so the
    row's relative error is the other rows'), the rest standard normal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if m > 1:
        x[1] = 0
    if m > 2:
        x[2] *= 2.0**60
    return x


def _case(name: str, m: int, n: int, k: int, seed: int = 0):
    """(kernel args, float64 reference y (M, N), float64 Σ|terms| (M, N), n for γ_n).

    n: the longest chain of roundings one term goes through. mv_f32: its product and at most
    K − 1 additions (K). mv_int8: and the row's scale (K + 1). mv_q8: q·x, then ·d, then the sums;
    or, for several rows, d·q rounded once into a weight row, then mv_f32's dot (K + 1). mv_q4,
    one row: q·x, ·d and the sums, the final add of the m part, whose own terms go through Σ_j x
    (31 additions), ·m and G − 1 additions; several rows: d·q and + m rounded into a weight row,
    then the dot (K + 2 for both). The d·q and m parts are rounded separately, so Σ|terms| is
    |x| · (|d·q| + |m|)ᵀ, not |x| · |w|ᵀ."""
    g = torch.Generator().manual_seed(seed + 1000)
    x = _x(m, k, seed)
    x64 = x.double()
    if name == "mv_f32":
        w = torch.randn(n, k, generator=g)
        w[0] = 0  # a zero weight row
        if n > 2:
            w[2] *= 2.0**40
        w64 = w.double()
        return (x, w), x64 @ w64.T, x64.abs() @ w64.abs().T, k
    if name == "mv_int8":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.randn(n, generator=g)  # negative scales included
        if n > 1:
            s[1] = 0
        w64 = s.double()[:, None] * q.double()
        return (x, q, s), x64 @ w64.T, x64.abs() @ w64.abs().T, k + 1
    groups = k // 32
    d = torch.randn(n, groups, generator=g)  # negative steps included
    d[0, 0] = 0  # a block that is its offset alone
    if name.endswith(("q8", "q8h")):
        q = torch.randint(-128, 128, (n, groups, 32), generator=g, dtype=torch.int8)
        if name.endswith("h"):  # a scale per 16: element j of block b takes d[2b + j // 16]
            d = torch.randn(n, 2 * groups, generator=g)
            d[0, 1] = 0
            steps = d.double().view(n, groups, 2).repeat_interleave(16, -1)
        else:
            steps = d.double()[..., None]
        w64 = (steps * q.double()).flatten(1)
        return (x, q, d), x64 @ w64.T, x64.abs() @ w64.abs().T, k + 1
    q = torch.randint(0, 16, (n, groups, 32), generator=g, dtype=torch.uint8)
    mn = torch.randn(n, groups, generator=g)
    p = pack_nibbles(q).contiguous()
    dq = (d.double()[..., None] * q.double()).flatten(1)  # (N, K)
    w64 = dq + mn.double().repeat_interleave(32, dim=1)
    terms = dq.abs() + mn.double().abs().repeat_interleave(32, dim=1)
    return (x, p, d, mn), x64 @ w64.T, x64.abs() @ terms.T, k + 2


def _assert_bounded(y: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor, n: int, what: str):
    """|y − ref| <= (γ_n in fp32 + γ_n in fp64, the reference's own) · Σ|terms|, elementwise."""
    assert y.dtype == torch.float32 and y.shape == ref.shape, (what, y.dtype, y.shape)
    bound = (gamma(n, torch.float32) + gamma(n, torch.float64)) * terms
    err = (y.double() - ref).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} outside γ_{n}·Σ|terms|; worst "
        f"{float((err / bound.clamp(min=1e-300)).max()):.3g}× the bound"
    )


def check_kernels(names=KERNELS, rows=ROWS, ns=NS, block_ks=BLOCK_KS, any_ks=ANY_KS) -> int:
    """Every kernel in `names` over the shapes against its reference (also run by the AVX2
    subprocess below, so both builds pass the same oracle); returns how many cases ran."""
    cases = 0
    for name in names:
        ks = any_ks if name in ("mv_f32", "mv_int8") else block_ks
        for n in ns:
            for k in ks:
                for m in MM_ROWS if name.startswith("mm") else rows:
                    args, ref, terms, depth = _case(name, m, n, k, seed=m * 7 + n + k)
                    y = matvec.run(name.removesuffix("h"), *args)
                    _assert_bounded(y, ref, terms, depth, f"{name} {m, n, k}")
                    cases += 1
    return cases


# --- the kernels ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_matches_float64_reference_within_fp32_summation_bound(built, name):
    assert check_kernels([name]) == len(ROWS) * len(NS) * (
        len(ANY_KS) if name in ("mv_f32", "mv_int8") else len(BLOCK_KS)
    )


@pytest.mark.parametrize("name", KERNELS)
def test_zero_rows_give_exact_zeros_and_the_bound_is_not_vacuous(built, name):
    """A zero row of x (row 1) gives exactly 0 (the bound there is 0), and a wrong reference
    (the weights of another seed) is far outside the bound: the check can fail."""
    args, _, terms, n = _case(name, 3, 33, 96)
    y = matvec.run(name.removesuffix("h"), *args)
    assert torch.equal(y[1], torch.zeros(33))
    _, other, _, _ = _case(name, 3, 33, 96, seed=5)
    bound = gamma(n) * terms
    assert ((y.double() - other).abs() > bound)[0].float().mean() > 0.9


@pytest.mark.parametrize("name", KERNELS)
def test_threads_split_rows_without_changing_a_bit(built, name):
    """Rows of W are split over intra-op threads (at::parallel_for); each output element is
    still one row's sum in one order, so 4 threads give the 1-thread bits."""
    args, _, _, _ = _case(name, 3, 300, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = matvec.run(name.removesuffix("h"), *args)
        torch.set_num_threads(4)
        four = matvec.run(name.removesuffix("h"), *args)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, four)


def test_inputs_with_a_storage_offset_are_read_from_their_start(built):
    """Contiguous slices of larger tensors (x rows 2..4, w rows 3..9): data_ptr, not the storage."""
    big_x, big_w = torch.randn(6, 100), torch.randn(12, 100)
    x, w = big_x[2:5], big_w[3:10]
    assert x.storage_offset() and w.storage_offset() and x.is_contiguous()
    x64, w64 = x.double(), w.double()
    _assert_bounded(matvec.run("mv_f32", x, w), x64 @ w64.T, x64.abs() @ w64.abs().T, 100, "offset")


@pytest.mark.parametrize("rows", [1, 3])  # the one-row loop and the several-row path
def test_q4_nibble_layout_is_gguf_byte_order(built, rows):
    """One block, q_j = j for j < 16 and 31 − j after: byte j holds q_j (low nibble) and q_{j+16}
    (high), so the kernel's weights are d·q + m with q in that order; the other layout (high
    nibble first) gives other values, far outside the bound."""
    q = torch.cat((torch.arange(16), 15 - torch.arange(16))).to(torch.uint8).view(1, 1, 32)
    p = pack_nibbles(q).contiguous()
    assert p.shape == (1, 1, 16)
    assert [int(b) for b in p[0, 0, :2]] == [0 | (15 << 4), 1 | (14 << 4)]  # by hand: j, 15 − j
    d, mn = torch.tensor([[0.5]]), torch.tensor([[-3.0]])
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
    qd = q.double().view(1, 32)
    ref = x.double() @ (0.5 * qd - 3.0).T  # the documented formula, in float64
    terms = x.double().abs() @ (0.5 * qd + 3.0).T
    y = matvec.run("mv_q4", x, p, d, mn)
    _assert_bounded(y, ref, terms, 32 + 2, "q4 layout")
    swapped = torch.cat((qd[:, 16:], qd[:, :16]), -1) * 0.5 - 3.0
    assert ((y.double() - x.double() @ swapped.T).abs() > 1e-3).all()


def _blocks(n: int, groups: int, seed: int):
    """Random 4-bit and Q8_0 blocks: negative, zero and 2^30-sized steps, offsets of either sign."""
    g = torch.Generator().manual_seed(seed)
    q4 = torch.randint(0, 16, (n, groups, 32), generator=g, dtype=torch.uint8)
    q8 = torch.randint(-128, 128, (n, groups, 32), generator=g, dtype=torch.int8)
    d, mn = torch.randn(n, groups, generator=g), torch.randn(n, groups, generator=g)
    d[0, 0], d[-1, -1] = 0.0, 2.0**30
    return q4, q8, d, mn


@pytest.mark.parametrize("n, groups", [(1, 1), (7, 3), (33, 18), (300, 2)])
def test_dequant_kernels_are_torchs_fp32_formula_bit_for_bit(built, n, groups):
    """fp32 q·d, then + m, each rounded as torch rounds them (matvec.py builds with
    -ffp-contract=off: no fused multiply-add), so `Int4Linear.dequantized()` through the kernel
    reproduces a GGUF file's dequantized floats exactly (tests/nn/test_quant_blocks.py)."""
    q4, q8, d, mn = _blocks(n, groups, seed=n + groups)
    want4 = (q4.float() * d[..., None] + mn[..., None]).flatten(1)
    assert torch.equal(matvec.run("dequant_q4", pack_nibbles(q4).contiguous(), d, mn), want4)
    want8 = (q8.float() * d[..., None]).flatten(1)
    assert torch.equal(matvec.run("dequant_q8", q8, d), want8)
    halves = torch.cat((d, mn), 1)  # (N, 2G): a scale per 16 elements
    want = (q8.float() * halves.view(n, groups, 2).repeat_interleave(16, -1)).flatten(1)
    assert torch.equal(matvec.run("dequant_q8", q8, halves.contiguous()), want)


# --- linear --------------------------------------------------------------------------------------


@pytest.fixture
def spy(matvec_calls):
    """The kernel names `matvec.run` is called with, in order (tests/conftest.py)."""
    return matvec_calls


def _linear_args(shape: tuple[int, ...], n: int = 33, k: int = 100, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, k, generator=g, dtype=dtype)
    w = torch.randn(n, k, generator=g, dtype=dtype)
    b = torch.randn(n, generator=g, dtype=dtype)
    return x, w, b


@pytest.mark.parametrize("shape", [(), (1,), (2,), (3,), (5,), (8,), (2, 3), (1, 8), (2, 2, 2)])
def test_linear_takes_the_kernel_for_up_to_8_rows_and_adds_the_bias(built, spy, shape):
    x, w, b = _linear_args(shape)
    y = matvec.linear(x, w, b)
    assert spy == ["mv_f32"]
    assert y.shape == F.linear(x, w, b).shape
    x64 = x.double().reshape(-1, 100)
    ref = x64 @ w.double().T + b.double()
    terms = x64.abs() @ w.double().abs().T + b.double().abs()
    _assert_bounded(y.reshape(-1, 33), ref, terms, 100 + 1, "linear")  # + 1: the bias add
    _assert_bounded(matvec.linear(x, w).reshape(-1, 33), ref - b.double(), terms, 101, "no bias")


@pytest.mark.parametrize(
    "why, shape, dtype",
    [("9 rows", (9,), torch.float32), ("3x3 rows", (3, 3), torch.float32),
     ("float64", (2,), torch.float64)],
)  # fmt: skip
def test_linear_is_exactly_f_linear_outside_the_kernels_case(built, spy, why, shape, dtype):
    x, w, b = _linear_args(shape, dtype=dtype)
    assert torch.equal(matvec.linear(x, w, b), F.linear(x, w, b)), why
    assert spy == [], why


def test_linear_with_gradients_is_f_linear_and_the_gradient_flows(built, spy):
    x, w, b = _linear_args((2,))
    x.requires_grad_(True)
    y = matvec.linear(x, w, b)
    assert spy == [] and y.requires_grad
    assert torch.equal(y, F.linear(x, w, b))
    (g,) = torch.autograd.grad(y.square().sum(), x)
    (want,) = torch.autograd.grad(F.linear(x, w, b).square().sum(), x)
    assert torch.equal(g, want) and g.abs().sum() > 0
    # a weight that needs a gradient (an nn.Linear's parameter, grad enabled): torch's path too
    wp = torch.nn.Parameter(w.clone())
    y = matvec.linear(x.detach(), wp, b)
    assert spy == [] and y.requires_grad
    (gw,) = torch.autograd.grad(y.square().sum(), wp)
    (want,) = torch.autograd.grad(F.linear(x.detach(), wp, b).square().sum(), wp)
    assert torch.equal(gw, want) and gw.abs().sum() > 0
    with torch.no_grad():  # inference: the kernel, whatever requires_grad says
        matvec.linear(x, wp, b)
    assert spy == ["mv_f32"]


def test_linear_with_a_non_contiguous_weight_or_input(built, spy):
    x, w, b = _linear_args((3,))
    wt = w.T.contiguous().T  # the same values, not contiguous
    assert torch.equal(matvec.linear(x, wt, b), F.linear(x, wt, b)) and spy == []
    xt = x.T.contiguous().T  # a non-contiguous input is made contiguous for the kernel
    y = matvec.linear(xt, w, b)
    assert spy == ["mv_f32"]
    assert torch.equal(y, matvec.linear(x, w, b))


def test_kernel_linear_is_linear(built, spy):
    torch.manual_seed(0)
    lin = matvec.KernelLinear(100, 33)
    x = torch.randn(4, 100)
    with torch.no_grad():
        y = lin(x)
    assert spy == ["mv_f32"]
    assert torch.equal(y, matvec.linear(x, lin.weight.detach(), lin.bias.detach()))
    y = lin(x)  # grad enabled, a parameter that needs one: torch's path, differentiable
    assert y.requires_grad and torch.equal(y, F.linear(x, lin.weight, lin.bias))


def test_few_rows_is_the_decode_case():
    x = torch.randn(8, 16)
    assert matvec.few_rows(x, 16)
    assert not matvec.few_rows(torch.randn(9, 16), 16)
    assert not matvec.few_rows(torch.randn(0, 16), 16)  # nothing to multiply
    assert not matvec.few_rows(x, 17)  # K disagrees
    assert not matvec.few_rows(x.double(), 16)
    assert not matvec.few_rows(x.requires_grad_(True), 16)
    with torch.no_grad():
        assert matvec.few_rows(x, 16)


# --- switched off --------------------------------------------------------------------------------


def test_kernels_off_run_is_none_and_linear_is_exactly_f_linear(monkeypatch, spy):
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    assert not matvec.available() and not matvec.ready()
    x, w, b = _linear_args((3,))
    assert matvec.run("mv_f32", x, w) is None
    assert torch.equal(matvec.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(matvec.linear(x, w), F.linear(x, w))
    lin = matvec.KernelLinear(100, 33)
    with torch.no_grad():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    monkeypatch.setenv("ATTNLAB_KERNELS", "1")
    assert matvec.available()  # read at each call, not once


# --- builds --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cap, name",
    [("avx2", "avx2"), ("AVX2", "avx2"), ("default", "default"), ("avx512", "native"),
     ("", "native"), (None, "native")],
)  # fmt: skip
def test_isa_flags_follow_aten_cpu_capability(monkeypatch, cap, name):
    if cap is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)
    got, flags = matvec.isa_flags()
    assert got == name
    if name == "avx2":  # capped at AVX2: its instructions, nothing the CPU may add
        assert {"-mavx2", "-mfma"} <= set(flags) and not any("march" in f for f in flags)
    elif name == "default":  # the compiler's baseline
        assert flags == []
    else:
        assert flags == ["-march=native"]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(
        next(
            (ln.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("flags")), ""
        ).split()
    )


AVX2_SNIPPET = """
import sys, torch
sys.path[:0] = [{here!r}, {tests!r}]
torch.set_num_threads(1)
from attnlab.nn import matvec
import test_matvec as t
assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
assert matvec.isa_flags()[0] == "avx2" and matvec.ready()
assert matvec._ext().__name__.startswith("attnlab_matvec_avx2_"), matvec._ext().__name__
cases = t.check_kernels(rows=(1, 3), ns=(7, 33), block_ks=(32, 96, 576), any_ks=(5, 33, 100, 577))
print("ok", cases)
"""


@pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= _cpu_flags(), reason="this CPU has no AVX2 / FMA / F16C"
)
def test_avx2_build_passes_the_same_checks_in_a_subprocess(built):
    """ATEN_CPU_CAPABILITY=avx2 (how `make test` reruns the kernel tests) builds the AVX2-only
    variant (no AVX-512 code even on an AVX-512 CPU: its q4_row / i8_row / f32_row paths), ~30 s
    the first time, and it passes `check_kernels` on all eight kernels."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    env.pop("ATTNLAB_KERNELS", None)
    here = Path(__file__).parent
    code = AVX2_SNIPPET.format(here=str(here), tests=str(here.parent))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # 4 any-K for the 2 float kernels, 3 block K for mv_q4 / mv_q8 / mv_q8h, 2 N, 2 rows; the
    # 3 tiled GEMMs: 3 block K, 2 N, 3 rows
    assert done.stdout.split()[-2:] == [
        "ok",
        str(2 * (4 * 2 * 2) + 3 * (3 * 2 * 2) + 3 * (3 * 2 * len(MM_ROWS))),
    ]


# --- bad arguments -------------------------------------------------------------------------------


def _bad_calls():
    x = torch.randn(2, 64)
    w = torch.randn(5, 64)
    q8 = torch.zeros(5, 64, dtype=torch.int8)
    s = torch.ones(5)
    p = torch.zeros(5, 2, 16, dtype=torch.uint8)
    d = torch.ones(5, 2)
    qb = torch.zeros(5, 2, 32, dtype=torch.int8)
    return {
        "f32 x float64": ("mv_f32", x.double(), w),
        "f32 x non-contiguous": ("mv_f32", torch.randn(64, 2).T, w),
        "f32 x wrong K": ("mv_f32", torch.randn(2, 63), w),
        "f32 x 1-D": ("mv_f32", torch.randn(64), w),
        "f32 x 3-D": ("mv_f32", torch.randn(1, 2, 64), w),
        "f32 w int8": ("mv_f32", x, q8),
        "f32 w non-contiguous": ("mv_f32", x, torch.randn(64, 5).T),
        "int8 x wrong K": ("mv_int8", torch.randn(2, 65), q8, s),
        "int8 q float": ("mv_int8", x, w, s),
        "int8 s too short": ("mv_int8", x, q8, torch.ones(4)),
        "int8 s float64": ("mv_int8", x, q8, s.double()),
        "q4 x K not G*32": ("mv_q4", torch.randn(2, 40), p, d, d),
        "q4 x float64": ("mv_q4", x.double(), p, d, d),
        "q4 p int8": ("mv_q4", x, p.to(torch.int8), d, d),
        "q4 p not 16 bytes a block": ("mv_q4", x, torch.zeros(5, 2, 32, dtype=torch.uint8), d, d),
        "q4 d wrong size": ("mv_q4", x, p, torch.ones(5, 1), d),
        "q4 m float64": ("mv_q4", x, p, d, d.double()),
        "q8 x non-contiguous": ("mv_q8", torch.randn(64, 2).T, qb, d),
        "q8 q uint8": ("mv_q8", x, qb.to(torch.uint8), d),
        "q8 d wrong size": ("mv_q8", x, qb, torch.ones(5)),
        "mm_q4 x wrong K": ("mm_q4", torch.randn(9, 96), p, d, d),
        "mm_q4 m wrong size": ("mm_q4", x, p, d, torch.ones(5)),
        "mm_q8 x float64": ("mm_q8", x.double(), qb, d),
        "mm_q8 q uint8": ("mm_q8", x, qb.to(torch.uint8), d),
        "dequant_q4 p int8": ("dequant_q4", p.to(torch.int8), d, d),
        "dequant_q4 m wrong size": ("dequant_q4", p, d, torch.ones(5)),
        "dequant_q4 d float64": ("dequant_q4", p, d.double(), d),
        "dequant_q8 q non-contiguous": ("dequant_q8", qb.transpose(0, 1), d.T),
        "dequant_q8 d wrong size": ("dequant_q8", qb, torch.ones(5, 3)),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_arguments_raise_runtime_error(built, case):
    name, *args = _bad_calls()[case]
    with pytest.raises(RuntimeError, match=name):  # TORCH_CHECK names the kernel
        matvec.run(name.removesuffix("h"), *args)
