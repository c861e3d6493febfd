"""`decode_step` as one compiled graph on a fixed-shape cache: the GPU's step (gpt-fast's
`decode_one_token` under `torch.compile(mode="reduce-overhead")`).

On a GPU an eager decode step of a small model is ~1,000 kernel launches of a few microseconds
each, most of them waiting on the host: the weights' bytes (the bandwidth bound) are a fraction
of the step. Compiled with `fullgraph=True` the step is a few fused kernels, and on CUDA
"reduce-overhead" replays them as one CUDA graph. That needs every step to have the same shapes
and no host reads, which is what the fixed-shape cache (src/attnlab/cache/fixed.py) gives:

    host (eager)       cache.reserve(1): the capacity check and the host's slot count
    graph (compiled)   positions = cache.next_position; the model's forward over the cache's
                       `graph_view()` (cache/fixed.py), which writes the slot at the cache's
                       device cursor (`write`) and each layer's K/V (`store`) without the
                       protocol's host bookkeeping;
                       the last position's logits in fp32

It serves decoder-only models on a "fixed" cache whose every layer is the softmax `Attention`
(the kinds with caches of their own, linear attention, MLA, Transformer-XL, are left to the eager
step) in eval mode without LongRoPE's switch (it reruns the prompt). `why_not` says which rule a
model breaks. A mixture of experts runs every expert on the step's rows, weighted 0 where not
routed (nn/ffn/moe.py `_every_expert`: no shape decided by the routing). Greedy and sampling
pick the next token outside the graph with no host read (generate.py's `sample_next`), and the
loop reads its stop test every few steps on a GPU (generate.py), so nothing waits on the device
per token.

The values are the eager step's up to rounding (tests/decode/test_compiled_step.py: every decoder
preset it accepts, inductor on the CPU; 64 steps after the first with no recompile and no graph
break).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from ..cache.fixed import FixedGraphView, FixedKVCache
from ..graphs import FAILED, Graphs
from ..nn.attention.layer import Attention
from ..nn.inputs import checked
from ..nn.model import DecoderOnlyModel
from .native_step import eval_decoder

BUCKET = 256  # fixed caches' lengths are multiples of this (`bucket`)
# one fixed cache kept per model (`reusable_cache`): its buffers, and so a captured CUDA graph
# over them, serve the model's next loop of the same shape
_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def why_not(model: nn.Module, cache=None) -> str | None:
    """Why `model` (on `cache`, if given) cannot take the compiled step, or None if it can."""
    if (why := eval_decoder(model)) is not None:
        return why
    if model.reprefill_after is not None:
        return "LongRoPE reruns the prompt when it switches tables (a host decision)"
    if model in FAILED:
        return f"torch.compile could not build its step before ({FAILED[model]})"
    if cache is not None and not isinstance(cache, FixedKVCache):
        return f"the cache is {type(cache).__name__}: the compiled step needs kind 'fixed'"
    for i, block in enumerate(model.decoder.blocks):
        attn = getattr(block, "self_attn", None)
        if type(attn) is not Attention:
            return f"block {i}: attention {type(attn).__name__} keeps a cache of its own kind"
    return None


def _forward(model: DecoderOnlyModel, token: torch.Tensor, view: FixedGraphView) -> torch.Tensor:
    positions = view.next_position[:, None].clone()  # (B, 1): append moves the original
    out = model(token[:, None], positions=positions, cache=view)
    return out.logits[:, -1].float()


@functools.cache
def compiled(mode: str) -> Graphs:
    """The step's graphs for one torch.compile mode, one per model and cache shape (rounded up
    by `bucket`), each in a dynamo cache of its own (src/attnlab/graphs.py): a second `generate`
    of the same shape replays its graph, and a process may decode any number of models and
    shapes without meeting dynamo's recompile limit (the 9th graph of one function)."""
    return Graphs(_forward, capacity=32, fullgraph=True, dynamic=False, mode=mode)


def graph_key(model: nn.Module, cache: FixedKVCache) -> tuple:
    """What one graph of the step is for: the model (held weakly) and its cache's shape."""
    return (weakref.ref(model), cache.batch_size, cache.max_len, cache.k.dtype, cache.k.device)


def bucket(max_len: int) -> int:
    """A fixed cache's length rounded up to BUCKET slots: calls of nearby lengths share a graph."""
    return -(-max_len // BUCKET) * BUCKET


class CompiledStep:
    """token (B,) -> next logits (B, vocab) for one FixedKVCache through the compiled step."""

    def __init__(self, model: DecoderOnlyModel, cache: FixedKVCache, mode: str | None = None):
        """mode: torch.compile's; None: "reduce-overhead" (CUDA graphs) on CUDA, else default."""
        self.model, self.cache, self.view = model, cache, cache.graph_view()
        self.on_cuda = cache.k.device.type == "cuda"
        if self.on_cuda:  # the buffers a captured graph reads and writes keep their addresses
            for t in (cache.k, cache.v, cache.positions, cache.valid, cache.cursor,
                      cache.next_position, cache.step_slot):  # fmt: skip
                torch._dynamo.mark_static_address(t)
        self.fn = compiled(mode or ("reduce-overhead" if self.on_cuda else "default"))
        self.key = graph_key(model, cache)

    @torch.no_grad()  # a decode step has no backward: one graph whatever the caller's mode
    def __call__(self, token: torch.Tensor, cache: FixedKVCache) -> torch.Tensor:
        if cache is not self.cache:
            raise ValueError("a CompiledStep decodes the cache it was built for")
        if self.fn is None:  # compiling failed once: the eager forward on the same cache
            return self.model(token[:, None], cache=cache).logits[:, -1].float()
        cache.reserve(1)  # the host's half: room for the slot, counted
        with checked():  # the token came from the model's own logits: no host-side id check
            logits = self.fn.run_or_fall_back(
                self.key, (self.model, token, self.view), owner=self.model,
                what="the compiled decode step (cache_kind='static' skips it)",
            )  # fmt: skip
        if logits is None:  # not compiled (said once): the eager forward, from now on
            cache.length -= 1
            self.fn = None
            return self(token, cache)
        # a CUDA graph's output is overwritten by its next replay: the caller keeps a copy
        return logits.clone() if self.on_cuda else logits


def reusable_cache(model: DecoderOnlyModel, batch_size: int, max_len: int) -> FixedKVCache:
    """A fixed cache for a loop of `model`: the one its last loop used, emptied, when the shape
    is the same (gpt-fast keeps its KVCache the same way: a captured CUDA graph reads the same
    buffers at every call), else a new one, kept for the next loop."""
    kept, g = _CACHES.get(model), model.cache_geometry()
    same = kept is not None and (kept.batch_size, kept.max_len, kept.k.dtype, kept.k.device) == (
        batch_size,
        max_len,
        g.dtype,
        g.device,
    )
    if same and not kept.in_use:  # (a loop still running on it keeps it: `in_use`)
        kept.reset()
        cache = kept
    else:
        cache = _CACHES[model] = model.new_cache(batch_size, max_len, kind="fixed")
    cache.in_use = True  # until the loop's state is gone (steps.py `prefill`)
    return cache
