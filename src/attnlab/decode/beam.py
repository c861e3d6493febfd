"""Beam search with a length penalty, over the model's KV cache.

Beam search keeps the `num_beams` best partial hypotheses by summed log-probability and extends
each by every token (Graves 2012, arXiv:1211.3711; Sutskever et al. 2014, arXiv:1409.3215,
"Decoding and Rescoring"). A finished hypothesis (EOS, or the length limit) is scored
with a length penalty so that short outputs do not win merely by having fewer factors:

    score(y) = log p(y | x) / |y|**alpha          alpha = length_penalty

where |y| counts the generated tokens including EOS (not the prompt, not the decoder start
token). This is the `transformers` form (`generate(num_beams=...)`), which we match token for
token. Wu et al. 2016 (GNMT, arXiv:1609.08144, section 7) divide by ((5 + |y|) / 6)**alpha
instead (and add a coverage penalty); we implement the `transformers` form, not GNMT's.

Each step, per batch item, mirroring `transformers` (`GenerationMixin._beam_search`, read at 5.24):

    1. candidates: the top 2·num_beams (more with several EOS ids) of beam score + log p(token)
       over all beams × vocabulary, so that num_beams unfinished ones always remain;
    2. running beams: the best num_beams candidates that did not finish;
    3. finished hypotheses: a candidate that finished *and* ranks among the first num_beams
       enters the pool of num_beams best finished ones (penalised score), unless the pool is
       full with early_stopping=True, or the item is already done (4);
    4. done: with early_stopping=True once num_beams hypotheses finished; otherwise when the best
       running beam, divided by a hoped-for length, cannot beat the worst finished one. That
       length is the current generated length (early_stopping=False), or the maximum one when
       early_stopping="never" and alpha > 0 (then the bound is exact). The search stops when
       every item is done or the length limit is reached.

The returned rows are the best `num_return_sequences` finished hypotheses per item, cut to the
longest of them; shorter ones are filled with `pad_token_id` (EOS when no pad is given).
`transformers` fills with EOS when pad_token_id is 0 (`pad or eos`); we use the pad id.

A model's own generation settings (`model.generation`, src/attnlab/decode/settings.py) are the
defaults, and the logits rules they switch on (src/attnlab/decode/processors.py: repetition
penalty, no-repeat n-grams, minimum length, forced BOS/EOS, suppressed tokens) run on each
step's log-probabilities before (1), as in `transformers`.

Decoding state: the prompt is run once (decoder-only) or the source encoded once
(encoder-decoder) on B rows; the first reorder expands the cache (self- and cross-attention
K/V) to B·num_beams rows, the encoder states and source mask are repeated once, and each later
step reorders only the self-attention K/V by beam index. Cross-attention K/V are identical
across the beams of one item and beams never leave their item, so they stay in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import Problems
from ..nn.model import EncoderDecoderModel
from .processors import apply
from .settings import MODEL_DEFAULT, check_keywords, resolve
from .steps import decode_step, evaluating, plan, prefill

_NEG = -1.0e9  # "impossible" score, as in transformers (finite, so sums stay ordered)


def _eos_ids(eos_token_id: int | Sequence[int] | None, device) -> torch.Tensor:
    if eos_token_id is None:
        return torch.empty(0, dtype=torch.long, device=device)
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t (B, K, ...) rows picked per item by index (B, K') -> (B, K', ...)."""
    while index.dim() < t.dim():
        index = index.unsqueeze(-1)
    return t.take_along_dim(index, dim=1)


def _check(num_beams: int, num_return_sequences: int, max_new_tokens: int, early_stopping) -> None:
    p = Problems()
    if num_beams < 1:
        p.add(f"num_beams ({num_beams}) must be >= 1")
    if not 1 <= num_return_sequences <= num_beams:
        p.add(
            f"num_return_sequences ({num_return_sequences}) must be in 1..num_beams ({num_beams})"
        )
    if max_new_tokens < 1:
        p.add(f"max_new_tokens ({max_new_tokens}) must be >= 1")
    if early_stopping not in (True, False, "never"):
        p.add(f"early_stopping ({early_stopping!r}) must be True, False or 'never'")
    p.raise_as(ValueError, "beam_search arguments")


