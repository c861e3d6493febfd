"""Tolerances derived from the arithmetic, not tuned on one CPU.

Two evaluations of one function that differ only in the order of their floating-point sums — a
vector width (AVX2 vs AVX-512), a BLAS blocking (MKL picks its kernels per CPU), a chunked vs a
recurrent form, a cached step vs the full pass — differ by rounding alone. For a sum of n terms
(Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed. 2002, section 3.1, eq. 3.5)

    |fl(Σ x_i) − Σ x_i| ≤ γ_n · Σ |x_i|,    γ_n = n·u / (1 − n·u),    u = the unit round-off,

and the bound holds for *every* order of summation, so a tolerance built on it holds on every
machine, whatever kernels it picks. Reductions chained one after another (the layers of a network)
add their lengths to first order, so `n` below is the summed reduction length along the longest
path from a test's inputs to what it compares, and `scale` stands for Σ|x_i|: the magnitude of
the summed terms (1 for the O(1) activations of a freshly initialised model).

Each test that compares two float computations states its `n` (`rounding_tol(n)`, or
`forward_terms(...)` for a whole model) next to the comparison. A broken implementation (a wrong
position, a missing key, a mask off by one) differs by orders of magnitude more.
"""

from __future__ import annotations

import torch

UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's γ_n: the relative rounding error of any sum of n terms in `dtype`."""
    nu = n * UNIT_ROUNDOFF[dtype]
    if nu >= 1:
        raise ValueError(f"n·u = {nu:.3g} >= 1: no bound for {n} terms in {dtype}")
    return nu / (1 - nu)


def rounding_tol(n: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> dict:
    """`torch.testing.assert_close` tolerances for two orders of summing n terms of magnitude
    `scale` in `dtype`: rtol γ_n and atol γ_n · scale."""
    g = gamma(n, dtype)
    return {"rtol": g, "atol": g * scale}


def forward_terms(*, n_layers: int, d_model: int, d_ff: int, keys: int) -> int:
    """The longest chain of rounded sums in one forward pass of a Transformer, for
    `rounding_tol`: per layer two norms (d_model each), the q/k/v projection (d_model), the
    scores (head_dim <= d_model), the softmax normaliser and the weighted sum of values (`keys`
    each, or a linear attention's running sums over as many positions), the output projection
    (d_model) and the FFN (d_model, then d_ff); then the final norm and the output head."""
    per_layer = 5 * d_model + 2 * keys + d_model + d_ff
    return n_layers * per_layer + 2 * d_model


def assert_within_rounding(
    actual: torch.Tensor,
    expected: torch.Tensor,
    n: int,
    *,
    dtype: torch.dtype | None = None,
    scale: float | None = None,
    msg: str | None = None,
) -> None:
    """`actual` equals `expected` up to the rounding of n chained terms in `dtype` (actual's by
    default): |a − e| <= γ_n · (scale + |e|), `scale` standing for Σ|x_i|; by default max|e|.
    Give it when the exact value cancels (a gradient that is zero in exact arithmetic, such as a
    key bias's under softmax, is rounding noise of the size of the terms that cancelled)."""
    dtype = dtype or actual.dtype
    if scale is None:
        scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    tol = rounding_tol(n, dtype, scale)
    note = (lambda m: f"{msg}: {m}") if msg else None  # keep torch's report, name the value
    torch.testing.assert_close(actual.to(expected.dtype), expected, **tol, msg=note)
