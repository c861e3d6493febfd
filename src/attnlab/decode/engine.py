"""Continuous batching over one paged KV pool (Orca, Yu et al. 2022, OSDI, section 3.2:
iteration-level scheduling; vLLM, Kwon et al. 2023, arXiv:2309.06180, section 4.5: pre-emption
by recomputation).

A static batch runs until its longest request ends, so short requests wait and their slots idle.
Here the batch is re-formed at every step:

    step()  1. admit waiting requests, oldest first, while their blocks fit and the batch has room
            2. prefill them in groups of similar length (right-padded; each row its own
               positions 0, 1, ...) and sample each one's first token from its last position
            3. one decode step for every request that was already running: it takes one slot;
               when the pool has no block for it, the youngest running request is pre-empted
               (its blocks freed at once, its prompt + generated tokens recomputed when it is
               admitted again; its random generator keeps its state, so nothing changes)
            4. requests that hit a stop token or max_tokens leave and free their blocks at once

With `step_tokens` set (chunked prefill, Agrawal et al. 2024, arXiv:2403.02310, Sarathi: vLLM's
max_num_batched_tokens), a step spends a token budget instead: every running request's decode
token first, then chunks of the admitted prompts in admission order, each continuing where the
cache holds its context up to (`filled`); a request's first token is sampled when its last chunk
is in. One long prompt no longer holds every running request for its whole prefill. The chunks
of a step are rows of one right-padded batch, so the budget bounds the padded tokens: the first
chunk sets the width and the next prompts join with at most as many tokens while rows × width
stays within the budget (chunks of 200, 150, 100 and 62 tokens had computed 800 for 512).
With `max_step_ms` as well, a step that decodes also bounds its time: the decodes run first and
the prompt chunks get the tokens that a fit of the engine's own prefill calls says fit in what is
left (step_time.py: both predicted before the step, from fits of the engine's own calls), none
when not one does: a running stream's inter-token latency stays near
that time, and prompts go in more slowly while many requests decode (Sarathi-Serve's
latency-bound budget). Prompts held back for HELD_STEPS (scheduler.py) steps in a row get one
block anyway (that step runs over: a bound below a decode step plus the smallest prompt call
would otherwise hold them until the running requests end).

With `prefix_caching` as well, the pool keeps full blocks after their request leaves
(cache/prefix.py): an admitted request takes the cached blocks its context starts with and
prefills only the rest (at least its last token, whose logits it samples from); cached blocks no
request holds are evicted, oldest use first, when the pool runs short. A waiting request whose
prompt starts with full blocks a running request is still computing waits until they are cached
(the requests behind it are admitted meanwhile), so a burst of requests with one system prompt
computes it once.

Every request gets the tokens it would get decoded alone with `attnlab.generate`: its own
positions, only its own keys, and its own `torch.Generator` (seeded sampling draws from one
stream per request, whatever else runs beside it). tests/decode/test_engine.py checks this with
requests arriving at random steps, including a pool small enough to force pre-emption.

The engine is three parts, as vLLM v1's engine core: the scheduler (scheduler.py: queues,
admission, prefix cache, pre-emption, the step's token and time budget, and the requests' state;
host only), the runner (runner.py: a plan's inputs as tensors, the model on the pool, the decode
step the picker gave) and the output side (output.py: penalties, constraints, sampling,
log-probabilities, stop tests). This class holds them together: the thread-safe inbox, and
`step`: `plan = scheduler.schedule()`, the runner and the output side run it into a
`StepOutput`, `scheduler.update(plan, output)` moves every request on (the only writer of
request state) and returns the events.

The engine is synchronous and not thread-safe except for `submit` and `cancel`, which only queue
work for the next `step`; the server (src/attnlab/serve/worker.py) runs `step` in one thread.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..cache.ragged import RaggedPagedCache
from ..graphs import compiled_graphs
from ..nn.model import DecoderOnlyModel
from .batch_step import BatchStep
from .native_step import NATIVE_ROWS
from .output import Output, StepOutput
from .requests import Event, Request, RequestError, Seq, check_request
from .runner import Runner
from .scheduler import Scheduler, StepPlan

__all__ = ["NATIVE_ROWS", "Engine", "Event", "Request", "RequestError"]


def _up_to(n: int) -> list[int]:
    """The powers of 2 below n, and n: 48 -> [1, 2, 4, 8, 16, 32, 48]."""
    return [1 << i for i in range(n.bit_length()) if 1 << i < n] + [n]


class Engine:
    def __init__(
        self,
        model: nn.Module,
        num_blocks: int = 512,
        block_size: int = 16,
        max_batch: int = 64,
        max_prefill_tokens: int = 4096,
        on_event: Callable[[Event], None] | None = None,
        step_tokens: int | None = None,
        prefix_caching: bool = False,
        max_step_ms: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """num_blocks · block_size tokens of KV memory shared by every request; max_batch rows
        decode together; a prefill runs at most max_prefill_tokens (rows × longest prompt, at
        least one request) so running requests keep decoding while long prompts arrive.
        step_tokens: chunked prefill, each step's token budget (decodes first, then prompt
        chunks; the module docstring); None prefills each prompt whole. prefix_caching: reuse
        cached full blocks of earlier contexts (needs step_tokens). max_step_ms: with
        step_tokens, a step that decodes gives its prompt chunks only what fits in this time
        (step_time.py); clock: its timer, in seconds (tests pass their own)."""
        if not isinstance(model, DecoderOnlyModel):
            raise TypeError(
                f"the engine serves decoder-only models, got {type(model).__name__} "
                "(encoder-decoder models: use attnlab.generate per request)"
            )
        geometry = model.cache_geometry()
        if geometry.kind != "static":
            raise TypeError(
                f"the engine needs softmax attention with a KV cache; this model decodes from "
                f"a {geometry.kind!r} state"
            )
        limits = [("max_batch", max_batch), ("max_prefill_tokens", max_prefill_tokens)]
        for name, value in [*limits, ("step_tokens", step_tokens or 1)]:
            if value < 1:
                raise ValueError(f"{name} ({value}) must be >= 1")
        if step_tokens is not None and step_tokens <= max_batch:
            raise ValueError(
                f"step_tokens ({step_tokens}) must exceed max_batch ({max_batch}): every running "
                f"request decodes one token per step, and prompts need the rest"
            )
        if max_step_ms is not None and (step_tokens is None or not 0 < max_step_ms < math.inf):
            raise ValueError(
                f"max_step_ms ({max_step_ms}) bounds chunked prefill's steps: it needs "
                "step_tokens and a finite time > 0"
            )
        if prefix_caching and step_tokens is None:
            raise ValueError(
                "prefix_caching continues a prompt where its cached blocks end: it needs "
                "chunked prefill (step_tokens)"
            )
        self.step_tokens = step_tokens
        self.clock = clock
        self.last_step = (0, 0)  # the latest step's decode rows and prompt tokens computed
        self.model = model.eval()
        self.device = geometry.device
        self.cache = RaggedPagedCache(
            geometry.shape(0, 0), block_size, num_blocks, prefix_caching=prefix_caching
        )
        self.max_positions = model.max_positions
        self.scheduler = Scheduler(
            self.cache,
            max_batch=max_batch,
            max_prefill_tokens=max_prefill_tokens,
            step_tokens=step_tokens,
            max_step=None if max_step_ms is None else max_step_ms / 1000,
        )
        self.runner = Runner(self.model, self.cache, self.device)
        self.output = Output(self.device)
        self.on_event = on_event
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._inbox: list[Seq] = []
        self._cancelled: set[int] = set()
        self.started_at_compiles = compiled_graphs()  # renewed by warm_up

    # what the server and the tests read: the scheduler's queues and counts, the runner's step
    running = property(lambda self: self.scheduler.running)
    waiting = property(lambda self: self.scheduler.waiting)
    preemptions = property(lambda self: self.scheduler.preemptions)
    cancelled = property(lambda self: self.scheduler.cancelled)
    decode_step = property(lambda self: self.runner.picked)  # picker.py's Picked

    # --- the thread-safe side -------------------------------------------------------------------

    def check(self, req: Request, *, context: int | None = None) -> None:
        """RequestError naming the problem and the field if `req` can never be served by this
        engine (requests.py: check_request). context: a tighter cap on prompt + max_tokens
        than the engine's own (the server's max_model_len)."""
        check_request(
            req,
            vocab_size=self.model.vocab_size,
            max_positions=self.max_positions,
            block_size=self.cache.block_size,
            num_blocks=self.cache.num_blocks,
            context=context,
        )

    def submit(self, req: Request, *, context: int | None = None) -> int:
        """Queue a request (thread-safe); returns its id. Checked here (`check`, with
        `context`), so a bad one never reaches `step`."""
        self.check(req, context=context)
        gen = None
        if req.temperature > 0 and req.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(req.seed)
        with self._lock:
            seq = Seq(next(self._ids), req, gen)
            self._inbox.append(seq)
        return seq.rid

    def cancel(self, rid: int) -> None:
        """Drop request `rid` (thread-safe): its blocks are freed at the start of the next step."""
        with self._lock:
            self._cancelled.add(rid)

    @property
    def queued(self) -> int:
        """Requests submitted and not running (thread-safe): the inbox, which the next step
        takes, and the scheduler's queue (pre-empted requests included). The server bounds it
        (`attnlab serve --max-waiting`): counting the scheduler's queue alone missed every
        request submitted while a step ran."""
        with self._lock:
            return len(self._inbox) + len(self.scheduler.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._inbox or self._cancelled)

    # --- the engine thread ----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """One iteration, vLLM v1's loop: the scheduler's plan (`schedule`), run by the runner and
        the output side (decodes first, then each prefill batch), its results taken in by the
        scheduler's `update`, the one writer of request state. Returns the new tokens (also
        passed to on_event)."""
        self._take_inbox()
        plan = self.scheduler.schedule()
        out = StepOutput()
        if plan.decodes:
            self._decode(plan.decodes, out)
        for rows in plan.prefills:
            self._prefill(rows, out)
        self.last_step = (len(plan.decodes), plan.prompt_tokens)
        events = self.scheduler.update(plan, out)
        if self.on_event is not None:
            for event in events:
                self.on_event(event)
        return events

    def _decode(self, seqs: Sequence[Seq], out: StepOutput) -> None:
        """Each row's newest token through the runner's decode step, its next token sampled;
        the call timed (the scheduler's fit of decode costs)."""
        start, seqs = self.clock(), list(seqs)
        out.sampled += zip(seqs, self.output.sample(seqs, self.runner.decode(seqs)), strict=True)
        out.decode_seconds = self.clock() - start

    def _prefill(self, rows: Sequence[tuple[Seq, int]], out: StepOutput) -> None:
        """One padded batch of prompt chunks; the rows whose context it completes sample their
        next token. Timed by its padded tokens (the scheduler's fit of prefill costs)."""
        start = self.clock()
        logits, scored = self.runner.prefill(rows)
        out.prompt_logprobs += scored
        done = [b for b, (s, n) in enumerate(rows) if StepPlan.completes(s, n)]
        if done:
            seqs = [rows[b][0] for b in done]
            out.sampled += zip(seqs, self.output.sample(seqs, logits[done]), strict=True)
        padded = len(rows) * max(n for _, n in rows)
        out.prefill_seconds.append((padded, self.clock() - start))

    def run(self, requests: Sequence[Request]) -> list[list[int]]:
        """Serve `requests` to the end; each one's generated tokens (a convenience for tests)."""
        rids = [self.submit(r) for r in requests]
        out: dict[int, list[int]] = {r: [] for r in rids}
        while self.has_work:
            for e in self.step():
                out[e.rid].append(e.token)
        return [out[r] for r in rids]

    def warm_up(
        self,
        rows: Sequence[int] | None = None,
        widths: Sequence[int] | None = None,
        say: Callable[[str], None] | None = None,
        max_len: int | None = None,
    ) -> None:
        """Before the first request. Where decode steps are compiled graphs (CUDA), first every
        graph of `capture_sizes(rows, widths, max_len)` is compiled and captured (batch_step.py
        `capture`; `say` gets a progress line each and the time it took: on a GPU each is a
        compile of the model, tens of seconds, so the default lists of a long-context model
        cost minutes; pass shorter ones); then one-token requests are served and forgotten, in
        batches of each captured row count (a one-token prompt reads the pool in place outside
        the graphs: paged-flex on CUDA, one flex graph per padded batch), or one request
        without graphs. The first step builds the native kernels (src/attnlab/nn/matvec.py,
        tens of seconds the first time on a machine) and sizes the allocator.
        `compiles_since_start` counts the graphs compiled after this: a size beyond the lists,
        or on CUDA a prompt of more than 16 tokens, whose flex graph is compiled once per
        (rows, length bucket) when first met (nn/attention/kernels/flex_buckets.py)."""
        if self.has_work:
            raise RuntimeError("warm_up runs before the first request")
        say = say or (lambda line: None)
        graphs, batches = self.runner.step, [1]
        if isinstance(graphs, BatchStep):
            # default sizes leave out rows × width past the pool's blocks: such a step gathers
            # more K/V per layer than the pool holds (rows far apart in length); if one comes,
            # it compiles then (counted)
            limit = self.cache.num_blocks if widths is None else None
            rows, widths = self.capture_sizes(rows, widths, max_len)
            seconds = graphs.capture(rows, widths, say, max_blocks=limit)
            if graphs.fn is None:
                say(f"decode graphs: could not be compiled ({seconds:.1f} s); decoding eagerly")
            else:
                say(f"decode graphs: {len(graphs.captured)} compiled in {seconds:.1f} s")
                batches = [r for r in rows if r <= self.scheduler.max_prefill_tokens]
        for n in batches:
            self.run([Request(prompt=[0], max_tokens=2) for _ in range(n)])
        self.started_at_compiles = compiled_graphs()

    def capture_sizes(
        self,
        rows: Sequence[int] | None = None,
        widths: Sequence[int] | None = None,
        max_len: int | None = None,
    ) -> tuple[list[int], list[int]]:
        """The decode graphs' sizes: batch rows (default: the powers of 2 below max_batch, and
        max_batch) and block-table widths (default: the same up to the blocks of the longest
        request the engine admits: max_len, the model's positions and the pool, in blocks)."""
        c = self.cache
        tokens = [n for n in (max_len, self.max_positions) if n is not None]
        longest = min([c.num_blocks, *(-(-n // c.block_size) for n in tokens)])
        return list(rows or _up_to(self.scheduler.max_batch)), list(widths or _up_to(longest))

    @property
    def compiles_since_start(self) -> int:
        """Graphs torch.compile built in this process since `warm_up` (the server's /metrics:
        0 when every step size was captured at start)."""
        return compiled_graphs() - self.started_at_compiles

    def _take_inbox(self) -> None:
        with self._lock:  # moved in one piece: `queued` never sees them in neither queue
            new, self._inbox = self._inbox, []
            cancelled, self._cancelled = self._cancelled, set()
            self.scheduler.take(new, cancelled)
