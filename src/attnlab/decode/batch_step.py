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
import warnings
import weakref
from collections.abc import Callable, Sequence

import torch

from ..cache.base import CacheFullError
from ..cache.blocks import SCRATCH
from ..cache.ragged import RaggedPagedCache
from ..graphs import COMPILE_ERRORS, Graphs, bucket, describe
from ..nn.inputs import checked
from ..nn.model import DecoderOnlyModel
from . import compiled_step
from .requests import Seq


class _Buffers:
    """One bucket's static inputs: B_b rows, W_b blocks a row."""

    def __init__(self, rows: int, width: int, block_size: int, device) -> None:
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)  # each row's new token's position
        self.write = torch.zeros(rows, **long)  # the pool slot it goes to
        self.live = torch.zeros(rows, dtype=torch.bool, device=device)  # False: a padding row
        self.table = torch.zeros(rows, width, **long)  # (B_b, W_b) block ids
        self.offsets = torch.arange(block_size, **long)
        self.block_size = block_size

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.positions, self.write, self.live, self.table, self.offsets


class _PoolLayer:
    """One layer's K/V in the pool: the step's rows written at their slots, the keys gathered."""

    ready = False

    def __init__(self, view: _PoolView, layer: int) -> None:
        self.view, self.layer = view, layer

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (B, H_kv, 1, D) -> every row's keys and values (B, H_kv, S, D)."""
        out = []
        for pool, new in ((self.view.pool.k[self.layer], k), (self.view.pool.v[self.layer], v)):
            pool.index_copy_(
                1, self.view.buffers.write, new[:, :, 0].transpose(0, 1)
            )  # (H_kv, n, D)
            out.append(
                pool[:, self.view.read].transpose(0, 1)
            )  # (H_kv, B, S, D) -> (B, H_kv, S, D)
        return out[0], out[1]

    def remember(self, x: torch.Tensor) -> None:
        return None


