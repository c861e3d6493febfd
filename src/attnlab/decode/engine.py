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
left (step_time.py), none when not one does: a running stream's inter-token latency stays near
that time, and prompts go in more slowly while many requests decode (Sarathi-Serve's
latency-bound budget). Prompts held back for HELD_STEPS steps in a row get one block anyway (that
step runs over: a bound below a decode step plus the smallest prompt call would otherwise hold
them until the running requests end).

With `prefix_caching` as well, the pool keeps full blocks after their request leaves
(cache/prefix.py): an admitted request takes the cached blocks its context starts with and
prefills only the rest (at least its last token, whose logits it samples from); cached blocks no
request holds are evicted, oldest use first, when the pool runs short. A waiting request whose
prompt starts with full blocks a running request is still computing waits until they are cached
(the requests behind it are admitted meanwhile), so a burst of requests with one system prompt
computes it once.

Every request gets the tokens it would get decoded alone with `attnlab.generate`: its own
positions, only its own keys, and its own `torch.Generator` (seeded sampling draws from one
stream per request, whatever else runs beside it). tests/test_engine.py checks this with
requests arriving at random steps, including a pool small enough to force pre-emption.

The engine is synchronous and not thread-safe except for `submit` and `cancel`, which only queue
work for the next `step`; the server (src/attnlab/serve/worker.py) runs `step` in one thread.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..cache.ragged import RaggedPagedCache
from ..nn.model import DecoderOnlyModel
from .generate import sample_next
from .native_step import for_engine
from .requests import Event, Request, RequestError, check_request
from .step_time import PrefillCosts

__all__ = ["Engine", "Event", "Request", "RequestError"]

# decode steps of at most this many rows take the native step, one row at a time: each row reads
# every weight once, so past a few rows torch's batched matmuls win (SmolLM2-135M, 4-bit, 2
# threads: ~8 ms a row native against 45 ms for a whole eager step of 1 row and 160 ms of 32)
NATIVE_ROWS = 8
# max_step_ms: after this many steps in a row with prompts pending and no time left for them, one
# block of prompt work runs anyway (at most one step in this many runs over the bound)
HELD_STEPS = 100


