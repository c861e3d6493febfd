"""The two steps every decoding strategy is made of (gpt-fast's `prefill` / `decode_one_token`).

    prefill      run the prompt once (or encode the source and feed the start token), filling
                 a fresh cache; returns the sequence so far, the last logits and the state
    decode_step  feed one new token per row through the cache; returns the next logits (through
                 the step the picker gives: picker.py)
    plan         what a call decodes with: the model's generation settings under the caller's
                 keywords (src/attnlab/decode/settings.py), the number of new tokens, the
                 start token and the logits rules (src/attnlab/decode/processors.py)

Greedy and sampling (generate.py) and beam search (beam.py) are loops over these two, so the
cache handling lives in one place. `evaluating(model)` puts a model in eval mode for the duration
of a loop and restores its mode afterwards, whatever happens.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import KVCache
from ..nn.model import DecoderOnlyModel, EncoderDecoderModel
from .compiled_step import bucket, reusable_cache, why_not
from .picker import pick
from .processors import Processor, build_processors
from .settings import GenerationSettings


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode (no dropout) inside the block; the model's previous mode restored after it."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


@dataclass
class DecodeState:
    """What a decoding loop carries between steps."""

    cache: KVCache
    memory: torch.Tensor | None = None  # (B, S, d_model) encoder states (encoder-decoder)
    memory_mask: torch.Tensor | None = None  # (B, S) source padding mask
    step: object = None  # the picker's step (picker.py); False: the eager one; None: unasked


def _step(
    model: nn.Module, ids: torch.Tensor, state: DecodeState, mask: torch.Tensor | None = None
) -> torch.Tensor:
    if isinstance(model, EncoderDecoderModel):
        out = model.decode(ids, state.memory, state.memory_mask, mask, cache=state.cache)
    else:
        out = model(ids, attention_mask=mask, cache=state.cache)
    return out.logits[:, -1].float()  # (B, vocab)


@torch.no_grad()
def prefill(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    decoder_start_token_id: int | None = None,
    cache_kind: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, DecodeState]:
    """Run the prompt (or encode the source); returns (sequence so far, last logits (B, vocab),
    state). `cache_kind`: "static", "fixed" (the compiled step's: compiled_step.py), "sliding"
    (models with a sliding window), "paged" or "recurrent" (linear attention); None: "fixed" on
    CUDA for a model the compiled step serves (`default_kind`), else the model's own
    (`model.new_cache`)."""
    B = input_ids.shape[0]
    if isinstance(model, EncoderDecoderModel):
        if decoder_start_token_id is None:
            raise ValueError(
                "encoder-decoder generation needs decoder_start_token_id (e.g. the pad or BOS id): "
                "pass it, or set model.generation = attnlab.decode.settings.GenerationSettings("
                "decoder_start_token_id=...) "
                "(from_hf and load_pretrained set it from the checkpoint)"
            )
        memory = model.encode(input_ids, attention_mask)
        cache = model.new_cache(B, max_new_tokens + 1, kind=cache_kind)
        state = DecodeState(cache, memory, attention_mask)
        seq = torch.full((B, 1), decoder_start_token_id, dtype=torch.long, device=input_ids.device)
        return seq, _step(model, seq, state), state
    if not isinstance(model, DecoderOnlyModel):
        raise TypeError(
            f"generate needs a decoder-only or encoder-decoder model, got {type(model).__name__}"
        )
    max_len = input_ids.shape[1] + max_new_tokens
    kind = cache_kind if cache_kind is not None else default_kind(model, input_ids.device)
    if kind == "fixed":  # one kept cache per model, lengths bucketed: one graph (compiled_step)
        cache = reusable_cache(model, B, bucket(max_len))
        state = DecodeState(cache)
        weakref.finalize(state, setattr, cache, "in_use", False)  # the loop is done with it
    else:
        state = DecodeState(model.new_cache(B, max_len, kind=kind))
    return input_ids, _step(model, input_ids, state, attention_mask), state


def default_kind(model: nn.Module, device: torch.device) -> str | None:
    """The cache a loop decodes with when the caller names none: on CUDA "fixed" for a model the
    compiled step serves (compiled_step.py: one graph, CUDA graphs), else the model's own."""
    if device.type == "cuda" and model.cache_geometry().kind == "static" and why_not(model) is None:
        return "fixed"
    return None


def decode_step(model: nn.Module, token: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """Feed one token per row (B,); returns the next logits (B, vocab), through the step the
    picker gives the loop's model and cache (picker.py, asked once per loop), else the eager
    forward (always for an encoder-decoder)."""
    if state.step is None:
        state.step = state.memory is None and (pick(model, state.cache).step or False)
    if state.step:
        return state.step(token, state.cache)
    return _step(model, token[:, None], state)


@dataclass
class Plan:
    """What one decoding call works with, settled before its first step."""

    settings: GenerationSettings  # the model's, with the caller's keywords over them
    max_new_tokens: int
    start: int | None  # the decoder start token (encoder-decoder), else None
    processors: list[Processor]  # the logits rules, in transformers' order
    fill: int | None  # what a finished row emits (None: it goes on decoding)


def plan(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int | None,
    settings: GenerationSettings,
) -> Plan:
    """Settle a call: the new-token count (the argument, else the settings' max_new_tokens /
    max_length, else 50), the start token, and the logits rules for this prompt length."""
    seq2seq = isinstance(model, EncoderDecoderModel)
    P = 1 if seq2seq else input_ids.shape[1]  # what the sequence holds before the first new token
    n = max_new_tokens if max_new_tokens is not None else settings.new_tokens(P)
    skip = None  # left padding the repetition penalty ignores (transformers: from the mask)
    if not seq2seq and attention_mask is not None:
        skip = (attention_mask != 0).int().argmax(dim=1)
    start = settings.start_token() if seq2seq else None
    # finished rows emit the pad id; a model with settings of its own follows transformers and
    # falls back to the first EOS, one without any (attnlab's own) goes on decoding them
    own = getattr(model, "generation", None) is not None
    fill = settings.fill_token() if own else settings.pad_token_id
    return Plan(settings, n, start, build_processors(settings, P, P + n, skip), fill)
