"""The endpoints (src/attnlab/serve/app.py lists them), plain functions on one router over the
app's state (state.py):

    completions / chat_completions   body -> prompts (texts encoded off the event loop)
        -> run: the --max-waiting bound, one engine request per choice (submit.py), metrics
        -> stream.py (stream=true) or answer.py `whole`
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from ..decode.engine import RequestError
from .access import tokens_of
from .answer import Call, whole
from .chat import TemplateError, render_chat
from .errors import APIError, check_text
from .protocol import Body, ChatRequest, CompletionRequest
from .state import AppState, State
from .stream import stream
from .submit import check_waiting, engine_request
from .tools import template_takes_tools

router = APIRouter()


@router.get("/health")
async def health(state: State):
    stats = state.worker.stats()
    return {"status": "ok", "model": state.served.name, "context": state.context, **stats}


@router.get("/metrics")
async def prometheus(state: State):
    body, kind = state.metrics.scrape()
    return Response(body, media_type=kind)


@router.get("/v1/models")
async def models(state: State):
    card = {"id": state.served.name, "object": "model", "created": 0, "owned_by": "attnlab"}
    return {"object": "list", "data": [{**card, "max_model_len": state.context}]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: HTTPRequest, state: State):
    p = body.prompt  # one text or token list, or a list of them (a batch: OpenAI's shape)
    batch = [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)
    texts = [x for x in batch if isinstance(x, str)]
    for j, x in enumerate(texts):
        check_text(x, "prompt" if len(batch) == 1 else f"prompt.{j}")
    # off the loop
    encoded = iter(await asyncio.to_thread(_encode_all, state, texts) if texts else ())
    prompts = [next(encoded) if isinstance(x, str) else list(x) for x in batch]
    return await _run(state, request, body, prompts, body.max_tokens, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: HTTPRequest, state: State):
    served = state.served
    if served.chat_template is None:
        raise APIError(
            400,
            f"'{served.name}' has no chat template, so chat messages cannot be formatted: "
            "use /v1/completions with a prompt you format yourself",
            "messages",
        )
    messages = [m.plain() for m in body.messages]
    for i, m in enumerate(messages):
        check_text(json.dumps(m, ensure_ascii=False), f"messages.{i}")
    extra = {}
    if body.tool_mode() is not None:
        if not template_takes_tools(served.chat_template):
            raise APIError(
                400,
                f"the chat template of '{served.name}' does not show tools to the model (it "
                "reads no `tools` variable), so it was not trained to call them: leave out "
                "tools, or serve a model whose template defines them",
                "tools",
            )
        extra["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    try:  # rendering and tokenizing run off the event loop: /health and streams go on
        text = await asyncio.to_thread(
            render_chat,
            served.chat_template,
            messages,
            served.token(served.bos_token_id),
            served.token(served.eos_token_ids[0] if served.eos_token_ids else None),
            **extra,
        )
    except TemplateError as err:
        raise APIError(400, str(err), "messages") from None
    (prompt,) = await asyncio.to_thread(_encode_all, state, [text], False)
    max_tokens = body.max_completion_tokens or body.max_tokens
    return await _run(state, request, body, [prompt], max_tokens, chat=True)


def _encode_all(state: AppState, texts: list[str], special: bool = True) -> list[list[int]]:
    """Token ids of each text. tokenizers lets go of the GIL while it encodes: a 100k-token
    prompt (0.3 s) left another thread's longest pause at 8 ms (measured here)."""
    encodings = state.served.tokenizer.encode_batch(texts, add_special_tokens=special)
    return [e.ids for e in encodings]


async def _run(
    state: AppState,
    request: HTTPRequest,
    body: Body,
    prompts: list[list[int]],
    max_tokens: int | None,
    chat: bool,
):
    """Answer `prompts` (completions may send several: choice p * n + j is prompt p's j-th)."""
    k = body.logprobs_k() if chat else body.logprobs
    echo = not chat and body.echo
    shown = [p for p in prompts for _ in range(body.n)]  # each choice's prompt
    check_waiting(state, body, len(prompts))
    submitted: list[tuple[int, asyncio.Queue]] = []

    def cancel_all() -> None:  # a no-op for the requests already over
        for rid, _ in submitted:
            state.worker.cancel(rid)

    try:  # the engine's rules (src/attnlab/decode/requests.py), under this server's context
        for i, prompt in enumerate(shown):  # n per prompt (seeded: seed, seed + 1, ...)
            req = engine_request(state, body, prompt, max_tokens, k, i % body.n, echo)
            submitted.append(state.worker.submit(req, context=state.context))
        state.metrics.requests.labels("chat" if chat else "completions").inc()
        n_prompt = sum(map(len, prompts))
        state.metrics.prompt_tokens.inc(n_prompt)
        tokens = tokens_of(request.state)
        tokens.prompt = n_prompt
        meta = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": state.served.name,
        }
        call = Call(state, body, chat, k, echo, shown, submitted, meta, n_prompt, tokens)
        if body.stream:  # the background task runs even if the client left before the stream
            # began (the generator, never started, would not cancel its requests itself)
            done = BackgroundTask(cancel_all)
            return StreamingResponse(stream(call), media_type="text/event-stream", background=done)
        return await whole(call, request)
    except RequestError as err:
        cancel_all()
        param = "messages" if chat and err.param == "prompt" else err.param
        raise APIError(400, str(err), param) from None
    except BaseException:  # any other failure: the choices already submitted would decode on
        cancel_all()  # for nobody, holding their blocks (an overflowing seed did, at choice 16)
        raise
    finally:
        if not body.stream:
            cancel_all()  # e.g. a choice whose events failed: its siblings still ran
