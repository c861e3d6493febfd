"""Decode attention that reads the continuous-batching engine's paged KV pool in place.

The engine's cache (src/attnlab/cache/ragged.py) keeps every request's keys and values in blocks
of one shared pool; the general path gathers each step's rows into a padded (B, H_kv, S, D) copy
per layer for torch's kernel (blocks.py `store`). At a decode step of 32 requests with ~130-token
contexts that copy and the padded kernel were a third of the step (SmolLM2-135M, 2 threads:
benchmarks/serve.py). A one-token step needs no copy: row b attends to exactly its first n_b
slots (its positions 0 .. n_b - 1, its new key last), so `paged_decode` (csrc/paged.cpp) reads
those slots through the row's slot table, in fp32, one (row, head) pair per task.

`attend_paged` takes the step when everything else about it is plain: self-attention on a cache
layer that offers the pool (`paged()`: a one-token step of the ragged cache), a mask that limits
keys by causality and padding only (no window, no global tokens), no score bias, soft-capping or
sinks, no attention weights asked for, eval (no dropout), fp32 CPU tensors, the kernels built.
Anything else returns None and the layer takes its usual path; the values are the same up to
fp32 summation order (tests/test_paged_decode.py).
"""

from __future__ import annotations

import torch

from .. import matvec


def attend_paged(layer, q, k, v, ctx, cache, need_weights: bool) -> torch.Tensor | None:
    """The heads' outputs (B, 1, H·D) for q (B, H, 1, D) and the new k, v (B, H_kv, 1, D), the
    new K/V stored in the pool; None (nothing stored) where the step is not this case."""
    paged = getattr(cache, "paged", None)
    view = paged() if paged is not None else None
    if view is None or need_weights or q.shape[2] != 1:
        return None
    m = ctx.mask
    if (
        ctx.bias is not None
        or layer.softcap is not None
        or layer.sinks is not None
        or layer.dropout_p(ctx) > 0
        or m is None
        or m.window is not None
        or getattr(m, "q_global", None) is not None
        or getattr(m, "k_global", None) is not None
        or q.dtype != torch.float32
        or q.device.type != "cpu"
        or view[0].dtype != torch.float32
        or (torch.is_grad_enabled() and q.requires_grad)
    ):
        return None
    ext = matvec.extension()
    if ext is None:
        return None
    kl, vl, slots, lengths = view
    cache.write(k, v)
    B, H, _, D = q.shape
    out = ext.paged_decode(
        q.reshape(B, H, D).contiguous(), kl, vl, slots.contiguous(), lengths, layer.scale
    )
    return out.reshape(B, 1, H * D)
