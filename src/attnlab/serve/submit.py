"""A request body -> the engine's Requests (src/attnlab/decode/requests.py), one per choice,
under this server's rules: the model asked for is the one served, OpenAI's sampling fields in
the engine's terms, structured output as a grammar constraint (response_format, or a forced
tool call), and the --max-waiting bound on the engine's queue.
"""

from __future__ import annotations

from ..decode.engine import Request as EngineRequest
from .errors import APIError
from .protocol import Body, ChatRequest
from .state import AppState
from .tools import forced_schema


def engine_request(
    state: AppState,
    body: Body,
    prompt: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    choice: int = 0,
    echo: bool = False,
) -> EngineRequest:
    served = state.served
    if body.model != served.name:
        raise APIError(
            404,
            f"model '{body.model}' is not served here: this server serves '{served.name}'",
            "model",
            "model_not_found",
        )
    if max_tokens is None:  # OpenAI's default: the rest of the context (checked on submit)
        max_tokens = state.context - len(prompt)
    top_k = body.top_k if body.top_k not in (None, -1, 0) else None
    return EngineRequest(
        prompt,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_k=top_k,
        top_p=body.top_p if body.top_p < 1 else None,
        seed=None if body.seed is None else body.seed + choice,  # choices differ, reproducibly
        stop_token_ids=(*served.eos_token_ids, *(body.stop_token_ids or ())),
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        prompt_logprobs=logprobs if echo else None,  # the prompt's, for echo
        constraint=_constraint(state, body),
    )


def _constraint(state: AppState, body: Body):
    """The grammar constraint of the body's JSON schema (None: free text)."""
    schema = body.response_format.schema() if body.response_format is not None else None
    param = "response_format"
    if schema is None and isinstance(body, ChatRequest) and body.forces_call():
        schema = forced_schema(body.tools, body.tool_mode(), body.parallel_tool_calls)
        param = "tool_choice"
    if schema is None:
        return None
    served = state.served
    if not served.eos_token_ids:
        raise APIError(
            400,
            f"'{served.name}' has no EOS token, so structured output cannot end: leave out {param}",
            param,
        )
    try:
        if state.grammar is None:
            from .grammar import Grammar

            state.grammar = Grammar(served.tokenizer, served.eos_token_ids[0])
        return state.grammar.constraint(schema)
    except ImportError:
        raise APIError(
            400,
            f"{param} needs the llguidance package: pip install 'attnlab[serve]'",
            param,
        ) from None
    except ValueError as err:  # GrammarError, or a schema llguidance rejects
        raise APIError(400, str(err), param) from None


def check_waiting(state: AppState, body: Body, n_prompts: int) -> None:
    """The --max-waiting bound, for a request of n_prompts prompts × body.n choices: each
    choice is one engine request. No await between this and the submits: two handlers
    cannot both pass it on one free place."""
    asked, max_waiting = n_prompts * body.n, state.max_waiting
    if max_waiting is None:
        return
    if asked > max_waiting:  # could never be admitted: retrying would not help
        what = f"n ({body.n})" + (f" × {n_prompts} prompts" if n_prompts > 1 else "")
        raise APIError(
            400,
            f"{what} = {asked} requests, more than this server queues at once "
            f"(attnlab serve --max-waiting {max_waiting}): ask for at most {max_waiting}",
            "n" if body.n > 1 else "prompt",
        )
    waiting = state.worker.waiting()
    if waiting + asked > max_waiting:
        raise APIError(
            429,
            f"{waiting} requests are already waiting, and this server queues at most "
            f"{max_waiting} (attnlab serve --max-waiting): retry later",
            code="too_many_requests",
        )
