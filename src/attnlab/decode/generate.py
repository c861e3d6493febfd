"""Greedy and sampled decoding as free functions over an explicit cache.

    sample_next     one token per row from logits: temperature, top-k, top-p (nucleus)
    stream          greedy / sample, yielding each step's tokens as they come
    sliding_stream  past a learned position table: recompute the last `window` tokens each step
    generate        greedy / sample / beam (beam.py), returning whole sequences

All of them are loops over `prefill` and `decode_step` (steps.py), which own the cache.

Decoder-only models return the prompt followed by the new tokens; encoder-decoder models return
the decoder sequence, starting with the decoder start token (as `transformers` does). Batched
prompts of different lengths are left-padded: positions count real tokens only, so each row
decodes exactly as it would alone. A finished row (EOS) keeps emitting `pad_token_id`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..errors import check_choice
from ..nn.model import DecoderOnlyModel, EncoderDecoderModel
from .beam import beam_search
from .steps import decode_step, evaluating, prefill


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from logits (B, V): temperature, then top-k, then nucleus (top-p)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) >= top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.inference_mode()  # less per-op bookkeeping than no_grad: about 10% of a small model's step
def stream(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int = 50,
    strategy: str = "greedy",
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    decoder_start_token_id: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    cache_kind: str | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row (B,) at each step (greedy or sample). With both
    eos_token_id and pad_token_id, a finished row's cache rows are released (paged cache).
    The tokens are inference tensors: `.clone()` one outside inference mode to modify it."""
    if strategy not in ("greedy", "sample"):
        raise ValueError(
            f"stream supports strategy 'greedy' or 'sample', got {strategy!r} (beam: use generate)"
        )
    generator = (
        torch.Generator(device=input_ids.device).manual_seed(seed) if seed is not None else None
    )
    with evaluating(model):
        _, logits, state = prefill(
            model, input_ids, max_new_tokens, attention_mask, decoder_start_token_id, cache_kind
        )
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for i in range(max_new_tokens):
            if strategy == "greedy":
                token = logits.argmax(dim=-1)
            else:
                token = sample_next(logits, temperature, top_k, top_p, generator)
            if pad_token_id is not None:
                token = token.masked_fill(done, pad_token_id)
            yield token
            if eos_token_id is not None:
                ended = (token == eos_token_id) & ~done
                done |= ended
                if bool(done.all()):
                    return
                if pad_token_id is not None and bool(ended.any()):
                    state.cache.finish(ended)  # their later tokens are all padding
            if i + 1 < max_new_tokens:
                logits = decode_step(model, token, state)


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


def generate(
    model, input_ids: torch.Tensor, max_new_tokens: int = 50, strategy: str = "greedy", **kwargs
) -> torch.Tensor:
    """Greedy, sampled or beam-searched continuation. See `stream` for the keyword arguments
    and `beam_search` (src/attnlab/decode/beam.py) for num_beams / length_penalty /
    early_stopping."""
    check_choice("strategy", strategy, ("greedy", "sample", "beam"))
    if strategy == "beam":
        return beam_search(model, input_ids, max_new_tokens, **kwargs)
    if isinstance(model, EncoderDecoderModel):
        start = kwargs.get("decoder_start_token_id")
        prefix = torch.full(
            (input_ids.shape[0], 1),
            -1 if start is None else start,
            dtype=torch.long,
            device=input_ids.device,
        )
    else:
        prefix = input_ids
    tokens = list(stream(model, input_ids, max_new_tokens, strategy, **kwargs))
    new = torch.stack(tokens, dim=1) if tokens else prefix[:, :0]
    return torch.cat((prefix, new), dim=1)
