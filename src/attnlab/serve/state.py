"""The app's state: one record of what every handler reads, built once by `create_app`
(src/attnlab/serve/app.py) and kept on the app (`app.state.serving`).

A handler asks for it as a FastAPI dependency, `state: State`, so handlers are plain functions
of (body, HTTP request, state) rather than closures inside the app's constructor (FastAPI's
"dependencies" idiom). The record is the server's only mutable object besides the engine: the
grammar is built on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends
from fastapi import Request as HTTPRequest

from ..interop.loaded import LoadedModel
from .metrics import ServeMetrics
from .worker import EngineWorker

if TYPE_CHECKING:  # llguidance is imported only when structured output is first asked for
    from .grammar import Grammar


@dataclass
class AppState:
    served: LoadedModel  # the model, its tokenizer, chat template and special tokens
    worker: EngineWorker  # the engine's thread (worker.py)
    metrics: ServeMetrics
    context: int  # prompt + max_tokens at most (create_app's max_model_len, capped)
    max_waiting: int | None = None  # requests queued and not yet running at most (None: any)
    grammar: Grammar | None = None  # the served model's, built on first use (~1 s)


async def app_state(request: HTTPRequest) -> AppState:
    """The record of the app serving `request` (async: FastAPI runs a plain `def` dependency
    in its thread pool, a thread hop per request)."""
    return request.app.state.serving


State = Annotated[AppState, Depends(app_state)]
