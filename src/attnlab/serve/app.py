"""The OpenAI-compatible HTTP app (FastAPI) over the continuous-batching engine.

    GET  /health                 {"status": "ok", blocks free/total, running, waiting}
    GET  /v1/models              the one model served
    GET  /metrics                Prometheus text format (metrics.py)
    POST /v1/completions         prompt (text or token ids) -> text; stream=true: server-sent events
    POST /v1/chat/completions    messages -> the model's chat template -> the assistant's reply

Each request becomes an engine Request (src/attnlab/decode/engine.py), queued to the engine's
thread (worker.py); its tokens come back one by one, are detokenized incrementally (text is sent
only once it is whole UTF-8 and cannot be the start of a stop string) and end at the model's EOS
("stop"), a stop string ("stop", the request is cancelled at once), or max_tokens ("length").
A client that goes away cancels its requests, which frees their KV blocks: a stream's when its
connection closes, a whole answer's as soon as the server reads the client's disconnect (its
handler watches for it while it waits; without that, a dropped client's request decoded to
max_tokens and held its blocks). Every error is a JSON body in OpenAI's shape (protocol.py) with
a 4xx status naming the problem. Each request is logged once answered (access.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..decode.engine import Engine, RequestError
from ..decode.engine import Request as EngineRequest
from ..errors import did_you_mean
from .access import CLIENT_GONE, AccessLog, Tokens, tokens_of
from .chat import TemplateError, render_chat
from .guard import Guard
from .loading import ServedModel
from .metrics import ServeMetrics
from .protocol import ChatRequest, CompletionRequest, Message, StreamOptions, error_body
from .tools import CallStream, forced_calls, forced_schema, parse_calls, template_takes_tools
from .worker import EngineWorker


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# every field name a body may hold, for the did-you-mean of an unknown one
_FIELDS = sorted(
    {f for m in (CompletionRequest, ChatRequest, Message, StreamOptions) for f in m.model_fields}
)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for e in err.errors():
        if e.get("type") == "json_invalid":  # its loc is a character offset, not a field
            parts.append("the body is not valid JSON")
            continue
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        field = ".".join(loc) or "body"
        param = param or field
        if e.get("type") == "extra_forbidden":
            hint = did_you_mean(loc[-1] if loc else field, _FIELDS) or (
                " Leave it out (see the OpenAI API reference)."
            )
            parts.append(f"unknown field '{field}'.{hint}")
        else:
            parts.append(f"{field}: {e.get('msg')} (got {e.get('input')!r})")
    return "; ".join(parts), param


class _Text:
    """Incremental detokenization with stop strings (see the module docstring)."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tok, self.stops, self.ids, self.sent = tokenizer, stops, [], 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.stopped = "", False

    def add(self, token: int) -> str:
        self.ids.append(token)
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        if self.stops:
            hits = [
                i for s in self.stops if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0
            ]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
                return self.flush()
        safe = len(self.text) - self.hold
        if self.text.endswith("\ufffd"):  # a multi-byte character not yet complete
            safe = min(safe, len(self.text) - 1)
        delta = self.text[self.sent : max(safe, self.sent)]
        self.sent += len(delta)
        return delta

    def flush(self) -> str:
        delta = self.text[self.sent :]
        self.sent = len(self.text)
        return delta


