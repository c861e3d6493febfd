"""The engine's one-token decode step over the paged KV pool, read in place (layout "paged").

The engine's cache (src/attnlab/cache/ragged.py) keeps every request's keys and values in blocks
of one shared pool; the dense layout gathers each step's rows into a padded (B, H_kv, S, D) copy
per layer (cache/blocks.py `store`). At a decode step of 32 requests with ~130-token contexts
that copy and the padded kernel were a third of the step (SmolLM2-135M, 2 threads:
benchmarks/serve.py). A one-token step needs no copy: row b attends to exactly its first n_b
slots (its positions 0 .. n_b - 1, its new key last), so `paged_decode` (nn/csrc/paged.cpp) reads
those slots through the row's slot table, in fp32, one (row, head) pair per task.

The call's `pages` (call.py, `PagedKV`) carry the pool; the layer has stored the step's new K/V
in it before the call. The kernel serves a plain one-token step: a mask that limits keys by
causality and padding only, no bias, soft-capping, sinks, weights or dropout, fp32 on the CPU,
no gradients, the native kernels built; anything else gets `why_not` and the layer takes the
dense layout. The values equal the dense path's up to fp32 summation order
(tests/nn/attention/kernels/test_paged_decode.py).
"""

from __future__ import annotations

import torch

from ... import matvec
from .base import KERNELS, Kernel, KernelCaps
from .call import AttnCall


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, H, 1, D) -> (B, H, 1, D) over the pool (k, v: the step's own, already stored)."""
    p = call.pages
    B, H, _, D = q.shape
    out = matvec.extension().paged_decode(
        q.reshape(B, H, D).contiguous(), p.k, p.v, p.slots.contiguous(), p.lengths, call.scale
    )
    return out.reshape(B, H, 1, D), None


def one_token_step(q: torch.Tensor, call: AttnCall) -> str | None:
    """Why the call is not a one-token step without global tokens (what both paged kernels
    serve: this one and paged_flex.py), or None."""
    m = call.mask
    if q.shape[2] != 1:
        return f"it decodes one token per row, not {q.shape[2]}"
    if m is not None and (m.q_global is not None or m.k_global is not None):
        return "it has no global tokens"
    return None


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall) -> str | None:
    if (why := one_token_step(q, call)) is not None:
        return why
    if call.mask is None or call.mask.window is not None:
        return "it reads each row's first n_b slots: no sliding window"
    if torch.compiler.is_compiling():
        return "a native kernel is opaque to torch.compile (a compiled step takes paged-flex)"
    if call.pages.k.dtype != torch.float32:
        return "its pool is not fp32"
    if matvec.extension() is None:
        return "the native CPU kernels are not built (src/attnlab/nn/matvec.py)"
    return None


CAPS = KernelCaps(
    bias=False,
    weights=False,
    dropout=False,
    backward=False,
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32}),
    layouts=frozenset({"paged"}),
)
KERNELS.register("paged")(Kernel(paged_attention, caps=CAPS, accepts=serves))
