"""The engine's output side: logits (B, V) from the runner (runner.py) become each request's
next token and an `Event`.

Per row, in this order: OpenAI's presence / frequency penalties on what the request generated,
its constraint's mask (structured output), then the pick (greedy, or a draw from the request's
own generator after temperature, top-k and top-p: generate.py's `sample_next`); then the stop
tests (a stop token, the constraint finished, max_tokens) and the log-probabilities the request
asked for (the model's own distribution, before temperature, as vLLM reports them). A finished
request leaves through `on_leave` (the scheduler frees its blocks at once).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .generate import sample_next
from .requests import Event
from .scheduler import Seq


class Output:
    def __init__(self, device, on_leave: Callable[[Seq], None]) -> None:
        self.device, self.on_leave = device, on_leave
        self.on_event: Callable[[Event], None] | None = None

    def emit(self, seqs: list[Seq], logits: torch.Tensor, events: list[Event]) -> None:
        greedy = logits.argmax(dim=-1).tolist()
        asked = [s.req.logprobs is not None for s in seqs]
        lp = logits.log_softmax(dim=-1) if any(asked) else None  # (B, V), fp32
        for b, s in enumerate(seqs):
            token = self._pick(s, logits[b : b + 1], greedy[b])
            s.tokens.append(token)
            r = s.req
            finish = None
            if r.constraint is not None:
                r.constraint.accept(token)
            if token in r.stop_token_ids or (r.constraint is not None and r.constraint.finished):
                finish = "stop"
            elif len(s.tokens) >= r.max_tokens:
                finish = "length"
            if finish is not None:
                self.on_leave(s)
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

    def _pick(self, s: Seq, row: torch.Tensor, greedy: int) -> int:
        """The next token of s from its logits row (1, V); `greedy`: the row's argmax, read with
        the whole batch's."""
        r = s.req
        penalised = (r.presence_penalty or r.frequency_penalty) and s.tokens
        if penalised:  # OpenAI's penalties on what this request has generated so far
            counts = torch.bincount(
                torch.tensor(s.tokens, device=self.device), minlength=row.shape[-1]
            ).to(row.dtype)
            row = row - r.frequency_penalty * counts - r.presence_penalty * (counts > 0)
        if r.constraint is not None:  # structured output: only what the grammar allows
            row = row.masked_fill(~r.constraint.allowed(row.shape[-1]).to(row.device), -torch.inf)
        if r.temperature > 0:
            return int(sample_next(row, r.temperature, r.top_k, r.top_p, s.generator)[0])
        if penalised or r.constraint is not None:
            return int(row.argmax(dim=-1))
        return greedy