_OWN = ("num_beams", "length_penalty", "early_stopping", "attention_mask", "num_return_sequences",
        "cache_kind")  # fmt: skip


@torch.no_grad()
def beam_search(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int | None = None,
    num_beams: int = MODEL_DEFAULT,
    length_penalty: float = MODEL_DEFAULT,
    early_stopping: bool | str = MODEL_DEFAULT,
    eos_token_id: int | Sequence[int] | None = MODEL_DEFAULT,
    pad_token_id: int | None = MODEL_DEFAULT,
    attention_mask: torch.Tensor | None = None,
    decoder_start_token_id: int | None = MODEL_DEFAULT,
    num_return_sequences: int = 1,
    cache_kind: str | None = None,
    **settings,
) -> torch.Tensor:
    """(B, T) prompts (or sources) -> (B·num_return_sequences, P + new) best hypotheses, where P is
    the padded prompt length (decoder-only) or 1, the start token (encoder-decoder).

    The model's own generation settings (`model.generation`) are the defaults: num_beams (else
    4), length_penalty (else 1.0), early_stopping (else False), EOS, pad, start token, the new
    token count (max_new_tokens None: its max_new_tokens / max_length, else 50) and the logits
    rules (src/attnlab/decode/processors.py), applied to the log-probabilities as in
    `transformers`. A keyword given, None included, overrides the model's; `settings` takes the
    other GenerationSettings fields."""
    check_keywords("beam_search", settings, _OWN)
    s = resolve(
        model,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        decoder_start_token_id=decoder_start_token_id,
        **settings,
    )
    if num_beams is MODEL_DEFAULT:
        num_beams = s.num_beams if s.num_beams is not None and s.num_beams > 1 else 4
    if length_penalty is MODEL_DEFAULT:
        length_penalty = s.length_penalty if s.length_penalty is not None else 1.0
    if early_stopping is MODEL_DEFAULT:
        early_stopping = s.early_stopping if s.early_stopping is not None else False
    how = plan(model, input_ids, attention_mask, max_new_tokens, s)
    _check(num_beams, num_return_sequences, how.max_new_tokens, early_stopping)
    with evaluating(model):
        prefix, logits, state = prefill(
            model, input_ids, how.max_new_tokens, attention_mask, how.start, cache_kind
        )
        if isinstance(model, EncoderDecoderModel):  # the decoder reads the source mask per row
            state.memory = state.memory.repeat_interleave(num_beams, dim=0)
            if state.memory_mask is not None:
                state.memory_mask = state.memory_mask.repeat_interleave(num_beams, dim=0)
        return _search(
            model,
            prefix,
            logits,
            state,
            how.max_new_tokens,
            num_beams,
            length_penalty,
            early_stopping,
            _eos_ids(s.eos_token_id, input_ids.device),
            s.pad_token_id,
            num_return_sequences,
            how.processors,
        )


@dataclass
class _Finished:
    """Per item, the num_beams best finished hypotheses (penalised score), best first."""

    seq: torch.Tensor  # (B, N, max_len)
    score: torch.Tensor  # (B, N), _NEG in empty slots
    length: torch.Tensor  # (B, N) generated tokens, EOS included
    filled: torch.Tensor  # (B, N) bool

    def add(self, seq: torch.Tensor, score: torch.Tensor, length: int, ok: torch.Tensor) -> None:
        """Merge candidates seq (B, K, max_len) with penalised `score` (B, K) where `ok`."""
        pool = torch.cat((self.score, score + (~ok).float() * _NEG), dim=1)
        best = pool.topk(self.score.shape[1], dim=-1).indices
        self.seq = _gather(torch.cat((self.seq, seq), dim=1), best)
        self.score = _gather(pool, best)
        self.length = _gather(
            torch.cat((self.length, torch.full_like(ok, length, dtype=torch.long)), 1), best
        )
        self.filled = _gather(torch.cat((self.filled, ok), dim=1), best)

    def beaten_by(self, bound: torch.Tensor) -> torch.Tensor:
        """(B, 1): could a hypothesis scoring `bound` (B, 1) still enter the pool? (Empty slots
        hold _NEG, so a pool with room always says yes.)"""
        return bound > self.score.min(dim=-1, keepdim=True).values