def create_app(
    served: ServedModel,
    engine: Engine,
    max_model_len: int | None = None,
    *,
    hosts: frozenset[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = 4_000_000,
    max_waiting: int | None = None,
    docs: bool = False,
) -> FastAPI:
    """The app serving `served` through `engine`; max_model_len caps prompt + max_tokens (default:
    the context the model was trained for, as its config or GGUF metadata says; never more than
    its position table or the whole pool). `hosts`, `api_key`, `max_body_bytes`: what guard.py
    checks before a request is read; `max_waiting`: requests submitted and not yet running (the
    engine's `queued`) are at most this many: a request that would pass it gets a 429, one that
    alone asks for more (n choices of each prompt) a 400; `docs`: serve /docs and /openapi.json."""
    pool = engine.cache.num_blocks * engine.cache.block_size
    asked = max_model_len if max_model_len is not None else served.context_length
    context = min(x for x in (asked, engine.max_positions, pool) if x is not None)
    worker = EngineWorker(engine)

    @asynccontextmanager
    async def lifespan(_):
        yield
        worker.close()

    off = {} if docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="attnlab serve", version="1", lifespan=lifespan, **off)
    app.add_middleware(Guard, hosts=hosts, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(AccessLog)  # the outermost: Guard's refusals are logged too
    app.state.worker, app.state.served, app.state.context = worker, served, context
    metrics = ServeMetrics(worker.stats)
    worker.on_step = metrics.step

    @app.exception_handler(APIError)
    async def _api_error(_, err: APIError):
        return JSONResponse(error_body(err.message, err.param, code=err.code), err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, err: RequestValidationError):
        message, param = _validation_message(err)
        return JSONResponse(error_body(message, param), 400)

    @app.exception_handler(HTTPException)
    async def _http(_, err: HTTPException):
        return JSONResponse(error_body(str(err.detail)), err.status_code)

    @app.exception_handler(Exception)
    async def _crash(_, err: Exception):
        return JSONResponse(error_body(f"internal error: {err}", kind="server_error"), 500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served.name, "context": context, **worker.stats()}

    @app.get("/metrics")
    async def prometheus():
        body, kind = metrics.scrape()
        return Response(body, media_type=kind)

    @app.get("/v1/models")
    async def models():
        card = {"id": served.name, "object": "model", "created": 0, "owned_by": "attnlab"}
        return {"object": "list", "data": [{**card, "max_model_len": context}]}

    def _engine_request(
        body,
        prompt: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        choice: int = 0,
        echo: bool = False,
    ) -> EngineRequest:
        if body.model != served.name:
            raise APIError(
                404,
                f"model '{body.model}' is not served here: this server serves '{served.name}'",
                "model",
                "model_not_found",
            )
        if max_tokens is None:  # OpenAI's default: the rest of the context (checked on submit)
            max_tokens = context - len(prompt)
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
            constraint=_constraint(body),
        )

    grammars: list = []  # the served model's Grammar, built on first use (~1 s)

    def _constraint(body):
        schema = body.response_format.schema() if body.response_format is not None else None
        param = "response_format"
        if schema is None and isinstance(body, ChatRequest) and body.forces_call():
            schema = forced_schema(body.tools, body.tool_mode(), body.parallel_tool_calls)
            param = "tool_choice"
        if schema is None:
            return None
        if not served.eos_token_ids:
            raise APIError(
                400,
                f"'{served.name}' has no EOS token, so structured output cannot end: leave out "
                f"{param}",
                param,
            )
        try:
            if not grammars:
                from .grammar import Grammar

                grammars.append(Grammar(served.tokenizer, served.eos_token_ids[0]))
            return grammars[0].constraint(schema)
        except ImportError:
            raise APIError(
                400,
                f"{param} needs the llguidance package: pip install 'attnlab[serve]'",
                param,
            ) from None
        except ValueError as err:  # GrammarError, or a schema llguidance rejects
            raise APIError(400, str(err), param) from None

    async def _tokens(rid: int, queue) -> AsyncIterator:
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
                (metrics.ttft if first else metrics.itl).observe(now - last)
                first, last = False, now
                metrics.generated.inc()
                done = event.finish_reason is not None
                yield event
                if done:
                    return
        finally:
            if not done:
                worker.cancel(rid)

    def _check_waiting(body, n_prompts: int) -> None:
        """The --max-waiting bound, for a request of n_prompts prompts × body.n choices: each
        choice is one engine request. No await between this and the submits: two handlers
        cannot both pass it on one free place."""
        asked = n_prompts * body.n
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
        waiting = worker.waiting()
        if waiting + asked > max_waiting:
            raise APIError(
                429,
                f"{waiting} requests are already waiting, and this server queues at most "
                f"{max_waiting} (attnlab serve --max-waiting): retry later",
                code="too_many_requests",
            )

    async def _run(
        request: HTTPRequest,
        body,
        prompts: list[list[int]],
        max_tokens: int | None,
        chat: bool,
    ):
        """Answer `prompts` (completions may send several: choice p * n + j is prompt p's j-th)."""
        k = body.logprobs_k() if chat else body.logprobs
        echo = not chat and body.echo
        shown = [p for p in prompts for _ in range(body.n)]  # each choice's prompt
        _check_waiting(body, len(prompts))
        submitted = []
        try:  # the engine's rules (src/attnlab/decode/requests.py), under this server's context
            for i, prompt in enumerate(shown):  # n per prompt (seeded: seed, seed + 1, ...)
                req = _engine_request(body, prompt, max_tokens, k, i % body.n, echo)
                submitted.append(worker.submit(req, context=context))
        except RequestError as err:
            for rid, _ in submitted:
                worker.cancel(rid)
            param = "messages" if chat and err.param == "prompt" else err.param
            raise APIError(400, str(err), param) from None
        metrics.requests.labels("chat" if chat else "completions").inc()
        n_prompt = sum(map(len, prompts))
        metrics.prompt_tokens.inc(n_prompt)
        tokens = tokens_of(request.state)
        tokens.prompt = n_prompt
        prefix = "chatcmpl" if chat else "cmpl"
        meta = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": served.name,
        }
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            gen = _stream(
                submitted, body, meta, shown, n_prompt, chat, k, echo, include_usage, tokens
            )
            return StreamingResponse(gen, media_type="text/event-stream")
        whole = asyncio.gather(
            *(
                _answer(rid, queue, _Text(served.tokenizer, body.stops()))
                for rid, queue in submitted
            )
        )
        answers = await _unless_gone(request, whole, [rid for rid, _ in submitted])
        if answers is None:  # nobody to answer: a status for the access log, sent nowhere
            tokens.gone = True
            return Response(status_code=CLIENT_GONE)
        usage = _usage(n_prompt, sum(n for _, _, n, _ in answers))
        tokens.completion = usage["completion_tokens"]
        tok = served.tokenizer
        choices = []
        for i, (text, finish, _, seen) in enumerate(answers):
            if chat:
                message, finish = _with_calls(
                    body, {"role": "assistant", "content": text}, seen, finish
                )
                choice = {"index": i, "message": message, "finish_reason": finish}
                if k is not None:
                    choice["logprobs"] = {"content": [_chat_logprob(tok, e) for e in seen]}
            else:
                prompt = shown[i] if echo else []
                head = seen[0].prompt_logprobs if echo and seen else ()
                lp = _completion_logprobs(tok, seen, k, prompt, head) if k is not None else None
                head = tok.decode(prompt, skip_special_tokens=False) if echo else ""
                choice = {"index": i, "text": head + text, "logprobs": lp, "finish_reason": finish}
            choices.append(choice)
        kind = "chat.completion" if chat else "text_completion"
        return {**meta, "object": kind, "choices": choices, "usage": usage}

    async def _unless_gone(request: HTTPRequest, work: asyncio.Future, rids: list[int]):
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
                    worker.cancel(rid)
                await asyncio.gather(work, return_exceptions=True)
        return work.result() if not work.cancelled() else None

    def _with_calls(body, message: dict, events: list, finish: str) -> tuple[dict, str]:
        """The assistant's message with the tool calls its answer holds (serve/tools.py), and
        the finish reason ("tool_calls" for calls the model chose to make)."""
        mode = body.tool_mode()
        if mode is None:
            return message, finish
        if mode == "auto":  # read the raw text: several formats' markers are special tokens
            content, calls = parse_calls(_raw(events), {t.function.name for t in body.tools})
        else:
            content, calls = None, forced_calls(message["content"], body.tools, mode)
        if not calls:
            return message, finish
        if finish == "stop" and isinstance(mode, str):  # auto, required (named: "stop", as OpenAI)
            finish = "tool_calls"
        return {"role": "assistant", "content": content, "tool_calls": calls}, finish

    def _raw(events: list) -> str:
        """The answer's text with special tokens kept (but its end-of-sequence token)."""
        ids = [e.token for e in events if e.token not in served.eos_token_ids]
        return served.tokenizer.decode(ids, skip_special_tokens=False)

    async def _answer(rid: int, queue, text: _Text) -> tuple[str, str, int, list]:
        """One choice, whole: (text, finish_reason, tokens generated, their events)."""
        n, finish, seen = 0, "length", []
        events = _tokens(rid, queue)
        async for event in events:
            n += 1
            seen.append(event)
            text.add(event.token)
            if text.stopped:
                finish = "stop"
                await events.aclose()  # cancels the request: its blocks are freed
                break
            if event.finish_reason:
                finish = event.finish_reason
        return text.text, finish, n, seen

    async def _stream(
        submitted, body, meta, shown, n_prompt, chat, k, echo, include_usage, tokens: Tokens
    ):
        """Server-sent events for every choice: each choice's chunks as its tokens come (choice
        i's chunks carry index i, interleaved as they are ready), then usage, then [DONE]."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        merged: asyncio.Queue = asyncio.Queue()
        counts = [0] * len(submitted)

        async def pump(i: int, rid: int, queue) -> None:
            text = _Text(served.tokenizer, body.stops())
            try:
                async for choice in _choice_chunks(
                    i, rid, queue, text, body, chat, k, echo, shown[i], counts
                ):
                    merged.put_nowait(choice)
            except APIError as err:
                merged.put_nowait(err)
            finally:
                merged.put_nowait(None)  # this choice is over

        tasks = [asyncio.create_task(pump(i, *s)) for i, s in enumerate(submitted)]
        try:
            left = len(tasks)
            while left:
                item = await merged.get()
                if item is None:
                    left -= 1
                elif isinstance(item, APIError):
                    yield f"data: {json.dumps(error_body(item.message, kind='server_error'))}\n\n"
                else:
                    yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [item]})}\n\n"
        finally:  # a client gone mid-stream lands here: every choice's request is cancelled
            tokens.gone = bool(left)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            tokens.completion = sum(counts)
        if include_usage:
            usage = _usage(n_prompt, sum(counts))
            yield f"data: {json.dumps({**meta, 'object': obj, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def _choice_chunks(i, rid, queue, text: _Text, body, chat, k, echo, prompt, counts):
        """Choice i's chunks: (chat) the role first; (echo) the prompt and, with logprobs, its
        log-probabilities; then each piece of text once it is safe to send (see _Text) with the
        logprobs of the tokens it came from. With tools (chat), the answer is read for calls as
        it grows (serve/tools.py CallStream): content until a call starts, then each call's name
        and its arguments piece by piece."""
        tok = served.tokenizer
        offset, pending, seen = 0, [], []  # completions' text_offset so far; tokens not yet sent
        mode = body.tool_mode() if chat else None
        reader = CallStream(body.tools, mode) if mode is not None else None

        def chunk(delta, finish: str | None, events: list, shown=(), head=()) -> dict:
            if chat:
                lp = {"content": [_chat_logprob(tok, e) for e in events]} if k is not None else None
                d = delta if isinstance(delta, dict) else {"content": delta} if delta else {}
                return {"index": i, "delta": d, "logprobs": lp, "finish_reason": finish}
            nonlocal offset
            lp = None
            if k is not None:
                lp = _completion_logprobs(tok, events, k, shown, head, offset)
                offset += sum(len(p) for p in lp["tokens"])
            return {"index": i, "text": delta, "logprobs": lp, "finish_reason": finish}

        if chat:
            yield {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                   "finish_reason": None}  # fmt: skip
        events = _tokens(rid, queue)
        try:
            async for event in events:
                if echo and counts[i] == 0:
                    head = tok.decode(prompt, skip_special_tokens=False)
                    yield chunk(head, None, [], prompt, event.prompt_logprobs or ())
                counts[i] += 1
                pending.append(event)
                seen.append(event)
                delta = text.add(event.token)
                finish = "stop" if text.stopped else event.finish_reason
                if finish:
                    delta += text.flush()
                if reader is not None:  # the answer so far, as _with_calls reads it whole
                    raw = _raw(seen) if mode == "auto" and not text.stopped else text.text
                    content, calls = reader.feed(raw, final=finish is not None)
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
            await events.aclose()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        p = body.prompt  # one text or token list, or a list of them (a batch: OpenAI's shape)
        batch = [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)
        texts = [x for x in batch if isinstance(x, str)]
        for j, x in enumerate(texts):
            _check_text(x, "prompt" if len(batch) == 1 else f"prompt.{j}")
        encoded = iter(await asyncio.to_thread(_encode_all, texts) if texts else ())  # off the loop
        prompts = [next(encoded) if isinstance(x, str) else list(x) for x in batch]
        return await _run(request, body, prompts, body.max_tokens, chat=False)

    def _encode_all(texts: list[str], special: bool = True) -> list[list[int]]:
        """Token ids of each text. tokenizers lets go of the GIL while it encodes: a 100k-token
        prompt (0.3 s) left another thread's longest pause at 8 ms (measured here)."""
        return [e.ids for e in served.tokenizer.encode_batch(texts, add_special_tokens=special)]

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: HTTPRequest):
        if served.chat_template is None:
            raise APIError(
                400,
                f"'{served.name}' has no chat template, so chat messages cannot be formatted: "
                "use /v1/completions with a prompt you format yourself",
                "messages",
            )
        messages = [m.plain() for m in body.messages]
        for i, m in enumerate(messages):
            _check_text(json.dumps(m, ensure_ascii=False), f"messages.{i}")
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
        (prompt,) = await asyncio.to_thread(_encode_all, [text], False)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await _run(request, body, [prompt], max_tokens, chat=True)

    return app


