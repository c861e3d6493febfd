"""The engine's output side: logits (B, V) from the runner (runner.py) become each request's
next token, its finish reason and the log-probabilities it asked for.

Per row, in this order: OpenAI's presence / frequency penalties on what the request generated,
its constraint's mask (structured output), then the pick (greedy, or a draw with noise from the
request's own generator after temperature, top-k and top-p: sampler.py's `sample_rows`, one call
for the batch, as `generate` draws for the request alone); then the stop
tests (a stop token, the constraint finished, max_tokens) and the log-probabilities the request
asked for (the model's own distribution, before temperature, as vLLM reports them). It reads
the requests and changes none of them (but a constraint, which follows the tokens it allows):
the scheduler's `update` (scheduler.py) appends the tokens and lets finished requests leave.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .requests import Seq
from .sampler import noise_rows, sample_rows

# one sampled row: (token, finish reason or None, the Event's log-probability fields)
Sampled = tuple[int, str | None, dict]


@dataclass
class StepOutput:
    """What running a step's plan gave (engine.py), for the scheduler's `update`: the rows
    that sampled, in order, each with its `Sampled`; the prompt log-probabilities scored per
    request; the decode call's seconds (None: no decode) and each prefill call's (padded
    tokens, seconds)."""

    sampled: list[tuple[Seq, Sampled]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Seq, list]] = field(default_factory=list)
    decode_seconds: float | None = None
    prefill_seconds: list[tuple[int, float]] = field(default_factory=list)


class Output:
    def __init__(self, device) -> None:
        self.device = device

    def sample(self, seqs: list[Seq], logits: torch.Tensor) -> list[Sampled]:
        """Each row's next token from logits (B, V), its stop tests and the log-probabilities
        it asked for. The tokens come back from the device in one read for the whole batch (and
        the log-probabilities, where asked, in one more)."""
        tokens = self.pick(seqs, logits).tolist()
        asked = [b for b, s in enumerate(seqs) if s.req.logprobs is not None]
        extras = self._logprobs(seqs, logits, tokens, asked) if asked else {}
        out = []
        for b, (s, token) in enumerate(zip(seqs, tokens, strict=True)):
            r = s.req
            finish = None
            if r.constraint is not None:
                r.constraint.accept(token)
            if token in r.stop_token_ids or (r.constraint is not None and r.constraint.finished):
                finish = "stop"
            elif len(s.tokens) + 1 >= r.max_tokens:
                finish = "length"
            out.append((token, finish, extras.get(b, {})))
        return out

    def pick(self, seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor:
        """Every row's next token (B,) on the device, with no read back: penalties and
        constraints on the rows that have them, the argmax on greedy rows, and sample_rows
        (sampler.py) on the others, each drawing its noise from its request's generator."""
        B, V = logits.shape
        reqs = [s.req for s in seqs]
        rows = [
            b
            for b, s in enumerate(seqs)
            if s.tokens and (reqs[b].presence_penalty or reqs[b].frequency_penalty)
        ]
        if rows:  # OpenAI's penalties on what each of these requests has generated so far
            logits = logits - self._penalties(seqs, rows, B, V, logits.dtype)
        rows = [b for b, r in enumerate(reqs) if r.constraint is not None]
        if rows:  # structured output: only what the grammar allows
            allowed = torch.ones(B, V, dtype=torch.bool)
            for b in rows:
                allowed[b] = reqs[b].constraint.allowed(V)
            logits = logits.masked_fill(~allowed.to(self.device), -torch.inf)
        tokens = logits.argmax(dim=-1)
        drawn = [b for b, r in enumerate(reqs) if r.temperature > 0]
        if not drawn:
            return tokens
        picked = [reqs[b] for b in drawn]
        idx = torch.tensor(drawn, device=self.device)
        dtype, dev = logits.dtype, self.device
        k = [r.top_k if r.top_k is not None and r.top_k < V else V for r in picked]
        p = [r.top_p if r.top_p is not None and r.top_p < 1.0 else 2.0 for r in picked]
        noise = noise_rows([seqs[b].generator for b in drawn], V, dev)
        got = sample_rows(
            logits[idx],
            torch.tensor([r.temperature for r in picked], dtype=dtype, device=dev),
            noise,
            torch.tensor(k, device=dev) if min(k) < V else None,
            torch.tensor(p, dtype=dtype, device=dev) if min(p) < 1.0 else None,
        )
        return tokens.index_copy(0, idx, got)

    def _penalties(self, seqs: list[Seq], rows: list[int], B: int, V: int, dtype) -> torch.Tensor:
        """(B, V): frequency_penalty · count + presence_penalty · (count > 0) of each token in
        what rows[i] generated; zero on the other rows."""
        longest = max(len(seqs[b].tokens) for b in rows)
        ids = torch.full((len(rows), longest), V, dtype=torch.long)  # column V: padding
        for i, b in enumerate(rows):
            ids[i, : len(seqs[b].tokens)] = torch.tensor(seqs[b].tokens)
        ids = ids.to(self.device)
        counts = torch.zeros(len(rows), V + 1, dtype=dtype, device=self.device)
        counts = counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=dtype))[:, :V]
        freq = torch.tensor([seqs[b].req.frequency_penalty for b in rows], dtype=dtype)
        pres = torch.tensor([seqs[b].req.presence_penalty for b in rows], dtype=dtype)
        rowwise = freq.to(self.device)[:, None] * counts + pres.to(self.device)[:, None] * (
            counts > 0
        )
        out = torch.zeros(B, V, dtype=dtype, device=self.device)
        return out.index_copy_(0, torch.tensor(rows, device=self.device), rowwise)

    def _logprobs(
        self, seqs: list[Seq], logits: torch.Tensor, tokens: list[int], asked: list[int]
    ) -> dict[int, dict]:
        """The log-probabilities the rows `asked` want (the model's own distribution, before
        penalties and temperature): each row's token's and its top ones', in one read."""
        lp = logits[asked].log_softmax(dim=-1)  # (A, V), fp32
        idx = torch.arange(len(asked), device=lp.device)
        chosen = lp[idx, torch.tensor([tokens[b] for b in asked], device=lp.device)]
        k = max(seqs[b].req.logprobs for b in asked)
        top = lp.topk(k)  # k = 0: empty
        # one read, in float64 (exact for fp32 values and for ids): (A, 1 + 2k) the token's
        # log-probability, the top ones' and their ids
        parts = (chosen[:, None], top.values, top.indices)
        rows = torch.cat([t.double() for t in parts], dim=1).tolist()
        out = {}
        for i, b in enumerate(asked):
            n, row = seqs[b].req.logprobs, rows[i]
            ids = [int(t) for t in row[1 + k : 1 + k + n]]
            out[b] = dict(logprob=row[0], top_logprobs=tuple(zip(ids, row[1 : 1 + n], strict=True)))
        return out
