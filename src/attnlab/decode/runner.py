"""The engine's model runner: a plan's inputs built as tensors and run through the model.

    prefill(rows)     one right-padded batch: the next n tokens of each row's context onto what
                      the cache holds (a whole context from 0 where the cache holds none)
    decode(seqs)      each row's newest token through the step the picker gave (picker.py: on
                      CUDA the compiled graph of the batch's size bucket, batch_step.py; on the
                      CPU up to NATIVE_ROWS rows one by one through the native step,
                      native_step.py, where the model is that function); else, or for a batch
                      that step does not take, one batched forward

Each returns the logits (B, V) at every row's last real position, computed through the model's
public inference API (embed, run on the pool, logits at the positions picked), so the output
head runs on one position per row. Rows that asked for prompt log-probabilities get them scored
here, from the hidden states only this side has (returned, for the scheduler's `update`). The
scheduler (scheduler.py) decides what runs; the output side (output.py) turns the logits into
tokens. Nothing here changes a request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.ragged import RaggedPagedCache
from ..nn.model import DecoderOnlyModel
from .picker import pick
from .requests import Seq


class Runner:
    def __init__(self, model: DecoderOnlyModel, cache: RaggedPagedCache, device) -> None:
        self.model, self.cache, self.device = model, cache, device
        # the decode step (picker.py): on CUDA compiled graphs in size buckets; on the CPU
        # small batches row by row in one native call each, where the model allows (a small
        # model's eager step is mostly the dispatch of ~1,000 small ops, which a native call
        # does not pay)
        self.picked = pick(model, cache)
        self.step = self.picked.step

    def _padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids and validity (B, T), right-padded (each row's real tokens first), and each row's
        last real position (B,)."""
        T = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long, device=self.device)
        valid = torch.zeros(len(rows), T, dtype=torch.bool, device=self.device)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = torch.tensor(r, device=self.device)
            valid[b, : len(r)] = True
        last = torch.tensor([len(r) - 1 for r in rows], device=self.device)
        return ids, valid, last

    def prefill(
        self, rows: Sequence[tuple[Seq, int]]
    ) -> tuple[torch.Tensor, list[tuple[Seq, list]]]:
        """Logits (B, V) at each row's last new token, and the prompt log-probabilities scored
        for the rows that asked for them."""
        seqs = [s for s, _ in rows]
        ids, valid, last = self._padded([s.context[s.filled : s.filled + n] for s, n in rows])
        return self._forward(seqs, ids, valid, last, [s.filled for s in seqs])

    def decode(self, seqs: list[Seq]) -> torch.Tensor:
        logits = self.step(seqs) if self.step is not None else None
        if logits is not None:
            return logits
        # (B, 1): each row's last context token, the one the cache lacks (the newest generated
        # token; with chunked prefill it may be a prompt's last one)
        ids = torch.tensor([[s.newest] for s in seqs], device=self.device)
        last = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
        return self._forward(seqs, ids, None, last)[0]

    def _forward(
        self,
        seqs: list[Seq],
        ids: torch.Tensor,
        valid: torch.Tensor | None,
        last: torch.Tensor,
        starts: list[int] | None = None,
    ) -> tuple[torch.Tensor, list[tuple[Seq, list]]]:
        """Logits (B, V) at position last[b] of each row: the model's forward in its three public
        steps (embed, run, logits), so that the output head runs on one position per row: on
        all T positions of a prefill it would cost a quarter of a small model's work. starts:
        where each row's tokens begin in its context (prefills), for the rows that asked for
        prompt log-probabilities: those come second, (request, [(logprob, top), ...])."""
        m = self.model
        self.cache.select([s.rid for s in seqs], [s.filled for s in seqs])  # the plan's
        T = ids.shape[1]
        positions = self.cache.next_position[:, None] + torch.arange(T, device=self.device)
        hidden, _ = m.run(m.embed(ids), positions, valid, self.cache)  # (B, T, d_model)
        scored = []
        if starts is not None:
            for b, s in enumerate(seqs):
                if s.req.prompt_logprobs is not None and not s.tokens:
                    lp = _prompt_logprobs(s, m.logits(hidden[b, : int(last[b]) + 1]), starts[b])
                    scored.append((s, lp))
        rows = torch.arange(len(seqs), device=self.device)
        return m.logits(hidden[rows, last]).float(), scored  # (B, V)


def _prompt_logprobs(s: Seq, logits: torch.Tensor, start: int) -> list:
    """Log-probabilities of the prompt tokens the logits (n, V) at context positions
    start .. start + n - 1 predict: [(logprob, ((token, logprob), ...)), ...]."""
    lp = logits.float().log_softmax(dim=-1)
    k, prompt = s.req.prompt_logprobs, s.req.prompt
    out = []
    for j in range(lp.shape[0]):
        nxt = start + j + 1  # the prompt token this position predicts
        if nxt >= len(prompt):
            break
        top = lp[j].topk(k) if k else None
        alts = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if k else ()
        out.append((float(lp[j, prompt[nxt]]), alts))
    return out
