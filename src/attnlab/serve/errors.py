"""The server's errors, each a JSON body in OpenAI's shape (protocol.py `error_body`).

    APIError(status, message, param, code)   raised by any handler: that status, that body
    a body that fails validation             400, every problem named (an unknown field with
                                             its did-you-mean among the fields a body may hold)
    HTTPException (404 path, 405 method)     its status, its detail as the message
    anything else                            500, "internal error: ..." (type server_error)

`add_error_handlers(app)` installs them (src/attnlab/serve/app.py).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import did_you_mean
from .protocol import ChatRequest, CompletionRequest, Message, StreamOptions, error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# every field name a body may hold, for the did-you-mean of an unknown one
_FIELDS = sorted(
    {f for m in (CompletionRequest, ChatRequest, Message, StreamOptions) for f in m.model_fields}
)


def validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """(every problem of the body in one message, the first field named)."""
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
            parts.append(f"{field}: {e.get('msg')} (got {_shown(e.get('input'))})")
    return "; ".join(parts), param


def _shown(value, limit: int = 200) -> str:
    """The repr of a rejected value, cut to `limit` characters: a body of 300,000 stop strings
    is not echoed back whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def check_text(text: str, param: str) -> None:
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


async def _api_error(_, err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.param, code=err.code), err.status)


async def _invalid(_, err: RequestValidationError) -> JSONResponse:
    message, param = validation_message(err)
    return JSONResponse(error_body(message, param), 400)


async def _http(_, err: HTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(err.detail)), err.status_code)


async def _crash(_, err: Exception) -> JSONResponse:
    return JSONResponse(error_body(f"internal error: {err}", kind="server_error"), 500)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http)
    app.add_exception_handler(Exception, _crash)
