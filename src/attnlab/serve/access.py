"""The access log: one line per request, once its response is over (an ASGI middleware, outside
every other, so that refusals, errors and streams are logged alike).

    127.0.0.1:51234 "POST /v1/completions" 200 0.412 s, tokens 5 + 12
    127.0.0.1:51240 "POST /v1/completions" 499 1.907 s, tokens 4 + 3 (client gone)

method and path, the status sent (499, nginx's "client closed request", for an answer whose
client left before it was ready: nothing was sent), the time from the request's arrival to its
last byte, and the prompt + generated tokens of a completion (the app fills the `Tokens` it
finds in the request's state; a stream's count is its tokens when it ended). Logged at info level
on the "attnlab.serve.access" logger: `attnlab serve` shows it on stderr by default
(`--no-access-log` turns it off); a library user's logging configuration decides.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("attnlab.serve.access")

CLIENT_GONE = 499  # nginx's status for a request whose client closed the connection first


@dataclass
class Tokens:
    """A completion's token counts, filled in by the app as it learns them."""

    prompt: int = 0
    completion: int = 0
    gone: bool = False  # the client left before the answer was whole


def tokens_of(state) -> Tokens:
    """The request's `Tokens` (starlette's request.state), or a loose one where no AccessLog
    runs (an app mounted without it)."""
    return getattr(state, "tokens", None) or Tokens()


class AccessLog:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            return await self.app(scope, receive, send)
        start, status, tokens = time.perf_counter(), [500], Tokens()
        scope.setdefault("state", {})["tokens"] = tokens

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-", 0)
            line = (
                f'{client[0]}:{client[1]} "{scope["method"]} {scope["path"]}" {status[0]} '
                f"{time.perf_counter() - start:.3f} s"
            )
            if tokens.prompt or tokens.completion:
                line += f", tokens {tokens.prompt} + {tokens.completion}"
            log.info(line + (" (client gone)" if tokens.gone else ""))
