"""One selector: which kernel computes an attention call.

Each kernel declares what it serves (`KernelCaps`: bias, weights, dropout, backward, softcap,
sinks, devices, dtypes, layouts) and may test a call further (`Kernel.accepts`: the structure it
exploits); `Kernel.why_not` answers with a reason or None. The default, "auto", takes the first
kernel of its device's PREFERENCE list that serves the call:

    cpu   paged        the engine's one-token step over the pool in place (layout "paged";
                       inside a compiled step, where a native kernel is opaque, paged-flex)
          sdpa         nothing masked or the plain causal square: one fused call
          alibi-sdpa   causal ALiBi as one extra q/k channel of sdpa
          block-gather BigBird's key blocks, gathered
          chunked      anything else: blocks of query rows, bias and mask per block, linear memory
                       (a call of at most DENSE_ROWS query rows, a decode step, takes naive
                       first: its whole scores are one of chunked's blocks, planned on device)
    cuda  paged-flex (the paged layout: FlexAttention over the pool, a BlockMask from the
          block tables), sdpa, then flex (FlexAttention from the mask and bias descriptions:
          any pointwise mask and score transform, fused, no (T, S) tensor), then the CPU's list
          for what flex refuses (dropout, weights)

A layer given a kernel by name (`set_kernel(model, "chunked")`) runs that kernel wherever it
serves the call and raises with its reason where it does not; "auto" never raises while some
kernel serves the call (chunked serves every dense call but weights, naive those).

This replaces what three places decided before: sdpa's own if-chain, the layer's substitute for
soft-capping and sinks, and the paged step's probing of the cache before the registry
(vLLM's attention backend selector, `validate_configuration`, is the model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import DENSE_ROWS, KERNELS, Kernel
from .call import AttnCall

AUTO = "auto"
_CPU = ("paged", "sdpa", "alibi-sdpa", "block-gather", "chunked", "naive")
PREFERENCE: dict[str, tuple[str, ...]] = {
    "cpu": _CPU,
    "cuda": ("paged-flex", "sdpa", "flex", "alibi-sdpa", "block-gather", "chunked", "naive"),
}


@dataclass(frozen=True)
class Choice:
    """The kernel a call got and why the ones before it in the list did not get it."""

    name: str
    kernel: Kernel
    passed: tuple[tuple[str, str], ...] = ()  # (kernel, reason) for each one passed over

    def explain(self) -> str:
        skipped = "; ".join(f"{n}: {r}" for n, r in self.passed)
        return self.name if not skipped else f"{self.name} (passed over {skipped})"


class NoKernelError(ValueError):
    """No kernel (or not the one named) serves a call; the message says why."""


def check_name(name: str) -> str:
    """`name` if it is "auto" or a registered kernel; else the registry's did-you-mean error."""
    if name != AUTO:
        KERNELS.get(name)
    return name


def preference(device: torch.device | str, rows: int | None = None) -> tuple[str, ...]:
    """The device's list; for a call of at most DENSE_ROWS query rows (`rows`, a decode step)
    naive comes before chunked: its whole score matrix is one of chunked's blocks, and it plans
    nothing on the host (one graph for every compiled decode step)."""
    kind = torch.device(device).type
    names = [n for n in PREFERENCE.get(kind, _CPU) if n in KERNELS]
    if kind == "cpu" and torch.compiler.is_compiling() and "paged-flex" in KERNELS:
        # a compiled step (decode/batch_step.py) traces flex; the native kernel it cannot
        names = ["paged-flex" if n == "paged" else n for n in names]
    if rows is not None and rows <= DENSE_ROWS and "naive" in names and "chunked" in names:
        names.remove("naive")
        names.insert(names.index("chunked"), "naive")
    return tuple(names)


def choose(
    name: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: AttnCall,
    device: str | None = None,
) -> Choice:
    """The kernel for this call: `name` itself, or with "auto" the first of the device's list
    that serves it. Raises NoKernelError naming every reason when none does. `device`: decide
    for this device type instead of q's (tests of the CUDA list on the CPU)."""
    device = device or q.device.type
    if name != AUTO:
        kernel = KERNELS.get(name)
        reason = kernel.why_not(q, k, v, call, device)
        if reason is not None:
            raise NoKernelError(
                f"attention kernel '{name}' cannot serve this call: {reason}; "
                "use kernel 'auto' (attnlab.set_kernel(model, 'auto')) to let the selector choose"
            )
        return Choice(name, kernel)
    passed = []
    for candidate in preference(device, q.shape[2]):
        kernel = KERNELS.get(candidate)
        reason = kernel.why_not(q, k, v, call, device)
        if reason is None:
            return Choice(candidate, kernel, tuple(passed))
        passed.append((candidate, reason))
    raise NoKernelError(
        "no attention kernel serves this call: " + "; ".join(f"{n}: {r}" for n, r in passed)
    )


def first(
    name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall
) -> Choice | None:
    """`choose` without the error: None where no kernel (or not the one named) serves the
    call (a layer then tries another layout: layer.py, the paged pool)."""
    names = (name,) if name != AUTO else preference(q.device, q.shape[2])
    for candidate in names:
        kernel = KERNELS.get(candidate)
        if kernel.why_not(q, k, v, call) is None:
            return Choice(candidate, kernel)
    return None


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall, kernel: str = AUTO
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the call on `kernel` (a name, or "auto"): (B, H, T, D) and the weights or None."""
    return choose(kernel, q, k, v, call).kernel.fn(q, k, v, call)
