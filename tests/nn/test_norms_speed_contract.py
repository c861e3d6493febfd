"""RMSNorm's fast kernels keep the formula's numerics contract (src/attnlab/nn/norms.py).

Oracles: float64 autograd of RMSNorm's formula (Zhang & Sennrich 2019, eq. 4), and the formula
in Llama's order itself (`rms_norm_reference`, what RMSNorm ran before the fast kernels). Every
kernel of RMS_NORM_KERNELS is swept over fp32, bf16 and fp16; the `cpu` kernel also over many
16-bit row blocks (BLOCK_ELEMENTS lowered), non-contiguous inputs and partial gradients. Bounds
come from the roundings each kernel makes: u = 2^-8 (bf16) or 2^-11 (fp16) per rounding to the
16-bit type, fp32 accumulation otherwise.
"""

from __future__ import annotations

import pytest
import torch

import attnlab.nn.norms as norms
from attnlab.nn.norms import RMS_NORM_KERNELS, RMSNorm, rms_norm, rms_norm_reference

F64 = torch.float64
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def inputs(shape, dtype, seed=0, scale=2.0):
    """x with a non-zero mean (RMSNorm must not subtract it), a weight near 1, an upstream grad."""
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    x = (torch.randn(shape, generator=g) * scale + 0.3).to(dtype)
    weight = (torch.randn(d, generator=g) * 0.5 + 1).to(dtype)
    up = torch.randn(shape, generator=g).to(dtype)
    return x, weight, up


def exact(x, weight, up, eps):
    """Forward and (dx, dw) of the formula in float64, from the rounded inputs."""
    x64 = x.detach().to(F64).requires_grad_(True)
    w64 = weight.detach().to(F64).requires_grad_(True)
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    y.backward(up.to(F64))
    return y.detach(), x64.grad, w64.grad


def run(kernel, x, weight, up, eps):
    x = x.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    y = kernel(x, weight, eps)
    y.backward(up)
    return y.detach(), x.grad, weight.grad


