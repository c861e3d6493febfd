"""A streamed answer (stream=true): server-sent events, one `data: {...}` chunk per piece of a
choice's text as soon as it is safe to send (replies.py `Text`), then usage if asked, then
`data: [DONE]`. Choice i's chunks carry index i and interleave as they are ready. A client gone
mid-stream ends the generator: every choice's request is cancelled and its blocks freed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from .answer import Call, events, raw
from .errors import APIError
from .protocol import error_body
from .replies import Text, chat_logprob, completion_logprobs, usage
from .tools import CallStream


async def stream(call: Call) -> AsyncIterator[str]:
    """Server-sent events for every choice: each choice's chunks as its tokens come, then
    usage, then [DONE]."""
    obj = "chat.completion.chunk" if call.chat else "text_completion"
    merged: asyncio.Queue = asyncio.Queue()
    counts = [0] * len(call.submitted)

    async def pump(i: int, rid: int, queue) -> None:
        text = Text(call.state.served.tokenizer, call.body.stops())
        try:
            async for choice in _choice_chunks(call, i, rid, queue, text, counts):
                merged.put_nowait(choice)
        except APIError as err:
            merged.put_nowait(err)
        finally:
            merged.put_nowait(None)  # this choice is over

    tasks = [asyncio.create_task(pump(i, *s)) for i, s in enumerate(call.submitted)]
    try:
        left = len(tasks)
        while left:
            item = await merged.get()
            if item is None:
                left -= 1
            elif isinstance(item, APIError):
                yield f"data: {json.dumps(error_body(item.message, kind='server_error'))}\n\n"
            else:
                yield f"data: {json.dumps({**call.meta, 'object': obj, 'choices': [item]})}\n\n"
    finally:  # a client gone mid-stream lands here: every choice's request is cancelled
        call.tokens.gone = bool(left)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        call.tokens.completion = sum(counts)
    body = call.body
    if body.stream_options and body.stream_options.include_usage:
        used = usage(call.n_prompt, sum(counts))
        yield f"data: {json.dumps({**call.meta, 'object': obj, 'choices': [], 'usage': used})}\n\n"
    yield "data: [DONE]\n\n"


async def _choice_chunks(call: Call, i: int, rid: int, queue, text: Text, counts: list[int]):
    """Choice i's chunks: (chat) the role first; (echo) the prompt and, with logprobs, its
    log-probabilities; then each piece of text once it is safe to send (see Text) with the
    logprobs of the tokens it came from. With tools (chat), the answer is read for calls as
    it grows (serve/tools.py CallStream): content until a call starts, then each call's name
    and its arguments piece by piece."""
    tok, chat, k = call.state.served.tokenizer, call.chat, call.k
    offset, pending, seen = 0, [], []  # completions' text_offset so far; tokens not yet sent
    mode = call.body.tool_mode() if chat else None
    reader = CallStream(call.body.tools, mode) if mode is not None else None

    def chunk(delta, finish: str | None, events: list, shown=(), head=()) -> dict:
        if chat:
            lp = {"content": [chat_logprob(tok, e) for e in events]} if k is not None else None
            d = delta if isinstance(delta, dict) else {"content": delta} if delta else {}
            return {"index": i, "delta": d, "logprobs": lp, "finish_reason": finish}
        nonlocal offset
        lp = None
        if k is not None:
            lp = completion_logprobs(tok, events, k, shown, head, offset)
            offset += sum(len(p) for p in lp["tokens"])
        return {"index": i, "text": delta, "logprobs": lp, "finish_reason": finish}

    if chat:
        yield {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
               "finish_reason": None}  # fmt: skip
    choice = events(call.state, rid, queue)
    try:
        async for event in choice:
            if call.echo and counts[i] == 0:
                prompt = call.shown[i]
                head = tok.decode(prompt, skip_special_tokens=False)
                yield chunk(head, None, [], prompt, event.prompt_logprobs or ())
            counts[i] += 1
            pending.append(event)
            seen.append(event)
            delta = text.add(event.token)
            finish = "stop" if text.stopped else event.finish_reason
            if finish:
                delta += text.flush()
            if reader is not None:  # the answer so far, as answer.py's _with_calls reads it
                now = raw(call.state, seen) if mode == "auto" and not text.stopped else text.text
                content, calls = reader.feed(now, final=finish is not None)
                delta = {"content": content} if content else {}
                delta |= {"tool_calls": calls} if calls else {}
                if reader.finish and finish == "stop":
                    finish = reader.finish
            if delta or finish:
                yield chunk(delta, finish, pending)
                pending = []
            if finish:
                break
    finally:
        await choice.aclose()
