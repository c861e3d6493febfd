"""The logits rules a model's generation settings switch on (src/attnlab/decode/settings.py).

Each rule is a small callable `(seq (R, L), scores (R, V)) -> scores (R, V)`: `seq` holds each
row's tokens so far (the padded prompt of a decoder-only model, or the decoder start token and
what followed it), `scores` the next token's logits (greedy, sampling) or log-probabilities
(beam search, where R = B·num_beams). A banned token gets -inf. `build_processors` lists the
rules in the order `transformers` applies them (`GenerationMixin._get_logits_processor`, read at
5.24), so greedy, sampling and beam search share one list and give its tokens:

    RepetitionPenalty  seen tokens: score / p if positive, score · p if negative
                       (Keskar et al. 2019, CTRL, arXiv:1909.05858, section 4.1)
    NoRepeatNGram      no n-gram twice: ban what followed the last n-1 tokens before
                       (Paulus et al. 2017, arXiv:1705.04304, section 2.5: trigrams)
    MinLength          no EOS while the sequence is shorter than min_length (prompt included)
    MinNewTokens       no EOS before min_new_tokens generated tokens
    ForcedBOS          the first generated token (mBART's target-language code)
    ForcedEOS          the last token at max_length (BART: hypotheses end, even when cut)
    Suppress           never these tokens (Whisper, Radford et al. 2022, arXiv:2212.04356)
    SuppressAtBegin    not these tokens first (Whisper: no blank or EOS at the start)

Sampling's temperature / top-k / top-p (`sample_next` in src/attnlab/decode/generate.py) come
after all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .settings import GenerationSettings

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_INF = float("inf")


def _vocab_mask(ids: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
    """(V,) True at `ids` (ids outside the vocabulary are ignored)."""
    V = scores.shape[-1]
    want = torch.tensor(list(ids), dtype=torch.long, device=scores.device)
    return torch.isin(torch.arange(V, device=scores.device), want)


def _only(ids: Sequence[int], scores: torch.Tensor) -> torch.Tensor:
    """Scores that allow `ids` alone (0 there, -inf elsewhere)."""
    return torch.zeros_like(scores).masked_fill(~_vocab_mask(ids, scores), -_INF)


@dataclass(frozen=True)
class RepetitionPenalty:
    penalty: float
    skip: torch.Tensor | None = None  # (B,) leading positions per prompt not counted (left padding)

    def __call__(self, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        R, V = scores.shape
        ids = seq.clamp(max=V)  # column V collects what is not counted
        if self.skip is not None:
            skip = self.skip.to(seq.device).repeat_interleave(R // self.skip.numel())  # beams
            pos = torch.arange(seq.shape[1], device=seq.device)
            ids = ids.masked_fill(pos[None, :] < skip[:, None], V)
        seen = torch.zeros(R, V + 1, dtype=torch.bool, device=scores.device)
        seen = seen.scatter_(1, ids, True)[:, :V]  # (R, V)
        penalised = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)
        return torch.where(seen, penalised, scores)


@dataclass(frozen=True)
class NoRepeatNGram:
    n: int

    def __call__(self, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        R, V = scores.shape
        L = seq.shape[1]
        if self.n > L:  # no whole n-gram yet
            return scores
        grams = seq.unfold(1, self.n, 1)  # (R, L - n + 1, n) every n-gram so far
        tail = seq[:, L - self.n + 1 :]  # (R, n - 1) the tokens the next one would extend
        continues = (grams[..., :-1] == tail[:, None, :]).all(dim=-1)  # (R, L - n + 1)
        nxt = torch.where(continues, grams[..., -1].clamp(max=V), V)  # banned next tokens, or V
        banned = torch.zeros(R, V + 1, dtype=torch.bool, device=scores.device)
        return scores.masked_fill(banned.scatter_(1, nxt, True)[:, :V], -_INF)


@dataclass(frozen=True)
class MinLength:
    min_length: int
    eos: tuple[int, ...]

    def __call__(self, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if seq.shape[1] >= self.min_length:
            return scores
        return scores.masked_fill(_vocab_mask(self.eos, scores), -_INF)


@dataclass(frozen=True)
class MinNewTokens:
    prompt_length: int
    min_new_tokens: int
    eos: tuple[int, ...]

    def __call__(self, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if seq.shape[1] - self.prompt_length >= self.min_new_tokens:
            return scores
        return scores.masked_fill(_vocab_mask(self.eos, scores), -_INF)


@dataclass(frozen=True)
class ForcedBOS:
    token: int

    def __call__(self, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return _only((self.token,), scores) if seq.shape[1] == 1 else scores


@dataclass(frozen=True)
class ForcedEOS:
    max_length: int
    eos: tuple[int, ...]

    def __call__(self, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return _only(self.eos, scores) if seq.shape[1] == self.max_length - 1 else scores


@dataclass(frozen=True)
class Suppress:
    tokens: tuple[int, ...]

    def __call__(self, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.masked_fill(_vocab_mask(self.tokens, scores), -_INF)


@dataclass(frozen=True)
class SuppressAtBegin:
    tokens: tuple[int, ...]
    begin_index: int  # the sequence length at which the first free token is chosen

    def __call__(self, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if seq.shape[1] != self.begin_index:
            return scores
        return scores.masked_fill(_vocab_mask(self.tokens, scores), -_INF)


def build_processors(
    s: GenerationSettings,
    prompt_length: int,
    max_length: int,
    skip: torch.Tensor | None = None,
) -> list[Processor]:
    """The rules `s` switches on, in `transformers`' order. `prompt_length`: the padded prompt
    (decoder-only) or 1 (encoder-decoder: the start token); `max_length`: prompt_length plus the
    new tokens; `skip` (B,): leading prompt positions the repetition penalty ignores (left
    padding; transformers reads them off the attention mask)."""
    eos = s.eos_ids()
    out: list[Processor] = []
    if s.repetition_penalty is not None and s.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(s.repetition_penalty, skip))
    if s.no_repeat_ngram_size:
        out.append(NoRepeatNGram(s.no_repeat_ngram_size))
    if eos and s.min_new_tokens:  # wins over min_length, as in transformers
        out.append(MinNewTokens(prompt_length, s.min_new_tokens, eos))
    elif eos and s.min_length:
        out.append(MinLength(s.min_length, eos))
    if s.forced_bos_token_id is not None:
        out.append(ForcedBOS(s.forced_bos_token_id))
    if s.forced_eos_token_id is not None:
        forced = s.forced_eos_token_id
        out.append(ForcedEOS(max_length, (forced,) if isinstance(forced, int) else forced))
    if s.suppress_tokens:
        out.append(Suppress(s.suppress_tokens))
    if s.begin_suppress_tokens:
        first_free = prompt_length + (prompt_length == 1 and s.forced_bos_token_id is not None)
        out.append(SuppressAtBegin(s.begin_suppress_tokens, first_free))
    return out


def apply(processors: Sequence[Processor], seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Every rule in turn on scores (R, V) for sequences (R, L)."""
    for rule in processors:
        scores = rule(seq, scores)
    return scores