class _PoolView:
    """The pool as the compiled forward sees it (the stack's cache protocol, `fixed_shape`):
    the bucket's buffers say what each row writes and reads."""

    fixed_shape = True
    cross = None

    def __init__(self, cache: RaggedPagedCache, buffers: _Buffers) -> None:
        self.pool, self.buffers = cache.pool, buffers
        self.layers = [_PoolLayer(self, i) for i in range(cache.pool.k.shape[0])]
        self.read = buffers.table  # replaced by append's gather indices within the graph

    @property
    def next_position(self) -> torch.Tensor:
        return self.buffers.positions

    def append(
        self, positions: torch.Tensor, valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' slots written (positions, and validity: live rows only); returns every key's
        position and validity (B, S), S = W_b · block_size."""
        b, pool = self.buffers, self.pool
        pool.positions.index_copy_(0, b.write, positions[:, 0])
        pool.valid.index_copy_(0, b.write, b.live)
        # (B, W, 1) * bs + (bs,) -> (B, W * bs): each row's slots in table order
        self.read = (b.table[:, :, None] * b.block_size + b.offsets).flatten(1)
        k_valid = pool.valid[self.read]
        first = torch.zeros_like(k_valid)
        first[:, 0] = ~b.live  # a padding row's one key: the scratch slot it just wrote
        return pool.positions[self.read], k_valid | first


def _forward(model: DecoderOnlyModel, view: _PoolView) -> torch.Tensor:
    b = view.buffers
    hidden, _ = model.run(model.embed(b.tokens[:, None]), b.positions[:, None], None, view)
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
        self.views: dict[tuple[int, int], _PoolView] = {}
        self.rows: tuple[int, ...] = ()  # the sizes `capture` was given, ascending
        self.widths: tuple[int, ...] = ()
        self.captured: list[tuple[int, int]] = []  # (rows, width) compiled by `capture`
        if self.on_cuda:  # the pool a captured graph writes keeps its address
            for t in (cache.pool.k, cache.pool.v, cache.pool.positions, cache.pool.valid):
                torch._dynamo.mark_static_address(t)

    def _key(self, rows: int, width: int) -> tuple:
        """One graph's key: this engine's model and pool (weakly) and the bucket."""
        return (weakref.ref(self.model), weakref.ref(self.cache), rows, width)

    def _view(self, rows: int, width: int) -> _PoolView:
        key = (self._size(rows, self.rows), self._size(width, self.widths))
        if key not in self.views:
            buffers = _Buffers(*key, self.cache.block_size, self.device)
            if self.on_cuda:
                for t in buffers.tensors():
                    torch._dynamo.mark_static_address(t)
            self.views[key] = _PoolView(self.cache, buffers)
        return self.views[key]

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
            b = view.buffers
            for name, value in (("tokens", 0), ("positions", 0), ("live", False),
                                ("write", SCRATCH * self.cache.block_size), ("table", SCRATCH)):  # fmt: skip
                getattr(b, name).fill_(value)
            for _ in range(3):  # CUDA graph trees: a warm-up run, the recording, one replay
                if self.fn is None or self._run(r, w, view) is None:
                    return time.perf_counter() - start
            self.fn.pin(self._key(r, w))  # never dropped to make room for a later graph
            self.captured.append((r, w))
            say(f"decode graphs: {i}/{len(sizes)} ({r} rows x {w} blocks) "
                f"{time.perf_counter() - start:.1f} s")  # fmt: skip
        return time.perf_counter() - start

    def _run(self, rows: int, width: int, view: _PoolView) -> torch.Tensor | None:
        """The bucket's graph on its buffers as they are; None (with a warning, once) if
        torch.compile cannot build it: the engine then decodes eagerly, from now on."""
        try:
            with checked():
                return self.fn(self._key(rows, width), self.model, view)
        except COMPILE_ERRORS as err:  # raised while compiling, before it ran
            self.fn.drop(self._key(rows, width))
            self.fn = None
            why = describe(err)
            warnings.warn(
                f"the engine's compiled decode step could not be built ({why}); it decodes "
                "eagerly from now on",
                RuntimeWarning,
                stacklevel=4,
            )
            return None

    @torch.no_grad()
    def __call__(self, seqs: list[Seq]) -> torch.Tensor | None:
        """The rows' next logits (B, V); None (with a warning, once) if torch.compile cannot
        build the step: the caller then decodes eagerly, from now on."""
        if self.fn is None:
            return None
        c, bs = self.cache, self.cache.block_size
        rids = [s.rid for s in seqs]
        tables = [c.row_tables[r] for r in rids]
        starts = [c.row_lengths[r] for r in rids]
        for r, start, table in zip(rids, starts, tables, strict=True):
            if c.blocks_for(start + 1) > len(table):
                raise CacheFullError(
                    f"row {r} decodes after {start} tokens without a reserved block: "
                    f"call reserve({r}, 1) first"
                )
        view = self._view(len(seqs), max(len(t) for t in tables))
        b = view.buffers
        rows, width = b.table.shape
        pad = rows - len(seqs)
        host = dict(
            tokens=[s.newest for s in seqs] + [0] * pad,
            positions=starts + [0] * pad,
            write=[t[p // bs] * bs + p % bs for t, p in zip(tables, starts, strict=True)]
            + [SCRATCH * bs] * pad,
            live=[True] * len(seqs) + [False] * pad,
            table=[t + [SCRATCH] * (width - len(t)) for t in tables] + [[SCRATCH] * width] * pad,
        )
        for name, values in host.items():  # host -> the static buffers: copies, no reads
            buf = getattr(b, name)
            buf.copy_(torch.tensor(values, dtype=buf.dtype), non_blocking=True)
        c.selected, c.batch_size = rids, len(rids)
        logits = self._run(rows, width, view)
        if logits is None:
            return None
        for r, start in zip(rids, starts, strict=True):
            c.row_lengths[r] = start + 1
        # a CUDA graph's output is overwritten by its next replay: the caller keeps a copy
        return logits[: len(seqs)].clone() if self.on_cuda else logits[: len(seqs)]


def why_not(model: DecoderOnlyModel, cache: RaggedPagedCache) -> str | None:
    """Why the engine's decode batches cannot take this step by default, or None: the compiled
    step's rules (compiled_step.py), and a CUDA device (on the CPU the native rows and the eager
    batch are faster)."""
    if cache.pool.k.device.type != "cuda":
        return "on the CPU the native rows and the eager batch decode faster"
    return compiled_step.why_not(model)


def for_engine(model: DecoderOnlyModel, cache: RaggedPagedCache) -> BatchStep | None:
    """The engine's step for decode-only batches of `model` on `cache`, or None (`why_not`)."""
    return BatchStep(model, cache) if why_not(model, cache) is None else None
