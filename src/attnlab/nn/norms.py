"""Normalisation layers.

LayerNorm (Ba, Kiros & Hinton 2016, arXiv:1607.06450): subtract the mean, divide by the standard
deviation over the feature dimension, then scale (and shift, when `bias`).
RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467): divide by the root mean square only, no mean,
no shift. Accumulated in fp32 whatever the input dtype, because the sum of squares of a bf16/fp16
vector loses precision (and overflows in fp16) long before the result does; the normalised
value is cast back to the input dtype before the weight multiplies it, as Llama does.

RMSNorm has three implementations of that one function, in RMS_NORM_KERNELS (tests sweep it):

- `reference`: the formula in Llama's order, the documentation and the tests' oracle;
- `composite`: torch's `F.rms_norm` without its weight, then the weight in x's dtype. Bitwise the
  formula (F.rms_norm normalises in fp32 and casts to x's dtype), in one C++ call. With its weight
  F.rms_norm is not: in bf16/fp16 it multiplies by the weight in fp32 before its one rounding,
  Gemma's order. On CPU it is no fused kernel, only the formula's chain of ops, so it wins on
  small inputs (decoding) where Python's per-op cost dominates, and loses on large ones;
- `cpu`: torch's fused CPU kernels, since torch has no fused RMSNorm on CPU. In fp32, with
  x (N, d) and x̂ = x · rstd:

    forward   rstd = rsqrt(‖x‖² / d + eps)       vector_norm: one fused pass, no x² temporary
              y    = (x · rstd) · w
    backward  LayerNorm's fused backward kernel, given mean 0 and this rstd, returns RMSNorm's
              dw = Σ_rows g · x̂ exactly, and its dx short of one per-row term:
                dx_LN = rstd · (g·w − mean(g·w) − x̂ · mean(g·w · x̂))     (means over d)
                dx    = dx_LN + rstd · mean(g·w)              mean(g·w) = (g @ w) / d, a gemv

  saving only x and the per-row rstd. bf16/fp16 rows go through in blocks upcast to fp32
  (BLOCK_ELEMENTS) and run the same steps (torch's 16-bit elementwise kernels convert every
  operand anyway, and LayerNorm's 16-bit backward sums dw over rows in 16 bits: 6 % off at
  3,000 rows, torch 2.13), rounding once into each 16-bit result: x̂ (the Llama cast, before the
  16-bit multiply by w), dx, dw.
  So 16-bit gradients are the fp32 gradient rounded once, closer than autograd of the formula.
  Under create_graph=True the backward is autograd of the formula instead, so that it can be
  differentiated again (a gradient penalty).

`rms_norm` picks: `cpu` for CPU inputs above SMALL_ELEMENTS, `composite` below; `reference`
elsewhere (other devices, float64, a weight of another dtype, and under torch.compile, which
fuses the formula itself). Speed: README "Performance" (benchmarks/norms.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Registry
from .norms_offset import UnitOffsetRMSNorm

NORMS: Registry[type[nn.Module]] = Registry("norm")

# dtypes the CPU kernels handle; 16-bit ones are computed in fp32
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 16-bit rows are upcast this many elements at a time: 2 MiB fp32 temporaries, which stay in
# cache for the passes after the upcast (larger blocks measured slower)
BLOCK_ELEMENTS = 1 << 19
# inputs up to this many elements take `composite`: per-op Python cost outweighs passes there
# (measured crossover on CPU: ~32K elements with backward, ~128K forward-only)
SMALL_ELEMENTS = 1 << 15

Need = tuple[bool, ...]  # (dx wanted, dw wanted): autograd's needs_input_grad


@NORMS.register("layernorm")
class LayerNorm(nn.Module):
    def __init__(
        self, *, dim: int, eps: float = 1e-5, bias: bool = True, upcast: bool = False
    ) -> None:
        """dim: the normalised (last) dimension; eps: added to the variance; bias: the shift;
        upcast: 16-bit inputs computed in fp32 with one rounding at the end (Cohere), instead
        of torch's layer_norm in their own dtype."""
        super().__init__()
        self.eps, self.upcast = eps, upcast
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.upcast and x.dtype in (torch.float16, torch.bfloat16):
            b = None if self.bias is None else self.bias.float()
            y = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), b, self.eps)
            return y.to(x.dtype)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as its formula (Llama's order: fp32 inside, cast, then the weight); float64
    stays float64 (the tests' references), only 16-bit inputs are widened."""
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_composite(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula as torch's F.rms_norm without its weight, then the weight (module doc)."""
    return weight * torch.rms_norm(x, (x.shape[-1],), None, eps)  # F.rms_norm, one frame less


def _row_blocks(x: torch.Tensor) -> list[slice]:
    """Row ranges of x (N, d) to upcast one at a time: BLOCK_ELEMENTS each; fp32 x all at once."""
    n, d = x.shape
    step = n if x.dtype == torch.float32 else max(1, BLOCK_ELEMENTS // d)
    return [slice(i, i + step) for i in range(0, n, step)]


def _forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, d) -> y (N, d) in x.dtype, rstd (N,) fp32."""
    n, d = x.shape
    y, rstd = x.new_empty(n, d), []
    for rows in _row_blocks(x):
        x32, y_rows = x[rows].float(), y[rows]  # x32 is x itself when fp32
        r = torch.linalg.vector_norm(x32, dim=-1).square_().div_(d).add_(eps).rsqrt_()
        if x.dtype == torch.float32:
            torch.mul(x32, r[:, None], out=y_rows)
        else:  # x32 is a copy: scale it in place, round once into y (Llama's cast)
            y_rows.copy_(x32.mul_(r[:, None]))
        y_rows.mul_(weight)
        rstd.append(r)
    return y, rstd[0] if len(rstd) == 1 else torch.cat(rstd)


def _backward(
    g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, need: Need
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """g, x (N, d), rstd (N,) fp32 -> dx (N, d) in x.dtype, dw (d,) in weight.dtype, if needed."""
    (n, d), (need_dx, need_dw) = x.shape, need
    w32, rstd, zeros = weight.float(), rstd[:, None], rstd.new_zeros(n, 1)
    in_place = x.dtype == torch.float32  # one block, and LayerNorm's dx becomes the result
    dx = x.new_empty(n, d) if need_dx and not in_place else None
    dw = None
    for rows in _row_blocks(x):
        x32, g32, r = x[rows].float(), g[rows].float(), rstd[rows]
        # LayerNorm's backward with mean 0: dw exact, dx short of rstd · mean(g·w) (module doc)
        dx32, dw32, _ = torch.ops.aten.native_layer_norm_backward(
            g32, x32, [d], zeros[rows], r, w32, None, [need_dx, need_dw, False]
        )
        if need_dx:
            dx32.add_(torch.mv(g32, w32)[:, None].mul_(r).div_(d))
            if in_place:
                dx = dx32
            else:
                dx[rows] = dx32  # one rounding to x.dtype
        if need_dw:
            dw = dw32 if dw is None else dw.add_(dw32)
    return dx, None if dw is None else dw.to(weight.dtype)


class _RMSNormCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _forward(x.reshape(-1, x.shape[-1]), weight, eps)  # (N, d): N = leading dims
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        if torch.is_grad_enabled():  # create_graph=True: differentiate the formula, which
            return _formula_grads(x, weight, ctx.eps, grad, need)  # can be differentiated again
        x = x.reshape(-1, x.shape[-1])
        g = grad.reshape(x.shape).contiguous()  # an expanded grad (of a sum) has stride 0
        dx, dw = _backward(g, x, weight, rstd, need)
        return None if dx is None else dx.view(grad.shape), dw, None


def _formula_grads(
    x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor, need: Need
) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    """(dx, dw, None) by autograd of the formula, keeping the graph (for higher derivatives)."""
    inputs = [t for t, n in zip((x, weight), need, strict=True) if n]
    y = rms_norm_reference(x, weight, eps)
    found = iter(torch.autograd.grad(y, inputs, grad, create_graph=True))
    return *(next(found) if n else None for n in need), None


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula from fused CPU kernels (module doc); x on CPU, non-empty, of a dtype in
    CPU_DTYPES, weight of x's dtype."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormCPU.apply(x, weight, eps)
    y, _ = _forward(x.reshape(-1, x.shape[-1]), weight, eps)
    return y.view(x.shape)


RMS_NORM_KERNELS = {
    "reference": rms_norm_reference,
    "composite": rms_norm_composite,
    "cpu": rms_norm_cpu,
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, by the kernel that is fastest here (module doc)."""
    if (
        x.device.type != "cpu"
        or x.dtype not in CPU_DTYPES
        or weight.dtype != x.dtype
        or torch.compiler.is_compiling()
    ):
        return rms_norm_reference(x, weight, eps)
    if x.numel() <= SMALL_ELEMENTS:
        return rms_norm_composite(x, weight, eps)
    return rms_norm_cpu(x, weight, eps)


@NORMS.register("rmsnorm")
class RMSNorm(nn.Module):
    def __init__(self, *, dim: int, eps: float = 1e-6) -> None:
        """dim: the normalised (last) dimension; eps: added to the mean square."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# Gemma's RMSNorm with its gain stored as an offset from 1 (its own module: norms_offset.py)
NORMS.register("rmsnorm-unit-offset")(UnitOffsetRMSNorm)
