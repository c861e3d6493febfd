"""Greedy and sampled decoding as free functions over an explicit cache.

    sample_next     one token per row from logits: temperature, top-k, top-p (sampler.py)
    stream          greedy / sample, yielding each step's tokens as they come
    sliding_stream  past a learned position table: recompute the last `window` tokens each step
    generate        greedy / sample / beam (beam.py), returning whole sequences

All of them are loops over `prefill` and `decode_step` (steps.py), which own the cache.

Decoder-only models return the prompt followed by the new tokens; encoder-decoder models return
the decoder sequence, starting with the decoder start token (as `transformers` does). Batched
prompts of different lengths are left-padded: positions count real tokens only, so each row
decodes exactly as it would alone. A finished row (EOS) keeps emitting `pad_token_id`.

A model's own generation settings (`model.generation`, src/attnlab/decode/settings.py: start
token, EOS, pad, forced BOS/EOS, minimum length, repetition penalty, no-repeat n-grams,
suppressed tokens, beams...) are the defaults of every function here; keywords override them.
The logits rules they switch on (src/attnlab/decode/processors.py) run before the argmax or the
sampling warpers, in `transformers`' order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..errors import check_choice
from ..nn.model import DecoderOnlyModel, EncoderDecoderModel
from .beam import beam_search
from .processors import apply
from .sampler import sample_next
from .settings import MODEL_DEFAULT, check_keywords, resolve, settings_of
from .steps import Plan, decode_step, evaluating, plan, prefill

# tokens decoded between two reads of the stop test on a GPU (each read waits for the device);
# finished rows emit the fill token meanwhile, and no token past the stop is yielded
GPU_CHECK_EVERY = 8


def check_every(device: torch.device) -> int:
    """Steps between stop checks: every step on the CPU (a read costs nothing there), else
    GPU_CHECK_EVERY."""
    return 1 if device.type == "cpu" else GPU_CHECK_EVERY


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the loop picks each token: the argmax ("greedy"), or a draw ("sample") after
    temperature, top-k and top-p, from a generator seeded with `seed` (None: torch's global)."""

    strategy: str = "greedy"
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None


_PICK = ("temperature", "top_k", "top_p", "seed")  # Sampling's fields besides the strategy
_LOOP = ("attention_mask", "cache_kind")  # what else the loop decodes with