def _search(
    model,
    prefix,
    logits,
    state,
    max_new_tokens,
    num_beams,
    alpha,
    early_stopping,
    eos,
    pad_token_id,
    num_return_sequences,
    processors=(),
) -> torch.Tensor:
    B, P = prefix.shape
    N, dev = num_beams, prefix.device
    max_len = P + max_new_tokens
    K = max(2, 1 + eos.numel()) * N  # candidates kept per item
    top_n = torch.arange(K, device=dev) < N  # only these may enter the finished pool
    fill = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos.numel() else -1)

    running = torch.full((B, N, max_len), fill, dtype=torch.long, device=dev)
    running[:, :, :P] = prefix[:, None]
    running_scores = torch.full((B, N), _NEG, device=dev)
    running_scores[:, 0] = 0.0  # identical beams at first: expand only beam 0
    done = _Finished(
        running.clone(),
        torch.full((B, N), _NEG, device=dev),
        torch.zeros(B, N, dtype=torch.long, device=dev),
        torch.zeros(B, N, dtype=torch.bool, device=dev),
    )
    open_items = torch.ones(B, 1, dtype=torch.bool, device=dev)  # may still improve (4)
    item = torch.arange(B, device=dev)[:, None] * N  # flat row of each item's beam 0

    for cur in range(P, max_len):
        first, n_gen = cur == P, cur + 1 - P
        logp = logits.log_softmax(dim=-1)  # (B·N, V), or (B, V) on the first step
        if processors:  # the beams of an item are identical on the first step: B rows suffice
            seq = prefix if first else running[:, :, :cur].reshape(B * N, cur)
            logp = apply(processors, seq, logp)
        V = logp.shape[-1]
        if first:
            logp = logp.repeat_interleave(N, dim=0)
        # (1) candidates
        cand = (logp.view(B, N, V) + running_scores[:, :, None]).view(B, N * V)
        cand_scores, flat = cand.topk(K, dim=-1)  # (B, K), sorted
        beam, token = flat // V, flat % V
        cand_seq = _gather(running, beam)  # (B, K, max_len)
        cand_seq[:, :, cur] = token
        hits = torch.isin(token, eos) | (cur + 1 >= max_len)  # (B, K) stopping criteria
        # (2) the best num_beams unfinished candidates go on
        go_on = cand_scores + hits.float() * _NEG
        keep = go_on.topk(N, dim=-1).indices
        running, running_scores = _gather(cand_seq, keep), _gather(go_on, keep)
        origin = (item + _gather(beam, keep)).view(-1)  # flat row each new beam extends
        # (3) finished candidates among the first num_beams, penalised by generated length
        ok = hits & top_n & open_items
        if early_stopping is True:
            ok &= ~done.filled.all(dim=-1, keepdim=True)
        done.add(cand_seq, cand_scores / (n_gen**alpha), n_gen, ok)
        # (4) can the best running beam, at the hoped-for length, still enter the pool?
        hoped = max_len - P if (early_stopping == "never" and alpha > 0) else n_gen
        open_items &= done.beaten_by(running_scores[:, :1] / (hoped**alpha))
        all_full = early_stopping is True and bool(done.filled.all())
        if not bool(open_items.any()) or all_full or bool(hits.all()):
            break
        state.cache.reorder(origin // N if first else origin, cross=first)  # first: B -> B·N rows
        logits = decode_step(model, running[:, :, cur].reshape(-1), state)

    out_len = P + int(done.length[:, :num_return_sequences].max())
    return done.seq[:, :num_return_sequences, :out_len].reshape(B * num_return_sequences, out_len)