@dataclass
class _Seq:
    rid: int
    req: Request
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # generated so far
    filled: int = 0  # tokens of `context` the cache holds
    prompt_lp: list = field(default_factory=list)  # prompt_logprobs so far (Request's)

    @property
    def context(self) -> list[int]:
        """What a (re)started prefill runs: the prompt and every generated token."""
        return [*self.req.prompt, *self.tokens]

    @property
    def length(self) -> int:  # len(context), without building it
        return len(self.req.prompt) + len(self.tokens)

    @property
    def newest(self) -> int:  # context[-1]
        return self.tokens[-1] if self.tokens else self.req.prompt[-1]


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
        self.max_step = None if max_step_ms is None else max_step_ms / 1000
        self.clock, self.prefill_costs = clock, PrefillCosts()
        self.last_step = (0, 0)  # the latest step's decode rows and prompt tokens computed
        self._held = 0  # steps in a row whose pending prompts max_step gave no time (HELD_STEPS)
        self.model = model.eval()
        self.device = geometry.device
        self.cache = RaggedPagedCache(
            geometry.shape(0, 0), block_size, num_blocks, prefix_caching=prefix_caching
        )
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.max_positions = model.max_positions
        # a decode step of up to NATIVE_ROWS rows runs row by row in one native call each
        # (native_step.py) where the model allows: a small model's eager step is mostly the
        # dispatch of ~1,000 small ops, which a row's native call does not pay
        self.native = for_engine(model, self.cache)
        self.on_event = on_event
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []  # in admission order: the last is pre-empted first
        self.preemptions = self.cancelled = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._inbox: list[_Seq] = []
        self._cancelled: set[int] = set()

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
            seq = _Seq(next(self._ids), req, gen)
            self._inbox.append(seq)
        return seq.rid

    def cancel(self, rid: int) -> None:
        """Drop request `rid` (thread-safe): its blocks are freed at the start of the next step."""
        with self._lock:
            self._cancelled.add(rid)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._inbox or self._cancelled)

    # --- the engine thread ----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """One scheduler iteration; returns the new tokens (also passed to on_event)."""
        start = self.clock()
        self.last_step = (0, 0)
        self._take_inbox()
        events: list[Event] = []
        if self.step_tokens is not None:
            self._admit()
            self._chunked_step(events, start)
            return events
        old = list(self.running)
        for group in _by_length(self._admit()):
            self._prefill(group, events)
        old = [s for s in old if self._make_room(s)]
        if old:
            self._decode(old, events)
        return events

    def _chunked_step(self, events: list[Event], start: float) -> None:
        """Decode every request whose context is in the cache, then spend the rest of the
        budget (tokens; with max_step, also time) on prompt chunks (admission order)."""
        ready = [s for s in self.running if s.filled == s.length - 1]
        ready = [s for s in ready if self._make_room(s)]
        budget = self.step_tokens - len(ready)
        timed = bool(ready) and self.max_step is not None
        if ready:
            self._decode(ready, events)
        if timed:  # what is left of the step's time (step_time.py)
            left = self.max_step - (self.clock() - start)
            first = self.cache.block_size  # before any prefill call was timed
            fits = self.prefill_costs.tokens_within(left, first)
            if fits == 0 and self._held >= HELD_STEPS:
                fits = self.cache.block_size
            budget = min(budget, fits)
        decoded = {s.rid for s in ready}
        chunks, width = [], 0  # one padded batch: rows × width ≤ budget (the docstring)
        for s in self.running:
            rest = s.length - s.filled
            if s.rid in decoded or rest <= 0:
                continue
            if not chunks:
                width = min(budget, rest)
            if width <= 0 or (len(chunks) + 1) * width > budget:
                break
            chunks.append((s, min(width, rest)))
        if chunks:
            self._held = 0  # steps in a row since a prompt last moved on (HELD_STEPS)
            t = self.clock()
            self._prefill_chunks(chunks, events)
            self.prefill_costs.add(len(chunks) * width, self.clock() - t)
        elif timed and any(s.rid not in decoded and s.length > s.filled for s in self.running):
            self._held += 1

    def _prefill_chunks(self, chunks: list[tuple[_Seq, int]], events: list[Event]) -> None:
        """Each row: the next n tokens of its context onto what the cache holds; rows whose
        context is then complete sample their next token."""
        seqs = [s for s, _ in chunks]
        T = max(n for _, n in chunks)
        ids = torch.zeros(len(seqs), T, dtype=torch.long, device=self.device)
        valid = torch.zeros(len(seqs), T, dtype=torch.bool, device=self.device)
        for b, (s, n) in enumerate(chunks):  # right padding, as _prefill
            ids[b, :n] = torch.tensor(s.context[s.filled : s.filled + n], device=self.device)
            valid[b, :n] = True
        last = torch.tensor([n - 1 for _, n in chunks], device=self.device)
        logits = self._forward(seqs, ids, valid, last, [s.filled for s in seqs])
        self._count(0, sum(n for _, n in chunks))
        done = []
        for b, (s, n) in enumerate(chunks):
            s.filled += n
            self._remember(s)
            if s.filled == s.length:
                done.append(b)
        if done:
            self._emit([seqs[b] for b in done], logits[done], events)

    def run(self, requests: Sequence[Request]) -> list[list[int]]:
        """Serve `requests` to the end; each one's generated tokens (a convenience for tests)."""
        rids = [self.submit(r) for r in requests]
        out: dict[int, list[int]] = {r: [] for r in rids}
        while self.has_work:
            for e in self.step():
                out[e.rid].append(e.token)
        return [out[r] for r in rids]

    def warm_up(self) -> None:
        """One two-token request served and forgotten: the first step builds the native
        kernels (src/attnlab/nn/matvec.py, tens of seconds the first time on a machine) and
        sizes the allocator, so the first client does not wait for that. Its blocks are freed
        when it ends."""
        if self.has_work:
            raise RuntimeError("warm_up runs before the first request")
        self.run([Request(prompt=[0], max_tokens=2)])

    def _take_inbox(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            cancelled, self._cancelled = self._cancelled, set()
        self.waiting.extend(new)
        if cancelled:
            for s in [s for s in self.running if s.rid in cancelled]:
                self._leave(s)
                self.cancelled += 1
            kept = deque(s for s in self.waiting if s.rid not in cancelled)
            self.cancelled += len(self.waiting) - len(kept)
            self.waiting = kept

    def _admit(self) -> list[_Seq]:
        admitted: list[_Seq] = []
        longest, headroom = 0, len(self.running)  # a block for each running request's growth
        later: list[_Seq] = []  # waiting for a running request to compute their shared start
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if self._prefix_in_flight(seq):
                later.append(self.waiting.popleft())
                continue
            n = len(seq.context)
            cost = (len(admitted) + 1) * max(longest, n)  # padded tokens of the prefill batch
            if admitted and cost > self.max_prefill_tokens and self.step_tokens is None:
                break
            if self.cache.available - self.cache.blocks_for(n) < headroom:
                break
            self.cache.add(seq.rid)
            # cached blocks of its context (prefix caching; its last token is always computed)
            limit = (n - 1) // self.cache.block_size if seq.req.prompt_logprobs is None else 0
            seq.filled = self.cache.attach(seq.rid, seq.context, limit)
            if not self.cache.reserve(seq.rid, n - seq.filled):
                self.cache.remove(seq.rid)
                seq.filled = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
            longest = max(longest, n)
        self.waiting.extendleft(reversed(later))  # first in line again, in their order
        return admitted

    def _prefix_in_flight(self, seq: _Seq) -> bool:
        """Prefix caching: whether a running request is still computing full blocks that seq's
        prompt starts with too. seq then waits for them to be cached instead of computing them
        a second time: 32 clients sending one system prompt at once would otherwise each
        prefill it (SGLang's scheduler waits likewise). It never waits on itself or on a
        request that waits."""
        if self.cache.prefix is None or seq.req.prompt_logprobs is not None:
            return False
        bs, mine = self.cache.block_size, seq.req.prompt
        for other in self.running:
            theirs = other.req.prompt
            if other.filled >= len(theirs) or theirs[:bs] != mine[:bs]:
                continue  # its prompt is in, or it starts otherwise
            common = next(
                (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                min(len(mine), len(theirs)),
            )
            if other.filled < (common // bs) * bs:
                return True
        return False

    def _make_room(self, seq: _Seq) -> bool:
        """A block for seq's next token, pre-empting the youngest running requests if the pool is
        out; False if seq itself was pre-empted."""
        while seq in self.running and not self.cache.reserve(seq.rid, 1):
            victim = self.running[-1]
            self._leave(victim)
            victim.filled = 0  # its blocks are gone: recomputed from the start
            if not victim.tokens:  # its prompt log-probabilities too
                victim.prompt_lp.clear()
            self.waiting.appendleft(victim)  # first in line: recomputed as soon as it fits
            self.preemptions += 1
        return seq in self.running

    def _leave(self, seq: _Seq) -> None:
        self.running.remove(seq)
        self.cache.remove(seq.rid)

    def _forward(
        self,
        seqs: list[_Seq],
        ids: torch.Tensor,
        valid: torch.Tensor | None,
        last: torch.Tensor,
        starts: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits (B, V) at position last[b] of each row: the model's forward in its three public
        steps (embed, run, logits), so that the output head runs on one position per row: on
        all T positions of a prefill it would cost a quarter of a small model's work. starts:
        where each row's tokens begin in its context (prefills), for the rows that asked for
        prompt log-probabilities."""
        m = self.model
        self.cache.select([s.rid for s in seqs])
        T = ids.shape[1]
        positions = self.cache.next_position[:, None] + torch.arange(T, device=self.device)
        hidden, _ = m.run(m.embed(ids), positions, valid, self.cache)  # (B, T, d_model)
        if starts is not None:
            for b, s in enumerate(seqs):
                if s.req.prompt_logprobs is not None and not s.tokens:
                    self._prompt_logprobs(s, m.logits(hidden[b, : int(last[b]) + 1]), starts[b])
        rows = torch.arange(len(seqs), device=self.device)
        return m.logits(hidden[rows, last]).float()  # (B, V)

    def _prompt_logprobs(self, s: _Seq, logits: torch.Tensor, start: int) -> None:
        """Log-probabilities of the prompt tokens the logits (n, V) at context positions
        start .. start + n - 1 predict."""
        lp = logits.float().log_softmax(dim=-1)
        k, prompt = s.req.prompt_logprobs, s.req.prompt
        for j in range(lp.shape[0]):
            nxt = start + j + 1  # the prompt token this position predicts
            if nxt >= len(prompt):
                break
            top = lp[j].topk(k) if k else None
            alts = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if k else ()
            s.prompt_lp.append((float(lp[j, prompt[nxt]]), alts))

    def _prefill(self, seqs: list[_Seq], events: list[Event]) -> None:
        ctx = [s.context for s in seqs]
        T = max(len(c) for c in ctx)
        ids = torch.zeros(len(seqs), T, dtype=torch.long, device=self.device)
        valid = torch.zeros(len(seqs), T, dtype=torch.bool, device=self.device)
        for b, c in enumerate(ctx):  # right padding: each row's real tokens first
            ids[b, : len(c)] = torch.tensor(c, device=self.device)
            valid[b, : len(c)] = True
        last = torch.tensor([len(c) - 1 for c in ctx], device=self.device)
        logits = self._forward(seqs, ids, valid, last, [0] * len(seqs))
        self._count(0, sum(len(c) for c in ctx))
        for s, c in zip(seqs, ctx, strict=True):
            s.filled = len(c)
        self._emit(seqs, logits, events)

    def _decode(self, seqs: list[_Seq], events: list[Event]) -> None:
        if self.native is not None and len(seqs) <= NATIVE_ROWS:
            logits = self._native_decode(seqs)
        else:
            # (B, 1): each row's last context token, the one the cache lacks (the newest
            # generated token; with chunked prefill it may be a prompt's last one)
            ids = torch.tensor([[s.newest] for s in seqs], device=self.device)
            last = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
            logits = self._forward(seqs, ids, None, last)
        self._count(len(seqs), 0)
        for s in seqs:
            s.filled += 1
            self._remember(s)
        self._emit(seqs, logits, events)

    def _count(self, rows: int, prompt_tokens: int) -> None:
        r, p = self.last_step
        self.last_step = (r + rows, p + prompt_tokens)

    def _native_decode(self, seqs: list[_Seq]) -> torch.Tensor:
        """The decode step row by row through the native step (native_step.py): each row's
        logits (B, V) as `attnlab.generate` computes them for that request alone."""
        rows = []
        for s in seqs:
            self.cache.select([s.rid])
            token = torch.tensor([s.newest], device=self.device)
            rows.append(self.native.paged(token, self.cache))
        return torch.cat(rows).float()

    def _remember(self, s: _Seq) -> None:
        """Index the blocks s has just filled (prefix caching)."""
        if self.cache.unregistered(s.rid):
            self.cache.register(s.rid, s.context)

    def _emit(self, seqs: list[_Seq], logits: torch.Tensor, events: list[Event]) -> None:
        greedy = logits.argmax(dim=-1).tolist()
        asked = [s.req.logprobs is not None for s in seqs]
        lp = logits.log_softmax(dim=-1) if any(asked) else None  # (B, V), fp32
        for b, s in enumerate(seqs):
            r = s.req
            row = logits[b : b + 1]  # (1, V)
            penalised = (r.presence_penalty or r.frequency_penalty) and s.tokens
            if penalised:  # OpenAI's penalties on what this request has generated so far
                counts = torch.bincount(
                    torch.tensor(s.tokens, device=self.device), minlength=row.shape[-1]
                ).to(row.dtype)
                row = row - r.frequency_penalty * counts - r.presence_penalty * (counts > 0)
            if r.constraint is not None:  # structured output: only what the grammar allows
                row = row.masked_fill(
                    ~r.constraint.allowed(row.shape[-1]).to(row.device), -torch.inf
                )
            if r.temperature > 0:
                token = int(sample_next(row, r.temperature, r.top_k, r.top_p, s.generator)[0])
            elif penalised or r.constraint is not None:
                token = int(row.argmax(dim=-1))
            else:
                token = greedy[b]
            s.tokens.append(token)
            finish = None
            if r.constraint is not None:
                r.constraint.accept(token)
            if token in r.stop_token_ids or (r.constraint is not None and r.constraint.finished):
                finish = "stop"
            elif len(s.tokens) >= r.max_tokens:
                finish = "length"
            if finish is not None:
                self._leave(s)
            extra = {}
            if asked[b]:
                top = lp[b].topk(r.logprobs) if r.logprobs else None
                extra = dict(
                    logprob=float(lp[b, token]),
                    top_logprobs=tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                    if top is not None
                    else (),
                )
            if r.prompt_logprobs is not None and len(s.tokens) == 1:  # its first event
                extra["prompt_logprobs"] = tuple(s.prompt_lp)
            event = Event(s.rid, token, finish, **extra)
            events.append(event)
            if self.on_event is not None:
                self.on_event(event)


def _by_length(seqs: list[_Seq], waste: float = 0.25) -> list[list[_Seq]]:
    """Prefill groups of similar context lengths: a group's padding stays under `waste` of its
    padded tokens (one padded batch of very different prompts would compute mostly padding)."""
    groups: list[list[_Seq]] = []
    real = 0
    for s in sorted(seqs, key=lambda s: len(s.context)):
        n = len(s.context)  # the longest so far: the group pads to it
        if groups and (len(groups[-1]) + 1) * n * (1 - waste) <= real + n:
            groups[-1].append(s)
            real += n
        else:
            groups.append([s])
            real = n
    return groups
