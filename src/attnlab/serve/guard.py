"""What every request passes before the app reads it (an ASGI middleware, so it runs before
FastAPI parses a byte of the body): the Host header, the API key and the body size.

- Host: a server bound to a loopback address answers only requests that name it (127.0.0.1,
  localhost, ::1, or `allowed_hosts`). A web page the user visits can make the browser send
  requests to 127.0.0.1 under the page's own domain name (DNS rebinding); those carry that name
  in Host and get a 403. Bound to another address, only `allowed_hosts` (if given) are checked.
- API key: with one set (`attnlab serve --api-key`, or ATTNLAB_API_KEY), every endpoint but
  /health needs `Authorization: Bearer KEY` (the scheme in any case, as RFC 7235 section 2.1
  allows: `bearer KEY` too; the key compared in constant time); 401 otherwise.
- Body size: a POST must say its Content-Length (411 otherwise), at most `max_body_bytes`
  (413 otherwise), so a 50 MB body is refused before it is read.

Every refusal is a JSON body in OpenAI's error shape (protocol.py).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

from starlette.responses import JSONResponse

from .protocol import error_body

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def _hostname(host: str) -> str:
    """'name:port' / '[v6]:port' / 'name' -> the lower-case name without port or brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(address: str) -> bool:
    """Whether a bound address (as the socket reports it) is reachable from this machine only."""
    try:
        return ipaddress.ip_address(_hostname(address)).is_loopback
    except ValueError:  # a name, not an address
        return _hostname(address) in LOOPBACK


def allowed_hosts(bound: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The Host names a server bound to `bound` answers: the loopback names when bound to one,
    plus `extra`; None (any) when bound elsewhere and nothing extra is given."""
    extra = {_hostname(h) for h in extra}
    if _hostname(bound) in LOOPBACK:
        return LOOPBACK | extra
    return frozenset(extra | {_hostname(bound)}) if extra else None


class Guard:
    def __init__(
        self,
        app,
        *,
        hosts: frozenset[str] | None,
        api_key: str | None,
        max_body_bytes: int,
    ) -> None:
        self.app, self.hosts, self.api_key, self.max_body = app, hosts, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, message, code = refusal
            return await JSONResponse(error_body(message, code=code), status)(scope, receive, send)
        return await self.app(scope, receive, send)

    def _refusal(self, scope, headers: dict[str, str]) -> tuple[int, str, str] | None:
        host = _hostname(headers.get("host", ""))
        if self.hosts is not None and host not in self.hosts:
            return (
                403,
                f"Host {host!r} is not this server's name (allowed: {', '.join(sorted(self.hosts))}):"
                f" start the server with --allowed-hosts {host} if it should answer it",
                "host_not_allowed",
            )
        if self.api_key is not None and scope["path"] != "/health":
            scheme, _, given = headers.get("authorization", "").strip().partition(" ")
            right = hmac.compare_digest(given.strip().encode(), self.api_key.encode())
            if scheme.lower() != "bearer" or not right:
                return (
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer KEY' (the "
                    "key the server was started with)",
                    "invalid_api_key",
                )
        if scope["method"] == "POST":
            length = headers.get("content-length")
            if length is None or not length.isdigit():
                return 411, "a request body needs a Content-Length header", "length_required"
            if int(length) > self.max_body:
                return (
                    413,
                    f"the body is {int(length):,} bytes, more than this server accepts "
                    f"({self.max_body:,}; attnlab serve --max-body-bytes): send a shorter prompt",
                    "body_too_large",
                )
        return None