def rel_to_max(a, b):
    return ((a.to(F64) - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("eps", [1e-6, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(RMS_NORM_KERNELS))
def test_every_kernel_matches_the_formula(name, dtype, eps, monkeypatch):
    monkeypatch.setattr(norms, "BLOCK_ELEMENTS", 5 * 96)  # 16-bit `cpu`: 38 blocks of 5 rows
    x, weight, up = inputs((2, 94, 96), dtype)
    y, dx, dw = run(RMS_NORM_KERNELS[name], x, weight, up, eps)
    y_ref = rms_norm_reference(x, weight, eps)
    y64, dx64, dw64 = exact(x, weight, up, eps)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y.to(F64), y64, rtol=1e-5, atol=1e-6)
        assert rel_to_max(dx, dx64) < 1e-5 and rel_to_max(dw, dw64) < 1e-5
        return
    u = UNIT_ROUNDOFF[dtype]
    # forward: the same two roundings as the formula (x̂, then times the weight), so equal to it
    # except where the fp32 sum of squares, accumulated in another order, tips a rounding (none
    # here; 1e-4 of the elements at d 4096 in benchmarks/norms.py), one step of the 16-bit grid
    close = (y.to(F64) - y_ref.to(F64)).abs() <= 2 * u * y_ref.to(F64).abs()
    assert close.all() and (y != y_ref).double().mean() < 1e-3
    # two roundings, each within u relative, or half a step of the subnormal grid below the
    # smallest normal number (fp16: 2^-14)
    assert ((y.to(F64) - y64).abs() <= 2 * u * (y64.abs() + torch.finfo(dtype).tiny)).all()
    if name == "cpu":  # gradients in fp32, rounded once to the 16-bit type
        assert ((dx.to(F64) - dx64).abs() <= u * dx64.abs() + 1e-6 * dx64.abs().max()).all()
        assert ((dw.to(F64) - dw64).abs() <= u * dw64.abs() + 1e-6 * dw64.abs().max()).all()
    else:  # autograd of the formula rounds in 16 bits along the way
        assert rel_to_max(dx, dx64) < 4 * u and rel_to_max(dw, dw64) < 4 * u


@pytest.mark.parametrize("dtype", DTYPES)
def test_composite_is_bitwise_the_formula(dtype):
    """F.rms_norm without its weight normalises in fp32 and casts: Llama's order exactly."""
    for shape in [(3, 7, 64), (1, 1, 4096), (0, 8)]:
        x, weight, _ = inputs(shape, dtype, seed=1)
        assert torch.equal(
            norms.rms_norm_composite(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5)
        )


def test_torch_rms_norm_with_its_weight_rounds_once():
    """Why `composite` leaves the weight out: with it, F.rms_norm multiplies in fp32 before its one
    rounding (Gemma's order), which differs from the formula in bf16."""
    x, weight, _ = inputs((64, 512), torch.bfloat16, seed=2)
    with_weight = torch.nn.functional.rms_norm(x, (512,), weight, 1e-6)
    assert not torch.equal(with_weight, rms_norm_reference(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # fp32 is one block
def test_cpu_kernel_blocks_do_not_change_the_result(dtype, monkeypatch):
    x, weight, up = inputs((300, 256), dtype, seed=3)
    one_block = run(norms.rms_norm_cpu, x, weight, up, 1e-6)
    monkeypatch.setattr(norms, "BLOCK_ELEMENTS", 7 * 256)  # 43 blocks, the last of 6 rows
    blocks = run(norms.rms_norm_cpu, x, weight, up, 1e-6)
    assert torch.equal(one_block[0], blocks[0])
    # dx (the correction's gemv) and dw (summed over rows in another order) may differ in fp32's
    # last bits, and so by one step of the 16-bit grid where that tips a rounding
    step = 2 * UNIT_ROUNDOFF[dtype]
    for a, b in zip(one_block[1:], blocks[1:], strict=True):
        a, b = a.to(F64), b.to(F64)
        assert ((a - b).abs() <= step * a.abs() + 1e-5 * a.abs().max()).all()


def test_cpu_kernel_forward_only_equals_its_autograd_forward():
    x, weight, _ = inputs((64, 1024), torch.bfloat16, seed=4)
    with torch.no_grad():
        y_inference = norms.rms_norm_cpu(x, weight, 1e-6)
    y_training = norms.rms_norm_cpu(x, weight.clone().requires_grad_(True), 1e-6)
    assert torch.equal(y_inference, y_training.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_non_contiguous_input_and_expanded_grad(dtype):
    """A transposed (B, T, d) activation, and the stride-0 gradient of a sum."""
    x, weight, _ = inputs((48, 6, 128), dtype, seed=5)
    x_t = x.transpose(0, 1)  # (6, 48, 128), not contiguous
    assert not x_t.is_contiguous()
    ours = x_t.detach().clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    norms.rms_norm_cpu(ours, w, 1e-6).float().sum().backward()
    _, dx64, dw64 = exact(x_t, weight, torch.ones(x_t.shape, dtype=dtype), 1e-6)
    bound = 1e-5 if dtype == torch.float32 else 2 * UNIT_ROUNDOFF[dtype]
    assert ours.grad.shape == x_t.shape
    assert rel_to_max(ours.grad, dx64) < bound and rel_to_max(w.grad, dw64) < bound


@pytest.mark.parametrize("needs", ["x", "weight"])
def test_cpu_kernel_partial_gradients(needs):
    x, weight, up = inputs((40, 1000), torch.float32, seed=6)
    x = x.requires_grad_(needs == "x")
    weight = weight.requires_grad_(needs == "weight")
    norms.rms_norm_cpu(x, weight, 1e-6).backward(up)
    _, dx64, dw64 = exact(x, weight, up, 1e-6)
    grad, ref = (x.grad, dx64) if needs == "x" else (weight.grad, dw64)
    assert (x.grad is None) == (needs == "weight") and (weight.grad is None) == (needs == "x")
    assert rel_to_max(grad, ref) < 1e-5


def test_cpu_kernel_fp16_sum_of_squares_does_not_overflow():
    x, weight, up = inputs((64, 1024), torch.float16, seed=7, scale=500.0)
    assert torch.isinf(x.pow(2).sum(-1)).all()  # an fp16 sum of squares is inf
    y, dx, dw = run(norms.rms_norm_cpu, x, weight, up, 1e-6)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    y64, _, _ = exact(x, weight, up, 1e-6)
    u = UNIT_ROUNDOFF[torch.float16]  # two roundings, and the subnormal grid (see above)
    assert ((y.to(F64) - y64).abs() <= 2 * u * (y64.abs() + torch.finfo(torch.float16).tiny)).all()


def test_cpu_kernel_second_derivatives_are_the_formulas():
    """Under create_graph=True the backward is autograd of the formula, so a gradient penalty
    differentiates through it: its gradients equal the formula's."""

    def penalty_grads(kernel):
        x, weight, up = inputs((64, 1024), torch.float32, seed=8)
        x.requires_grad_(True)
        weight.requires_grad_(True)
        (gx,) = torch.autograd.grad((kernel(x, weight, 1e-6) * up).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        return x.grad, weight.grad

    for ours, ref in zip(
        penalty_grads(norms.rms_norm_cpu), penalty_grads(rms_norm_reference), strict=True
    ):
        torch.testing.assert_close(ours, ref)


def test_rms_norm_dispatch():
    """`cpu` above SMALL_ELEMENTS, `composite` up to it, `reference` for float64 or a weight of
    another dtype: each bitwise what that kernel returns."""
    eps = 1e-6
    big, weight, _ = inputs((64, 1024), torch.bfloat16, seed=9)
    small = big[:2]
    assert big.numel() > norms.SMALL_ELEMENTS >= small.numel()
    assert torch.equal(rms_norm(big, weight, eps), norms.rms_norm_cpu(big, weight, eps))
    assert torch.equal(rms_norm(small, weight, eps), norms.rms_norm_composite(small, weight, eps))
    for x, w in [(big.double(), weight.double()), (big, weight.float())]:
        assert torch.equal(rms_norm(x, w, eps), rms_norm_reference(x, w, eps))
    norm = RMSNorm(dim=1024, eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
    assert torch.equal(norm(big), norms.rms_norm_cpu(big, weight, eps))
