"""The engine's scheduler: which requests run this step and how much of each, on the host only,
and the one place where a request's state moves on.

It owns the queues (waiting, running in admission order), the requests' state (`Seq`,
requests.py) and the pool's bookkeeping (blocks reserved, attached from the prefix cache,
freed). A step is vLLM v1's loop, `schedule()` -> execute -> `update(plan, output)`:

    schedule()      the step's `StepPlan`, plain data: the rows that decode one token and the
                    prefill batches, each row (request, n tokens from where its cache ends).
                    Whole-prompt prefill is the same plan with chunks of no budget (each
                    admitted context whole, in groups of similar length); with step_tokens the
                    decodes come first and the prompt chunks get the rest of the token budget,
                    and with max_step only what the fitted costs of both say fits in the time
    update(p, o)    after the runner and the output side ran the plan (engine.py): every row's
                    filled count, each sampled token, prompt log-probabilities, the prefix
                    index, finished requests leaving, the call timings into the fits; returns
                    the step's events

Inside schedule: admit() (waiting requests that join, oldest first, while their blocks fit and
the batch has room; a whole-prompt prefill also bounds its padded tokens), make_room(s) (a block
for s's next token, pre-empting the youngest running requests), ready() and chunks(...) (chunked
prefill). Nothing here reads the device or runs the model: the runner (runner.py) computes what
a plan says and the output side (output.py) turns logits into tokens, as vLLM v1 splits its
engine core into scheduler, model runner and output processor.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..cache.ragged import RaggedPagedCache
from .output import StepOutput
from .requests import Event, Seq
from .step_time import CallCosts

# max_step_ms: after this many steps in a row with prompts pending and no time left for them, one
# block of prompt work runs anyway (at most one step in this many runs over the bound)
HELD_STEPS = 100


@dataclass(frozen=True)
class StepPlan:
    """What one engine step computes, decided before it runs: `decodes` each feed their newest
    token; each of `prefills` is one right-padded batch of rows (request, n), the next n tokens
    of the request's context after the `filled` it had when planned."""

    decodes: tuple[Seq, ...] = ()
    prefills: tuple[tuple[tuple[Seq, int], ...], ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return sum(n for rows in self.prefills for _, n in rows)

    @staticmethod
    def completes(s: Seq, n: int) -> bool:
        """Whether a prefill row of n tokens is the last of s's context (it then samples)."""
        return s.filled + n == s.length


class Scheduler:
    def __init__(
        self,
        cache: RaggedPagedCache,
        *,
        max_batch: int,
        max_prefill_tokens: int,
        step_tokens: int | None,
        max_step: float | None,
    ) -> None:
        """max_step: seconds a step that decodes may take (with step_tokens), or None."""
        self.cache = cache
        self.max_batch, self.max_prefill_tokens = max_batch, max_prefill_tokens
        self.step_tokens, self.max_step = step_tokens, max_step
        self.prefill_costs = CallCosts()  # a prefill call's seconds by its padded tokens
        self.decode_costs = CallCosts()  # a decode call's seconds by its rows
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # in admission order: the last is pre-empted first
        self.preemptions = self.cancelled = 0
        self._held = 0  # steps in a row whose pending prompts max_step gave no time (HELD_STEPS)

    def schedule(self) -> StepPlan:
        """This step's plan (the module docstring). Whole prompts: the admitted requests'
        contexts in groups of similar length, and a decode for every request that was
        running before (each with a block for its token, pre-empting where the pool is out).
        Chunked: every request whose context is in the cache decodes, then prompt chunks fill
        the rest of the budget (tokens; with max_step, the time the fits leave)."""
        if self.step_tokens is None:
            old = list(self.running)
            admitted = self.admit()
            decodes = [s for s in old if self.make_room(s)]
            groups = [
                tuple((s, s.length - s.filled) for s in group if s in self.running)
                for group in by_length(admitted)
            ]
            return StepPlan(tuple(decodes), tuple(g for g in groups if g))
        self.admit()
        ready = self.ready()
        left = None  # no time bound: nothing decodes, or no max_step
        if ready and self.max_step is not None:
            # until a decode call was timed, a row costs what a prompt token does (a prior)
            rows = len(ready)
            spent = self.decode_costs.predict(rows) or self.prefill_costs.predict(rows) or 0.0
            left = self.max_step - spent
        chunks, _ = self.chunks(ready, left)
        return StepPlan(tuple(ready), (tuple(chunks),) if chunks else ())

    def update(self, plan: StepPlan, out: StepOutput) -> list[Event]:
        """The step's results into the requests' state, the only place it moves on: the rows'
        filled counts (and the prefix index over the blocks they filled), the prompt
        log-probabilities scored, each sampled token (and the request leaving, its blocks
        freed, when it finished), the calls' times into the fits. Returns the events, in the
        order the tokens were sampled."""
        rows = [(s, 1) for s in plan.decodes]
        rows += [row for batch in plan.prefills for row in batch]
        for s, n in rows:
            s.filled += n
            self.remember(s)
        for s, scored in out.prompt_logprobs:
            s.prompt_lp.extend(scored)
        events = []
        for s, (token, finish, extra) in out.sampled:
            s.tokens.append(token)
            if s.req.prompt_logprobs is not None and len(s.tokens) == 1:  # its first event
                extra = {**extra, "prompt_logprobs": tuple(s.prompt_lp)}
            if finish is not None:
                self.leave(s)
            events.append(Event(s.rid, token, finish, **extra))
        if out.decode_seconds is not None:
            self.decode_costs.add(len(plan.decodes), out.decode_seconds)
        for tokens, seconds in out.prefill_seconds:
            self.prefill_costs.add(tokens, seconds)
        return events

    def take(self, new: list[Seq], cancelled: set[int]) -> None:
        """Queue the new requests; drop the cancelled ones, running or waiting."""
        self.waiting.extend(new)
        if cancelled:
            for s in [s for s in self.running if s.rid in cancelled]:
                self.leave(s)
                self.cancelled += 1
            kept = deque(s for s in self.waiting if s.rid not in cancelled)
            self.cancelled += len(self.waiting) - len(kept)
            self.waiting = kept

    def admit(self) -> list[Seq]:
        admitted: list[Seq] = []
        longest, headroom = 0, len(self.running)  # a block for each running request's growth
        later: list[Seq] = []  # waiting for a running request to compute their shared start
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

    def _prefix_in_flight(self, seq: Seq) -> bool:
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

    def make_room(self, seq: Seq) -> bool:
        """A block for seq's next token, pre-empting the youngest running requests if the pool is
        out; False if seq itself was pre-empted."""
        while seq in self.running and not self.cache.reserve(seq.rid, 1):
            victim = self.running[-1]
            self.leave(victim)
            victim.filled = 0  # its blocks are gone: recomputed from the start
            if not victim.tokens:  # its prompt log-probabilities too
                victim.prompt_lp.clear()
            self.waiting.appendleft(victim)  # first in line: recomputed as soon as it fits
            self.preemptions += 1
        return seq in self.running

    def leave(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.cache.remove(seq.rid)

    def remember(self, s: Seq) -> None:
        """Index the blocks s has just filled (prefix caching)."""
        if self.cache.unregistered(s.rid):
            self.cache.register(s.rid, s.context)

    def ready(self) -> list[Seq]:
        """Chunked prefill: the requests whose context is in the cache but its last token, each
        with a block for it (pre-empting where the pool is out)."""
        ready = [s for s in self.running if s.filled == s.length - 1]
        return [s for s in ready if self.make_room(s)]

    def chunks(self, ready: list[Seq], left: float | None) -> tuple[list[tuple[Seq, int]], int]:
        """The prompt chunks (request, tokens) of this step after `ready` decoded, and the padded
        batch's width: the step's token budget less the decodes, and with max_step only what the
        fit of earlier prefill calls says fits in `left` seconds (None: no time bound this step,
        as when nothing decoded)."""
        budget = self.step_tokens - len(ready)
        if left is not None:  # what is left of the step's time (step_time.py)
            first = self.cache.block_size  # before any prefill call was timed
            fits = self.prefill_costs.tokens_within(left, first)
            if fits == 0 and self._held >= HELD_STEPS:
                fits = self.cache.block_size
            budget = min(budget, fits)
        decoded = {s.rid for s in ready}
        chunks, width = [], 0  # one padded batch: rows × width ≤ budget (engine.py's docstring)
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
        elif left is not None and any(
            s.rid not in decoded and s.length > s.filled for s in self.running
        ):
            self._held += 1
        return chunks, width


def by_length(seqs: list[Seq], waste: float = 0.25) -> list[list[Seq]]:
    """Prefill groups of similar context lengths: a group's padding stays under `waste` of its
    padded tokens (one padded batch of very different prompts would compute mostly padding)."""
    groups: list[list[Seq]] = []
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
