"""int8 activation blocks for the 4-bit and Q8_0 products (src/attnlab/nn/csrc/rows.h,
`quant_blocks.int8_activations`) against float64 references.

- `quantize_x8` is the documented formula: per block of 32, dx = max|x| / 127 (fp32), xq =
  round(x / dx) half to even (torch.round), 0 where the block is all zeros; xs the block's sum
  within fp32 summation of 32 terms;
- `mv_q4_x8` / `mv_q8_x8` equal Σ_g d_g·dx_g·(Σ_j q_gj·xq_gj) (+ Σ_g m_g·xs_g) in float64, within
  γ_{G+3}·Σ_gj |d_g·dx_g·q_gj·xq_gj| (the integer sums are exact; the scales' product, the conversions and the sums
  over blocks round), for 1, 3 and 8 rows, odd N, K from 32 to 576 — nibble order and Q8_0 signs
  included (weights -127..127, with -128 excluded as llama.cpp's blocks never hold it);
- and they stay within x's rounding of the fp32-activation kernels: |Δy| ≤ Σ_g |d_g q|·dx_g/2
  (+0 for m, whose sums are exact);
- `int8_activations(model)` routes the block maps' decode rows through the _x8 kernels and
  `on=False` back; prefills (more than matvec.MAX_ROWS rows) keep fp32 activations.
"""

from __future__ import annotations

import pytest
import torch

import attnlab as al
from attnlab.nn import matvec
from attnlab.nn.quant_blocks import BlockInt8Linear, Int4Linear, int8_activations, pack_nibbles
from helpers.tolerance import gamma


@pytest.fixture(scope="module")
def ext():
    if not matvec.ready():
        pytest.skip("the matvec kernels are off or cannot be built here (src/attnlab/nn/matvec.py)")
    return matvec.extension()


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    if m > 1:
        x[1, :32] = 0  # an all-zero block: dx 0, xq 0
    return x


@pytest.mark.parametrize("m, k", [(1, 32), (3, 96), (8, 576)])
def test_quantize_x8_is_the_documented_formula(ext, m, k):
    x = _x(m, k, seed=k)
    xq, dx, xs = ext.quantize_x8(x)
    blocks = x.view(m, -1, 32)
    want_dx = blocks.abs().amax(-1) / 127
    safe = torch.where(want_dx == 0, torch.ones_like(want_dx), want_dx)
    want_q = torch.where(want_dx[..., None] == 0, 0.0, torch.round(blocks / safe[..., None]))
    assert torch.equal(dx, want_dx)
    assert torch.equal(xq.view(m, -1, 32).float(), want_q)
    exact = blocks.double().sum(-1)
    assert ((xs.double() - exact).abs() <= gamma(32) * blocks.double().abs().sum(-1)).all()


def _weights(kind: str, n: int, g: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    d = torch.rand(n, g, generator=gen) * 0.02
    d[0, 0] = 0  # a zero scale
    if kind == "q4":
        q = torch.randint(0, 16, (n, g, 32), generator=gen, dtype=torch.uint8)
        m = -torch.rand(n, g, generator=gen) * 0.1
        return (pack_nibbles(q).contiguous(), d, m), q.double(), m
    q = torch.randint(-127, 128, (n, g, 32), generator=gen, dtype=torch.int8)
    if kind == "q8h":  # a scale per 16 (Q6_K's): d (N, 2G), each block's q read as two halves
        d2 = torch.randn(n, 2 * g, generator=gen)
        return (q, d2), q.double(), None
    return (q, d), q.double(), None


@pytest.mark.parametrize("kind", ["q4", "q8", "q8h"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k", [(1, 32), (7, 64), (33, 96), (300, 576)])
def test_x8_kernels_match_float64_formula(ext, kind, m, n, k):
    g = k // 32
    h = 2 if kind == "q8h" else 1  # scales per block of 32: q8h is mv_q8 with d (N, 2G)
    kernel = kind.removesuffix("h")
    args, q, mins = _weights(kind, n, g, seed=n + k)
    x = _x(m, k, seed=m)
    y = getattr(ext, f"mv_{kernel}_x8")(x, *args)
    xq, dx, xs = ext.quantize_x8(x)
    qh, xqh = q.view(n, g * h, -1), xq.view(m, g * h, -1).double()  # a block per scale
    dxh = dx.double().repeat_interleave(h, -1)  # x's step of each weight block's part
    isum = torch.einsum("ngj,mgj->mng", qh, xqh)  # exact integers
    scale = args[1].double()[None] * dxh[:, None]  # (M, N, G·h) d_g·dx_g
    # the kernel splits a block's integer sum over lanes before scaling them: bound by |q|·|xq|
    iabs = torch.einsum("ngj,mgj->mng", qh.abs(), xqh.abs())
    terms = (iabs * scale.abs()).sum(-1)
    ref = (isum * scale).sum(-1)
    if mins is not None:
        ref = ref + xs.double() @ mins.double().T
        terms = terms + xs.double().abs() @ mins.double().abs().T
    bound = (gamma(g * h + 3) + gamma(g * h + 3, torch.float64)) * terms
    assert ((y.double() - ref).abs() <= bound).all()
    # and within x's rounding of the fp32-activation kernel: |Δx| ≤ dx/2 per element
    y32 = getattr(ext, f"mv_{kernel}")(x, *args)
    half_steps = torch.einsum("ngj,ng,mg->mn", qh.abs(), args[1].double().abs(), dxh / 2)
    assert ((y.double() - y32.double()).abs() <= half_steps * 1.001 + 1e-5 * terms).all()


def _tiny_packed():
    torch.manual_seed(0)
    cfg = al.presets.tiny(al.presets.get("llama2-7b")).replace(init="xavier")
    return al.quantize(al.fuse(al.build_model(cfg).eval()), "int4", head=True)


def test_int8_activations_route_decode_rows_through_the_x8_kernels(ext, matvec_calls):
    model = int8_activations(_tiny_packed())
    lin = model.decoder.blocks[0].ffn.down_proj
    assert isinstance(lin, Int4Linear) and lin.activations == "int8"
    x = torch.randn(1, lin.in_features)
    with torch.inference_mode():
        lin(x)
        assert matvec_calls[-1] == "mv_q4_x8"
        lin(torch.randn(matvec.MAX_ROWS + 1, lin.in_features))  # a prefill: fp32 activations
        assert matvec_calls[-1] != "mv_q4_x8"
        int8_activations(model, on=False)
        lin(x)
        assert matvec_calls[-1] == "mv_q4"
    assert all(
        mod.activations == "fp32"
        for mod in model.modules()
        if isinstance(mod, Int4Linear | BlockInt8Linear)
    )
