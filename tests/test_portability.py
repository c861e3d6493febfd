"""The suite holds on every x86-64 CPU: what a run asks of the CPU is what it gets, and the
tolerances come from the arithmetic (tests/helpers/tolerance.py), not from one machine.

`make test` runs the kernel, quantization and decoding tests a second time as an AVX2-only laptop
would (ATEN_CPU_CAPABILITY=avx2, MKL and oneDNN capped at AVX2; the Makefile's AVX2 line). These
checks make that second run honest: a variable torch ignored would leave it on the first run's
kernels while claiming otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

from attnlab.nn.quantize import Int8Linear, cpu_has_native_bf16
from helpers.tolerance import forward_terms, gamma, rounding_tol

ASKED = os.environ.get("ATEN_CPU_CAPABILITY")


@pytest.mark.skipif(ASKED is None, reason="ATEN_CPU_CAPABILITY is not set: the CPU's own kernels")
def test_the_requested_kernels_are_the_ones_in_use():
    assert torch.backends.cpu.get_cpu_capability().lower() == ASKED.lower()


@pytest.mark.skipif(
    os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() not in ("AVX2", "AVX2_VNNI", "AVX"),
    reason="oneDNN is not capped below AVX-512 in this run",
)
def test_an_avx2_cap_leaves_no_native_bf16_and_int8_takes_the_fp32_path():
    """Below AVX-512 oneDNN has no bf16 at all, so the int8 module must not take its bf16 kernel
    path (slow where emulated), and says why."""
    assert not cpu_has_native_bf16()
    m = Int8Linear(torch.nn.Linear(64, 32))
    assert not m.use_kernel and "no native bf16" in m.no_kernel_because


def test_the_bound_is_higham_gamma_and_holds_for_any_order_of_a_long_sum():
    """γ_n = n·u/(1 − n·u) bounds every order of summation: the sum of 4,096 fp32 terms in
    forward, backward, pairwise and sorted order stays within it of the float64 sum, while a
    tolerance of one rounding (u) does not hold for all of them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g)
    exact = x.double().sum()
    scale = float(x.double().abs().sum())
    orders = {
        "forward": x,
        "backward": x.flip(0),
        "sorted": x.sort().values,
        "by magnitude": x[x.abs().argsort(descending=True)],
    }
    errors = {}
    for name, xs in orders.items():
        acc = torch.zeros((), dtype=torch.float32)
        for chunk in xs.split(64):  # sums of 64, then a running sum: a blocked BLAS's shape
            acc = acc + chunk.sum()
        errors[name] = abs(float(acc.double() - exact))
    assert all(e <= gamma(4096) * scale for e in errors.values()), errors
    assert errors["forward"] != errors["backward"] or errors["sorted"] != errors["forward"]
    assert max(errors.values()) > 2.0**-24 * abs(float(exact))  # one rounding is too tight


def test_forward_terms_counts_each_layer_once_and_tolerances_scale_with_them():
    one = forward_terms(n_layers=1, d_model=32, d_ff=128, keys=16)
    assert one == 6 * 32 + 128 + 2 * 16 + 2 * 32
    assert forward_terms(n_layers=2, d_model=32, d_ff=128, keys=16) - one == one - 2 * 32
    tol = rounding_tol(one, torch.float32, scale=3.0)
    assert tol["atol"] == pytest.approx(3.0 * tol["rtol"])
    assert rounding_tol(one, torch.float64)["rtol"] < 1e-13 < tol["rtol"] < 1e-4
    with pytest.raises(ValueError, match="no bound"):
        gamma(2**9, torch.bfloat16)