def _piece(tok, token: int) -> str:
    return tok.decode([token], skip_special_tokens=False)


def _chat_logprob(tok, e) -> dict:
    """One token of a chat choice's `logprobs.content`, in OpenAI's shape."""

    def entry(token: int, logprob: float) -> dict:
        s = _piece(tok, token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {**entry(e.token, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top_logprobs]}


def _alternatives(tok, top) -> dict[str, float]:
    """{text: logprob} of the best tokens; two whose text is the same (byte pieces of one
    character both read "\ufffd") are told apart by their vocabulary entries."""
    out: dict[str, float] = {}
    for t, v in top:
        key = _piece(tok, t)
        out[key if key not in out else tok.id_to_token(t)] = v
    return out


def _completion_logprobs(
    tok, events: list, k: int, prompt: list[int] = (), head=(), start: int = 0
) -> dict:
    """A completion choice's `logprobs` (OpenAI's legacy shape): each token's text, its
    log-probability, its k best alternatives, its character offset in the text (from `start`:
    a streamed chunk's offsets continue the text before it); with echo the prompt's tokens
    first, `head` their (logprob, best) pairs given the tokens before each (the first has none:
    nothing comes before it)."""
    pieces = [_piece(tok, t) for t in prompt] + [_piece(tok, e.token) for e in events]
    offsets = list(itertools.accumulate(map(len, pieces), initial=start))[:-1]
    head = list(head or ())
    lps = [None, *(lp for lp, _ in head)][: len(prompt)] + [e.logprob for e in events]
    tops = [None, *(_alternatives(tok, t) for _, t in head)][: len(prompt)]
    return {
        "tokens": pieces,
        "token_logprobs": lps,
        "top_logprobs": tops + [_alternatives(tok, e.top_logprobs) for e in events] if k else None,
        "text_offset": offsets,
    }


def _check_text(text: str, param: str) -> None:
    """A 400 for text that is not Unicode a tokenizer can read: JSON allows a lone UTF-16
    surrogate ("\\ud800"), which no UTF-8 encoder accepts (it was a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(
            400,
            f"{param} holds a lone UTF-16 surrogate (U+{ord(text[err.start]):04X} at character "
            f"{err.start}), which is not text: send valid Unicode",
            param,
        ) from None


def _usage(prompt: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
