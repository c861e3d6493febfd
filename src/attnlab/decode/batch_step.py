"""The engine's decode-only steps as compiled graphs, one per size bucket: on CUDA each is
captured once as a CUDA graph and replayed (vLLM's CUDA graphs for decode batches, in its
`cudagraph_capture_sizes` buckets).

A decode step of the engine (src/attnlab/decode/engine.py) is one new token for each of B
running rows, each row with its own length and block table in the paged pool
(src/attnlab/cache/ragged.py). B and the tables change every step; a graph needs fixed shapes
and no host reads. So the host does the bookkeeping and the graph the arithmetic:

    host (eager)     rows' lengths advanced, each row's write slot (its next slot in its table)
                     and its table padded with the scratch block to the width bucket W (blocks,
                     a power of 2 >= the longest row's); the batch padded to the size bucket
                     (a power of 2 >= B) with rows that write and read the scratch block;
                     copied into the bucket's static buffers
    graph (compiled) the slots' positions and validity written, each row's keys gathered from
                     its table, the model's forward on the pool (each layer's K/V written at the
                     write slots and its keys gathered: `_PoolLayer`), logits in fp32

A padding row writes the scratch block as invalid, as the pool's own padding does (nothing reads
it as a key), and reads the scratch slot it wrote as its one valid key, so its values stay finite.
Each bucket is one graph (src/attnlab/graphs.py: a dynamo cache of its own per engine model
and bucket, so no number of buckets meets dynamo's recompile limit). `capture` compiles the
engine's sizes before its first request (Engine.warm_up, vLLM's capture sizes) and pins them;
a step of another size takes the captured size at or above it, or compiles its bucket then.

The models are those the compiled step serves (compiled_step.py `why_not`). On CUDA the engine
takes this step for its decode-only batches; on the CPU, the native rows and the eager batch
(runner.py) are faster, and tests run this step there through inductor
(tests/decode/test_batch_step.py: logits equal to the eager step's within rounding, tokens equal to
`generate` alone, no recompile within a bucket, nothing read from the device).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from ..cache.ragged import PoolGraphView, RaggedPagedCache
from ..graphs import Graphs, bucket
from ..nn.inputs import checked
from ..nn.model import DecoderOnlyModel
from . import compiled_step
from .requests import Seq


def _forward(model: DecoderOnlyModel, view: PoolGraphView) -> torch.Tensor:
    b = view.buffers
    hidden, _ = model.run(model.embed(b.tokens[:, None]), view.q_positions, None, view)
    return model.logits(hidden[:, -1]).float()  # (B_b, V)


@functools.cache
def compiled(mode: str) -> Graphs:
    """The step's graphs for one torch.compile mode: one per engine model and bucket, each in
    a dynamo cache of its own (src/attnlab/graphs.py), so no number of buckets, engines or
    models meets dynamo's recompile limit."""
    return Graphs(_forward, capacity=64, fullgraph=True, dynamic=False, mode=mode)


