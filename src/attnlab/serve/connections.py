"""Connections: what a client may hold open, and how long, before it has sent a request.

uvicorn closes a connection idle after a response (its keep-alive timeout), but not one that
never sends a whole request head: 200 connections that sent nothing and 50 that sent a header a
byte at a time stayed open for as long as their clients liked, and with `ulimit -n 1024`, 1,100
of them locked every other client out. So the protocol uvicorn runs is wrapped (`guarded`):

- a request head must arrive whole within `header_timeout` seconds of the moment the server
  waits for one (the connection made; after a response, the larger of it and `idle_timeout`,
  which uvicorn's keep-alive enforces on a connection that sends nothing); a connection that
  has not sent one by then is closed (slowloris);
- at most `max_connections` are open at once: the one beyond gets a 503 at once and is closed,
  while the open ones are served as before (uvicorn's `limit_concurrency` answers 503 only to a
  request, so connections that send nothing would still pile up);
- when the process runs out of file descriptors, asyncio's accept loop logged a traceback per
  failed accept() (up to 100 per tick, stderr grew 137 MB in 30 s): `quiet_accept_errors` logs
  one line when it happens, and then at most one a minute while it goes on (`Condition`). The
  connection limit, below `ulimit -n` (cli/serve.py), keeps it from happening at all.

    config = uvicorn.Config(app, http=guarded(AutoHTTPProtocol, Limits(...)), ...)
    quiet_accept_errors(loop)    # in the server's loop, once it runs
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from dataclasses import dataclass, field

from .protocol import error_body

log = logging.getLogger("attnlab.serve")

# what accept() fails with when the process or system has no descriptor or buffer left
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
REFUSAL_LINGER = 0.5  # seconds a refused connection may take to send its request (read, dropped)


class Condition:
    """A condition logged when it is first met and then at most once a `every` seconds while it
    is met again (with how often since), not once per occurrence: under a flood it comes and
    goes with every connection that closes, so a line per change would be a line per attempt."""

    def __init__(self, says: str, every: float = 60.0) -> None:
        self.says, self.every = says, every
        self.last: float | None = None  # when it was last logged (time.monotonic)
        self.since = 0  # times met since

    def met(self, **detail) -> None:
        now = time.monotonic()
        self.since += 1
        if self.last is None:
            log.warning(self.says.format(**detail))
        elif now - self.last >= self.every:
            more = f" ({self.since - 1:,} more times in the last {now - self.last:.0f} s)"
            log.warning(self.says.format(**detail) + more)
        else:
            return
        self.last, self.since = now, 0


@dataclass
class Limits:
    max_connections: int  # open at once; beyond: 503 and closed
    header_timeout: float  # seconds for a whole request head to arrive
    idle_timeout: float = 0.0  # uvicorn's keep-alive: an idle connection after a response
    full: Condition = field(
        default_factory=lambda: Condition(
            "{open} connections are open, the most this server holds (--max-connections): "
            "new ones get a 503 until some close (said at most once a minute)"
        )
    )
    out_of_files: Condition = field(
        default_factory=lambda: Condition(
            "cannot accept connections: {reason}; they wait in the kernel's queue until some "
            "close: lower --max-connections or raise the limit (ulimit -n) (said at most once "
            "a minute)"
        )
    )


def _busy() -> bytes:
    body = json.dumps(
        error_body(
            "this server holds as many connections as it may (attnlab serve --max-connections): "
            "retry later",
            kind="server_error",
            code="too_many_connections",
        )
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


BUSY = _busy()


def guarded(base: type[asyncio.Protocol], limits: Limits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class `base` (h11 or httptools) with the limits above. It relies
    on what both have: `connections` (the server's open ones), `cycle` (the request being
    answered, set once its head is parsed), `loop`, `transport`, `on_response_complete`."""

    class Guarded(base):  # type: ignore[misc, valid-type]
        _refused = False
        _timer: asyncio.TimerHandle | None = None
        _awaited = None  # the request in progress when the server began waiting for a head
        _tail = b""  # a refused connection's last bytes read (its head's end may straddle reads)

        def connection_made(self, transport) -> None:
            if len(self.connections) >= limits.max_connections:
                self._refused, self.transport = True, transport
                limits.full.met(open=len(self.connections))
                transport.write(BUSY)
                # closed once its request is read (or soon): closed with unread bytes, the
                # kernel would reset it and the client might never see the 503
                self._timer = self.loop.call_later(REFUSAL_LINGER, transport.close)
                return
            super().connection_made(transport)
            self._await_head()

        def data_received(self, data: bytes) -> None:
            if self._refused:  # the refused request: read to the end of its head, then closed
                seen = self._tail + data
                if b"\r\n\r\n" in seen:
                    self.transport.close()
                self._tail = seen[-3:]
                return
            super().data_received(data)

        def eof_received(self):
            if self._refused:
                return None  # close
            return super().eof_received()

        def connection_lost(self, exc) -> None:
            self._stop_timer()
            if not self._refused:
                super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # kept alive: --idle-timeout may be longer
                self._await_head(max(limits.header_timeout, limits.idle_timeout))

        def _await_head(self, seconds: float | None = None) -> None:
            self._stop_timer()
            self._awaited = self.cycle
            wait = limits.header_timeout if seconds is None else seconds
            self._timer = self.loop.call_later(wait, self._head_timeout)

        def _head_timeout(self) -> None:
            self._timer = None
            cycle = self.cycle
            waiting = cycle is None or cycle.response_complete  # no request in progress
            if cycle is self._awaited and waiting and not self.transport.is_closing():
                self.transport.close()  # no whole request head in time

        def _stop_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, limits: Limits) -> None:
    """Route the loop's accept() failures for want of descriptors to one line per condition
    (`limits.out_of_files`); every other error to the loop's default handler."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        err = context.get("exception")
        if isinstance(err, OSError) and err.errno in OUT_OF_RESOURCES:
            limits.out_of_files.met(reason=f"{err.strerror} ({errno.errorcode[err.errno]})")
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
