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

`create_app` builds the app's one record (state.py `AppState`) and wires the rest:

    guard.py, access.py    the middleware (outermost: the access log)
    errors.py              APIError and the error handlers
    handlers.py            the endpoints, over the record (a FastAPI dependency)
      submit.py            body -> engine Requests (sampling, grammar, --max-waiting)
      answer.py            events of a choice; the whole answer; stream.py: the streamed one
      replies.py           incremental text, log-probabilities, usage in OpenAI's shapes
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from ..decode.engine import Engine
from ..interop.loaded import LoadedModel
from .access import AccessLog
from .errors import add_error_handlers
from .guard import Guard
from .handlers import router
from .metrics import ServeMetrics
from .state import AppState
from .worker import EngineWorker


@asynccontextmanager
async def _lifespan(app: FastAPI):
    yield
    app.state.serving.worker.close()


def create_app(
    served: LoadedModel,
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
    metrics = ServeMetrics(worker.stats)
    worker.on_step = metrics.step

    off = {} if docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="attnlab serve", version="1", lifespan=_lifespan, **off)
    app.add_middleware(Guard, hosts=hosts, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(AccessLog)  # the outermost: Guard's refusals are logged too
    app.state.serving = AppState(served, worker, metrics, context, max_waiting)
    add_error_handlers(app)
    app.include_router(router)
    return app