class BatchStep:
    """A decode-only step of the engine's rows through the compiled graph of its bucket:
    `(seqs, cache) -> logits (B, V)`, as the runner's eager step computes them."""

    def __init__(self, model: DecoderOnlyModel, cache: RaggedPagedCache, mode: str | None = None):
        """mode: torch.compile's; None: "reduce-overhead" (CUDA graphs) on CUDA, else default."""
        self.model, self.cache = model, cache
        self.device = cache.pool.k.device
        self.on_cuda = self.device.type == "cuda"
        self.fn = compiled(mode or ("reduce-overhead" if self.on_cuda else "default"))
        self.rows: tuple[int, ...] = ()  # the sizes `capture` was given, ascending
        self.widths: tuple[int, ...] = ()
        self.captured: list[tuple[int, int]] = []  # (rows, width) compiled by `capture`

    def _key(self, rows: int, width: int) -> tuple:
        """One graph's key: this engine's model and pool (weakly) and the bucket."""
        return (weakref.ref(self.model), weakref.ref(self.cache), rows, width)

    def _view(self, rows: int, width: int) -> PoolGraphView:
        """The cache's view of the bucket of `rows` rows, `width` blocks (ragged.py)."""
        return self.cache.graph_view(self._size(rows, self.rows), self._size(width, self.widths))

    @staticmethod
    def _size(n: int, captured: tuple[int, ...]) -> int:
        """The captured size at or above n, else its power-of-2 bucket (compiled when met)."""
        return next((c for c in captured if c >= n), bucket(n))

    @torch.inference_mode()  # as the engine's steps run: a graph guards on the tensors' mode
    def capture(
        self,
        rows: Sequence[int],
        widths: Sequence[int],
        say: Callable[[str], None] = print,
        max_blocks: int | None = None,
    ) -> float:
        """Compile (on CUDA: capture) the graph of every rows × widths bucket now (but those
        of more than `max_blocks` rows × width), each run on padding rows only (they write and
        read the scratch block), so no request's step compiles one later (vLLM captures its
        `cudagraph_capture_sizes` at start). Steps of other sizes take the captured size at or
        above theirs. Returns the seconds it took; `captured` lists the sizes."""
        start = time.perf_counter()
        sizes = [(r, w) for r in sorted(rows) for w in sorted(widths)
                 if max_blocks is None or r * w <= max_blocks]  # fmt: skip
        self.rows, self.widths = tuple(sorted(set(rows))), tuple(sorted(set(widths)))
        for i, (r, w) in enumerate(sizes, 1):
            view = self._view(r, w)
            view.pad_only()
            for _ in range(3):  # CUDA graph trees: a warm-up run, the recording, one replay
                if self.fn is None or self._run(r, w, view) is None:
                    return time.perf_counter() - start
            self.fn.pin(self._key(r, w))  # never dropped to make room for a later graph
            self.captured.append((r, w))
            say(f"decode graphs: {i}/{len(sizes)} ({r} rows x {w} blocks) "
                f"{time.perf_counter() - start:.1f} s")  # fmt: skip
        return time.perf_counter() - start

    def _run(self, rows: int, width: int, view: PoolGraphView) -> torch.Tensor | None:
        """The bucket's graph on its buffers as they are; None if torch.compile cannot build
        it (said once, graphs.py `run_or_fall_back`): the engine then decodes eagerly."""
        if self.fn is None:
            return None
        with checked():  # the tokens came from the model's own logits: no host-side id check
            out = self.fn.run_or_fall_back(
                self._key(rows, width), (self.model, view), owner=self.model,
                what="the engine's compiled decode step",
            )  # fmt: skip
        if out is None:
            self.fn = None
        return out

    @torch.no_grad()
    def __call__(self, seqs: list[Seq]) -> torch.Tensor | None:
        """The rows' next logits (B, V); None if torch.compile cannot build the step (said
        once): the caller then decodes eagerly, from now on."""
        if self.fn is None:
            return None
        tables = [self.cache.row_tables[s.rid] for s in seqs]
        view = self._view(len(seqs), max(len(t) for t in tables))
        view.load([s.rid for s in seqs], [s.newest for s in seqs], [s.filled for s in seqs])
        rows, width = view.buffers.table.shape
        logits = self._run(rows, width, view)
        if logits is None:
            return None
        # a CUDA graph's output is overwritten by its next replay: the caller keeps a copy
        return logits[: len(seqs)].clone() if self.on_cuda else logits[: len(seqs)]


def why_not(model: DecoderOnlyModel, cache) -> str | None:
    """Why the decode batches of `model` on `cache` cannot take this step by default, or None:
    the engine's pool on a CUDA device (on the CPU the native rows and the eager batch are
    faster), a model the compiled step serves (compiled_step.py)."""
    if not isinstance(cache, RaggedPagedCache):
        return "it decodes the engine's pool (a loop's cache takes the compiled step)"
    if cache.pool.k.device.type != "cuda":
        return "on the CPU the native rows and the eager batch decode faster"
    return compiled_step.why_not(model)