@torch.inference_mode()  # less per-op bookkeeping than no_grad: about 10% of a small model's step
def stream(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int | None = None,
    strategy: str = "greedy",
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | Sequence[int] | None = MODEL_DEFAULT,
    pad_token_id: int | None = MODEL_DEFAULT,
    decoder_start_token_id: int | None = MODEL_DEFAULT,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    cache_kind: str | None = None,
    **settings,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row (B,) at each step (greedy or sample). On a GPU the
    stop test is read every GPU_CHECK_EVERY steps, so tokens come in bursts of that many (a read
    per token would wait for the device each time); none past the stop is yielded.

    The model's own generation settings (`model.generation`, src/attnlab/decode/settings.py)
    are the defaults; every keyword given, None included, overrides one of them, and `settings`
    takes the other GenerationSettings fields (repetition_penalty=1.2, min_new_tokens=5, ...).
    max_new_tokens None: the settings' max_new_tokens / max_length, else 50. A finished row
    (EOS) emits the pad id and its cache rows are released (paged cache); without a pad id, a
    model carrying settings emits its first EOS (as transformers), one without goes on decoding
    the row. The tokens are inference tensors: `.clone()` one outside inference mode to modify it."""
    if strategy not in ("greedy", "sample"):
        raise ValueError(
            f"stream supports strategy 'greedy' or 'sample', got {strategy!r} (beam: use generate)"
        )
    check_keywords("stream", settings, ("strategy", *_PICK, *_LOOP))
    s = resolve(
        model,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        decoder_start_token_id=decoder_start_token_id,
        **settings,
    )
    how = plan(model, input_ids, attention_mask, max_new_tokens, s)
    pick = Sampling(strategy=strategy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    yield from _stream(
        model, input_ids, how, pick=pick, attention_mask=attention_mask, cache_kind=cache_kind
    )


@torch.inference_mode()
def _stream(
    model,
    input_ids: torch.Tensor,
    how: Plan,
    *,
    pick: Sampling,
    attention_mask: torch.Tensor | None = None,
    cache_kind: str | None = None,
) -> Iterator[torch.Tensor]:
    """The greedy / sampling loop over a settled plan (`stream` and `generate` settle it once)."""
    seed = pick.seed
    generator = (
        torch.Generator(device=input_ids.device).manual_seed(seed) if seed is not None else None
    )
    n, rules = how.max_new_tokens, how.processors
    eos = torch.tensor(how.settings.eos_ids(), dtype=torch.long, device=input_ids.device)
    fill = how.fill
    after = model.reprefill_after if how.start is None else None  # LongRoPE: see nn/model.py
    full = input_ids  # the whole sequence, for a rerun (LongRoPE past its original length)
    full_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    with evaluating(model):
        seq, logits, state = prefill(
            model, input_ids, n, attention_mask, how.start, cache_kind
        )  # seq: (B, P) the padded prompt, or the start token
        filled = input_ids.shape[1]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        ended = torch.zeros_like(done)  # rows that ended since the last check
        every = check_every(input_ids.device)
        pending: list[torch.Tensor] = []  # tokens not yet yielded, and whether all rows were done
        all_done: list[torch.Tensor] = []
        for i in range(n):
            if rules:
                logits = apply(rules, seq, logits)
            if pick.strategy == "greedy":
                token = logits.argmax(dim=-1)
            else:
                token = sample_next(logits, pick.temperature, pick.top_k, pick.top_p, generator)
            if fill is not None:
                token = token.masked_fill(done, fill)
            pending.append(token)
            if eos.numel():
                now = torch.isin(token, eos) & ~done
                done |= now
                ended |= now
                all_done.append(done.all())
            if len(pending) == every or i + 1 == n:  # the check: one read of the device
                flags = torch.stack(all_done).tolist() if all_done else []
                stop = flags.index(True) if True in flags else None
                yield from pending if stop is None else pending[: stop + 1]
                if stop is not None:
                    return
                if fill is not None and all_done and bool(ended.any()):
                    state.cache.finish(ended)  # their later tokens are all padding
                    ended = torch.zeros_like(done)
                pending.clear()
                all_done.clear()
            if i + 1 < n:
                if rules:
                    seq = torch.cat((seq, token[:, None]), dim=1)
                if after is None:
                    logits = decode_step(model, token, state)
                    continue
                full = torch.cat((full, token[:, None]), dim=1)
                full_mask = torch.cat((full_mask, torch.ones_like(full_mask[:, :1])), dim=1)
                if filled <= after < full.shape[1]:  # the cache went stale: run it all again
                    _, logits, state = prefill(model, full, n - i - 1, full_mask, None, cache_kind)
                else:
                    logits = decode_step(model, token, state)
                filled = full.shape[1]


@torch.inference_mode()
def sliding_stream(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    window: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield tokens (B,) of a decoder-only model past its position table: each step recomputes
    the last `window` tokens from position 0 (nanoGPT's sample loop; no KV cache, since every
    step shifts all positions). temperature 0 is greedy. Rows are unpadded prompts of one
    length (a padding mask cannot slide with the window)."""
    if not isinstance(model, DecoderOnlyModel):
        raise TypeError(f"sliding_stream needs a decoder-only model, got {type(model).__name__}")
    if window <= 0:
        raise ValueError(f"window ({window}) must be positive")
    generator = (
        torch.Generator(device=input_ids.device).manual_seed(seed) if seed is not None else None
    )
    ids = input_ids
    with evaluating(model):
        for _ in range(max_new_tokens):
            logits = model(ids[:, -window:]).logits[:, -1].float()
            token = sample_next(logits, temperature, top_k, top_p, generator)
            yield token
            ids = torch.cat((ids, token[:, None]), dim=1)


_BEAM_ONLY = ("num_beams", "length_penalty", "early_stopping")


def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int | None = None,
    strategy: str | None = None,
    **kwargs,
) -> torch.Tensor:
    """Greedy, sampled or beam-searched continuation. See `stream` for the keyword arguments
    and `beam_search` (src/attnlab/decode/beam.py) for num_beams / length_penalty /
    early_stopping / num_return_sequences. The model's own generation settings
    (`model.generation`) are the defaults, keywords override them; strategy None: "beam" when
    num_beams (given, else the model's) is above 1, else "greedy"."""
    if strategy is not None:
        check_choice("strategy", strategy, ("greedy", "sample", "beam"))
    beams = kwargs.get("num_beams", settings_of(model).num_beams)
    if strategy is None:
        strategy = "beam" if beams is not None and beams > 1 else "greedy"
    elif strategy != "beam" and kwargs.get("num_beams") not in (None, 1):
        raise ValueError(
            f"strategy {strategy!r} with num_beams={kwargs['num_beams']}: use strategy='beam' "
            "(or leave strategy unset)"
        )
    if strategy == "beam":
        return beam_search(model, input_ids, max_new_tokens, **kwargs)
    for name in _BEAM_ONLY:  # beam search's settings; greedy and sampling have no use for them
        kwargs.pop(name, None)
    if kwargs.pop("num_return_sequences", 1) != 1:
        raise ValueError("num_return_sequences above 1 needs strategy='beam'")
    pick = Sampling(strategy=strategy, **{k: kwargs.pop(k) for k in _PICK if k in kwargs})
    loop = {k: kwargs.pop(k) for k in _LOOP if k in kwargs}
    check_keywords(
        "generate", kwargs, ("strategy", *_PICK, *_LOOP, *_BEAM_ONLY, "num_return_sequences")
    )
    mask = loop.get("attention_mask")
    how = plan(model, input_ids, mask, max_new_tokens, resolve(model, **kwargs))  # the only one
    if isinstance(model, EncoderDecoderModel):
        prefix = torch.full(
            (input_ids.shape[0], 1),
            -1 if how.start is None else how.start,
            dtype=torch.long,
            device=input_ids.device,
        )
    else:
        prefix = input_ids
    tokens = list(_stream(model, input_ids, how, pick=pick, **loop))
    new = torch.stack(tokens, dim=1) if tokens else prefix[:, :0]
    return torch.cat((prefix, new), dim=1)
