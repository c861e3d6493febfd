"""A model's own generation settings: the defaults `generate` and `beam_search` decode with.

A checkpoint says how it wants to be decoded: BART starts the decoder with EOS and forces EOS at
the length limit, T5 starts with the pad id, summarisation checkpoints ask for 4 beams, a length
penalty and no repeated trigrams, Whisper suppresses tokens. `transformers` keeps these in a
`GenerationConfig` (generation_config.json); attnlab keeps the subset it implements in a
`GenerationSettings`, carried by the model as `model.generation` (None or absent: no defaults).

    model.generation = GenerationSettings(decoder_start_token_id=2, eos_token_id=2,
                                          forced_eos_token_id=2, num_beams=4)
    al.generate(model, src)                       # beam search, starts with 2, forced EOS
    al.generate(model, src, num_beams=1)          # explicit keywords override the model's

Field names and meanings are those of `transformers.GenerationConfig`, so a checkpoint's file
reads and writes as it is (`from_hf` / `to_hf`; reading drops, with a warning, a value
attnlab would refuse, such as the pad id -1 of some old configs). Lengths count as `transformers` counts them:
`max_length` / `min_length` include the prompt (decoder-only; its padding too) or the decoder
start token (encoder-decoder); `max_new_tokens` / `min_new_tokens` count generated tokens only and
win over the former. The logits rules the settings switch on live in
src/attnlab/decode/processors.py. This module does not import torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import Field

from ..config import ConfigError, Frozen
from ..errors import did_you_mean

Id = Annotated[int, Field(ge=0)]
TokenIds = Id | tuple[Id, ...]


class GenerationSettings(Frozen):
    """Every field optional; None = unset (the caller's argument or attnlab's default decides)."""

    decoder_start_token_id: int | None = Field(None, ge=0)  # encoder-decoder: the first token
    bos_token_id: int | None = Field(None, ge=0)  # the start token when decoder_start is unset
    eos_token_id: TokenIds | None = None  # one id or several; a row ends at any of them
    pad_token_id: int | None = Field(None, ge=0)  # fills finished rows (default: the first EOS)
    forced_bos_token_id: int | None = Field(None, ge=0)  # forced as the first generated token
    forced_eos_token_id: TokenIds | None = None  # forced as the last token at max_length
    min_length: int | None = Field(None, ge=0)  # EOS impossible while the sequence is shorter
    min_new_tokens: int | None = Field(None, ge=0)  # the same in generated tokens (wins)
    max_length: int | None = Field(None, ge=1)  # the sequence's length limit (prompt included)
    max_new_tokens: int | None = Field(None, ge=1)  # the same in generated tokens (wins)
    no_repeat_ngram_size: int | None = Field(None, ge=0)  # no n-gram twice (0: off)
    repetition_penalty: float | None = Field(None, gt=0)  # CTRL's penalty on seen tokens (1: off)
    suppress_tokens: tuple[Id, ...] | None = None  # never generated
    begin_suppress_tokens: tuple[Id, ...] | None = None  # not generated first
    num_beams: int | None = Field(None, ge=1)  # > 1: beam search by default
    length_penalty: float | None = None  # beam score = log p / generated length ** this
    early_stopping: Literal[True, False, "never"] | None = None  # beam search's stop rule

    @classmethod
    def from_hf(cls, data: dict[str, Any] | None) -> GenerationSettings:
        """The fields of a `transformers` generation config (its `to_dict()`, or the contents of
        generation_config.json / config.json) that are set; every other key is ignored."""
        given = {k: _tuple(v) for k, v in (data or {}).items() if k in cls.model_fields}
        given = {k: v for k, v in given.items() if v is not None}
        try:
            return cls.from_dict(given)
        except ConfigError:  # a checkpoint's odd value (e.g. pad_token_id -1) must not stop it
            kept = {k: v for k, v in given.items() if _valid(k, v)}
            dropped = ", ".join(f"{k}={v!r}" for k, v in given.items() if k not in kept)
            warnings.warn(f"generation settings ignored (invalid): {dropped}", stacklevel=2)
            return cls.from_dict(kept)

    def to_hf(self) -> dict[str, Any]:
        """The set fields as `transformers.GenerationConfig` keyword arguments (tuples as lists)."""
        return {k: _list(v) for k, v in self.model_dump().items() if v is not None}

    def __repr_args__(self):  # only the set fields: GenerationSettings(eos_token_id=2, ...)
        return [(k, v) for k, v in super().__repr_args__() if v is not None]

    def is_empty(self) -> bool:
        return not self.to_hf()

    def start_token(self) -> int | None:
        """The decoder start token: decoder_start_token_id, else BOS (as `transformers`)."""
        if self.decoder_start_token_id is not None:
            return self.decoder_start_token_id
        return self.bos_token_id

    def eos_ids(self) -> tuple[int, ...]:
        return _ids(self.eos_token_id)

    def fill_token(self) -> int | None:
        """What a finished row emits: the pad id, else the first EOS (as `transformers`)."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        eos = self.eos_ids()
        return eos[0] if eos else None

    def new_tokens(self, prompt_length: int, default: int = 50) -> int:
        """How many tokens to generate after a (padded) prompt of `prompt_length` (1 for an
        encoder-decoder: the start token): max_new_tokens, else what max_length leaves, else
        `default`."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is None:
            return default
        if self.max_length <= prompt_length:
            raise ValueError(
                f"max_length ({self.max_length}) leaves no room after the prompt "
                f"({prompt_length} tokens): pass max_new_tokens=... or a larger max_length"
            )
        return self.max_length - prompt_length


class _ModelDefault:
    """The default of a keyword that falls back to the model's GenerationSettings: passing any
    value, None included, overrides the model's."""

    def __repr__(self) -> str:
        return "<the model's>"


MODEL_DEFAULT: Any = _ModelDefault()


def settings_of(model: object) -> GenerationSettings:
    """`model.generation`, or empty settings when the model carries none."""
    own = getattr(model, "generation", None)
    if own is None:
        return GenerationSettings()
    if not isinstance(own, GenerationSettings):
        raise TypeError(
            f"model.generation must be a GenerationSettings or None, got {type(own).__name__}: "
            "set model.generation = attnlab.decode.settings.GenerationSettings(...)"
        )
    return own


def resolve(model: object, **given: Any) -> GenerationSettings:
    """The model's settings with every keyword that was given (not MODEL_DEFAULT) put over them.
    An unknown keyword is refused with the known names (and a did-you-mean)."""
    changes = {k: v for k, v in given.items() if v is not MODEL_DEFAULT}
    own = settings_of(model)
    return own.replace(**changes) if changes else own


def check_keywords(function: str, given: Iterable[str], own: Iterable[str]) -> None:
    """TypeError for a keyword that is neither one of `function`'s own parameters nor a
    GenerationSettings field, with a did-you-mean over both."""
    known = sorted(set(own) | set(GenerationSettings.model_fields))
    for name in given:
        if name not in known:
            raise TypeError(
                f"{function}() got an unknown keyword argument {name!r}: it takes its own "
                f"parameters and the GenerationSettings fields ({', '.join(known)})."
                f"{did_you_mean(name, known)}"
            )


def _valid(name: str, value: Any) -> bool:
    try:
        GenerationSettings.from_dict({name: value})
    except ConfigError:
        return False
    return True


def _ids(value: TokenIds | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _list(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
