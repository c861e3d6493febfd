"""A request's answer from its engine requests' events: `Call` (what its choices share), the
events of one choice (timed for /metrics, cancelled when no longer read), and the whole answer
of a request that does not stream (stream.py answers one that does).

A client that goes away while its whole answer is computed cancels its requests as soon as the
server reads its disconnect (`whole` watches for it while it waits): without that, a dropped
client's requests decoded to max_tokens and held their KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from .access import CLIENT_GONE, Tokens
from .errors import APIError
from .protocol import Body
from .replies import Text, chat_logprob, completion_logprobs, usage
from .state import AppState
from .tools import forced_calls, parse_calls


@dataclass
class Call:
    """One HTTP request being answered; choice p * n + j is prompt p's j-th (completions may
    send several prompts)."""

    state: AppState
    body: Body
    chat: bool  # /v1/chat/completions (else /v1/completions)
    k: int | None  # log-probabilities asked for (chat: top_logprobs; None: none)
    echo: bool  # completions: each choice starts with its prompt
    shown: list[list[int]]  # each choice's prompt
    submitted: list[tuple[int, asyncio.Queue]]  # each choice's engine request: id, its events
    meta: dict  # id, created, model: in every body and chunk
    n_prompt: int  # prompt tokens, all prompts together
    tokens: Tokens  # the access log's counts, filled in as they are known


async def events(state: AppState, rid: int, queue) -> AsyncIterator:
    """The request's events until it finishes; cancels it if the consumer stops early.
    Times each token for /metrics (time to first token, inter-token latency)."""
    done, last = False, time.perf_counter()
    first = True
    try:
        while True:
            event = await queue.get()
            if isinstance(event, BaseException):
                raise APIError(500, str(event), code="engine_error")
            now = time.perf_counter()
            (state.metrics.ttft if first else state.metrics.itl).observe(now - last)
            first, last = False, now
            state.metrics.generated.inc()
            done = event.finish_reason is not None
            yield event
            if done:
                return
    finally:
        if not done:
            state.worker.cancel(rid)


def raw(state: AppState, events: list) -> str:
    """The answer's text with special tokens kept (but its end-of-sequence token)."""
    ids = [e.token for e in events if e.token not in state.served.eos_token_ids]
    return state.served.tokenizer.decode(ids, skip_special_tokens=False)


def _with_calls(call: Call, message: dict, events: list, finish: str) -> tuple[dict, str]:
    """The assistant's message with the tool calls its answer holds (serve/tools.py), and
    the finish reason ("tool_calls" for calls the model chose to make)."""
    body = call.body
    mode = body.tool_mode()
    if mode is None:
        return message, finish
    if mode == "auto":  # read the raw text: several formats' markers are special tokens
        content, calls = parse_calls(raw(call.state, events), {t.function.name for t in body.tools})
    else:
        content, calls = None, forced_calls(message["content"], body.tools, mode)
    if not calls:
        return message, finish
    if finish == "stop" and isinstance(mode, str):  # auto, required (named: "stop", as OpenAI)
        finish = "tool_calls"
    return {"role": "assistant", "content": content, "tool_calls": calls}, finish


async def _answer(state: AppState, rid: int, queue, text: Text) -> tuple[str, str, int, list]:
    """One choice, whole: (text, finish_reason, tokens generated, their events)."""
    n, finish, seen = 0, "length", []
    stream = events(state, rid, queue)
    async for event in stream:
        n += 1
        seen.append(event)
        text.add(event.token)
        if text.stopped:
            finish = "stop"
            await stream.aclose()  # cancels the request: its blocks are freed
            break
        if event.finish_reason:
            finish = event.finish_reason
    return text.text, finish, n, seen


async def whole(call: Call, request: HTTPRequest) -> dict | Response:
    """The answer's body once every choice is over (a 499 for the access log, sent nowhere,
    if the client left first)."""
    state, body, k, echo = call.state, call.body, call.k, call.echo
    tok = state.served.tokenizer
    tasks = [
        asyncio.ensure_future(_answer(state, rid, queue, Text(tok, body.stops())))
        for rid, queue in call.submitted
    ]
    try:
        work = asyncio.gather(*tasks)
        answers = await _unless_gone(state, request, work, [rid for rid, _ in call.submitted])
    finally:  # one choice failed: gather does not stop its siblings, which would read on
        for t in tasks:
            t.cancel()
    if answers is None:  # nobody to answer
        call.tokens.gone = True
        return Response(status_code=CLIENT_GONE)
    used = usage(call.n_prompt, sum(n for _, _, n, _ in answers))
    call.tokens.completion = used["completion_tokens"]
    choices = []
    for i, (text, finish, _, seen) in enumerate(answers):
        if call.chat:
            message = {"role": "assistant", "content": text}
            message, finish = _with_calls(call, message, seen, finish)
            choice = {"index": i, "message": message, "finish_reason": finish}
            if k is not None:
                choice["logprobs"] = {"content": [chat_logprob(tok, e) for e in seen]}
        else:
            prompt = call.shown[i] if echo else []
            head = seen[0].prompt_logprobs if echo and seen else ()
            lp = completion_logprobs(tok, seen, k, prompt, head) if k is not None else None
            head = tok.decode(prompt, skip_special_tokens=False) if echo else ""
            choice = {"index": i, "text": head + text, "logprobs": lp, "finish_reason": finish}
        choices.append(choice)
    kind = "chat.completion" if call.chat else "text_completion"
    return {**call.meta, "object": kind, "choices": choices, "usage": used}


async def _unless_gone(state: AppState, request: HTTPRequest, work: asyncio.Future, rids: list):
    """`work`'s result, or None once the client has disconnected: then `work` is cancelled
    and so are the engine requests `rids` (their blocks are freed at the next step). The
    body has been read, so the next ASGI message is the disconnect."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left (or this handler was cancelled)
            work.cancel()
            for rid in rids:  # also those whose choice had not started reading yet
                state.worker.cancel(rid)
            await asyncio.gather(work, return_exceptions=True)
    return work.result() if not work.cancelled() else None
