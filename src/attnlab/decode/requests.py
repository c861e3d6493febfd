"""What a client asks the continuous-batching engine for, what it gets back, and the rules a
request must meet (src/attnlab/decode/engine.py checks them on `submit`; the HTTP server,
src/attnlab/serve/handlers.py, passes its max_model_len as `context` and reports `param` to the
client, so the rules and their messages live here once).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Protocol

import torch


class Constraint(Protocol):
    """Structured output: which tokens may come next (the server builds one per request from a
    JSON schema, src/attnlab/serve/grammar.py). Stateful: `accept` every chosen token."""

    def allowed(self, vocab_size: int) -> torch.Tensor: ...  # (V,) bool

    def accept(self, token: int) -> None: ...

    @property
    def finished(self) -> bool: ...


@dataclass(frozen=True)
class Request:
    """What a client asks for. temperature 0 is greedy; stop strings are the caller's business
    (it cancels the request when its text contains one). logprobs: None, or k >= 0: each event
    carries its token's log-probability and the k most likely tokens' (the model's own
    distribution, before temperature and top-k / top-p, as vLLM reports them)."""

    prompt: Sequence[int]
    _: KW_ONLY  # every setting by name: Request(ids, max_tokens=32, temperature=0.7)
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    logprobs: int | None = None
    # OpenAI's penalties on the tokens generated so far, before sampling: the logit of token t
    # loses frequency_penalty · count(t) + presence_penalty · [count(t) > 0]
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None, or k >= 0: the first event also carries each prompt token's log-probability given
    # the tokens before it, with the k best alternatives (OpenAI's echo; prompt blocks are then
    # computed, not taken from the prefix cache)
    prompt_logprobs: int | None = None
    # structured output: only tokens it allows are sampled; it ending ends the request ("stop")
    constraint: Any = None  # a Constraint


@dataclass
class Seq:
    """One request as the engine serves it. Its state moves on in one place, the scheduler's
    `update` (src/attnlab/decode/scheduler.py), after each step: `filled` by what the step wrote to
    the cache, `tokens` by what it sampled, `prompt_lp` by what it scored; admission and
    pre-emption (also the scheduler's) set `filled` to what the cache holds."""

    rid: int
    req: Request
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # generated so far
    filled: int = 0  # tokens of `context` the cache holds
    prompt_lp: list = field(default_factory=list)  # prompt_logprobs so far (Request's)

    @property
    def context(self) -> list[int]:
        """What a (re)started prefill runs: the prompt and every generated token."""
        return [*self.req.prompt, *self.tokens]

    @property
    def length(self) -> int:  # len(context), without building it
        return len(self.req.prompt) + len(self.tokens)

    @property
    def newest(self) -> int:  # context[-1]
        return self.tokens[-1] if self.tokens else self.req.prompt[-1]


MAX_LOGPROBS = 20  # top alternatives a request may ask for (OpenAI's chat limit)


@dataclass(frozen=True)
class Event:
    """One new token of request `rid`; finish_reason "stop" (a stop token, included), "length"
    (max_tokens reached) or None (more to come). With the request's `logprobs`: the token's
    log-probability and the (token, log-probability) of the most likely ones, best first."""

    rid: int
    token: int
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # the request's first event, with prompt_logprobs asked: (logprob, top) of prompt tokens
    # 1 .. P-1 (the first has nothing before it)
    prompt_logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None


class RequestError(ValueError):
    """A request that can never be served; `param` names the field at fault ("prompt",
    "max_tokens", "temperature", "top_k", "top_p"), which the server reports to its client."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_request(
    req: Request,
    *,
    vocab_size: int,
    max_positions: int | None,
    block_size: int,
    num_blocks: int,
    context: int | None = None,
) -> None:
    """RequestError for the first rule `req` breaks: a non-empty prompt of ids in the
    vocabulary, sampling settings in range, and prompt + max_tokens within `context` (the
    server's cap; None: none), the model's positions (the last token is never fed back, hence
    the - 1) and the whole pool of num_blocks blocks."""
    n, m = len(req.prompt), req.max_tokens
    if n == 0:
        raise RequestError("the prompt is empty: give at least one token", "prompt")
    if any(not 0 <= t < vocab_size for t in req.prompt):
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if context is not None and n >= context:
        raise RequestError(
            f"the prompt is {n} tokens, the model's context is {context}: shorten the prompt",
            "prompt",
        )
    for name, value, rule, ok in (
        ("max_tokens", m, ">= 1", m >= 1),
        ("temperature", req.temperature, ">= 0 (0: greedy)", req.temperature >= 0),
        ("top_k", req.top_k, ">= 1", req.top_k is None or req.top_k >= 1),
        ("top_p", req.top_p, "in (0, 1]", req.top_p is None or 0 < req.top_p <= 1),
        (
            "presence_penalty",
            req.presence_penalty,
            "in [-2, 2]",
            -2 <= req.presence_penalty <= 2,
        ),
        (
            "frequency_penalty",
            req.frequency_penalty,
            "in [-2, 2]",
            -2 <= req.frequency_penalty <= 2,
        ),
        (
            "prompt_logprobs",
            req.prompt_logprobs,
            f"in [0, {MAX_LOGPROBS}]",
            req.prompt_logprobs is None or 0 <= req.prompt_logprobs <= MAX_LOGPROBS,
        ),
        (
            "logprobs",
            req.logprobs,
            f"in [0, {MAX_LOGPROBS}]",
            req.logprobs is None or 0 <= req.logprobs <= MAX_LOGPROBS,
        ),
    ):
        if not ok:
            raise RequestError(f"{name} ({value}) must be {rule}", name)
    asked = f"prompt ({n} tokens) + max_tokens ({m})"
    if context is not None and n + m > context:
        raise RequestError(
            f"{asked} exceeds the model's context of {context} tokens: lower max_tokens or "
            "shorten the prompt",
            "max_tokens",
        )
    if max_positions is not None and n + m - 1 > max_positions:
        raise RequestError(
            f"{asked} exceeds the model's context of {max_positions} positions: shorten one "
            "of them",
            "max_tokens",
        )
    if math.ceil((n + m) / block_size) > num_blocks:
        raise RequestError(
            f"{asked} needs more KV memory than the whole pool ({num_blocks} blocks of "
            f"{block_size} tokens): shorten one of them or give the engine more blocks",
            "max_tokens",
        )
