"""`attnlab serve MODEL`: an OpenAI-compatible HTTP server (src/attnlab/serve/app.py) over the
continuous-batching engine (src/attnlab/decode/engine.py).

MODEL is a decoder-only (causal LM) model: a run directory from `attnlab train`, an HF-format
folder or a .gguf file (src/attnlab/loading.py; a translation or encoder run is refused,
naming the command for it); `--fuse`, `--quantize int8|int4|bf16` and `--packed` swap in the
faster inference modules first (src/attnlab/nn/fuse.py, quantize.py). Needs the `serve` extra:
pip install 'attnlab[serve]'.

Started, it says where it listens (stdout), warns on stderr when it listens beyond this machine
without an API key, logs one line per request (stderr, serve/access.py) and stops on Ctrl-C with
"stopped" (exit status 0: the normal way to stop a server, not an error).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from pathlib import Path

from . import add_command
from .generate import (
    apply_speed_options,
    check_device,
    check_local,
    packs_on_load,
    speed_options,
)
from .numbers import integer, real, threads
from .runs import check_decoder_only, fail


def run(args: argparse.Namespace) -> int:
    api_key = _api_key(args.api_key, os.environ.get("ATTNLAB_API_KEY"))  # before any import
    try:
        import uvicorn
    except ImportError:
        return fail("attnlab serve needs FastAPI and uvicorn: pip install 'attnlab[serve]'")
    import torch

    from ..decode.engine import Engine
    from ..loading import load_model
    from ..serve.app import create_app
    from ..serve.connections import Limits, guarded, quiet_accept_errors
    from ..serve.guard import allowed_hosts, is_loopback

    if args.threads:
        torch.set_num_threads(args.threads)
    sock = _bind(args.host, args.port)  # before the (slow) load: a taken port fails at once
    limits = Limits(_max_connections(args.max_connections), args.header_timeout, args.idle_timeout)
    if api_key is None and not is_loopback(sock.getsockname()[0]):
        print(
            f"warning: listening on {args.host} without an API key: anyone who can reach this "
            "port can use the model. Set one with --api-key KEY or ATTNLAB_API_KEY (clients send "
            "'Authorization: Bearer KEY'), or bind to 127.0.0.1",
            file=sys.stderr,
            flush=True,
        )
    check_local(args.model)
    device = check_device(args)
    served = load_model(args.model, args.name, packed=packs_on_load(args))
    check_decoder_only(served.model, Path(args.model), "serve")
    served.model = apply_speed_options(served.model, args)
    if device is not None:
        served.model = served.model.to(device)
    try:
        engine = Engine(
            served.model,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_batch=args.max_batch,
            max_prefill_tokens=args.max_prefill_tokens,
            step_tokens=args.step_tokens or None,
            prefix_caching=args.prefix_caching and bool(args.step_tokens),
            max_step_ms=args.max_step_ms,
        )
    except (TypeError, ValueError) as err:
        return fail(err)
    # builds the kernels (first use) and, on CUDA, the decode graphs before a client waits
    engine.warm_up(
        args.capture_rows,
        args.capture_widths,
        lambda line: print(line, flush=True),
        max_len=args.max_model_len or served.context_length,
    )
    app = create_app(
        served,
        engine,
        args.max_model_len,
        hosts=allowed_hosts(args.host, args.allowed_hosts),
        api_key=api_key,
        max_body_bytes=args.max_body_bytes,
        max_waiting=args.max_waiting,
        docs=args.docs,
    )
    how = "fp32" if not args.quantize else f"weight-only {args.quantize}"
    how = "the file's blocks kept (--packed)" if getattr(args, "packed", False) else how
    how += ", fused projections" if args.fuse or args.quantize or args.packed else ""
    ready = f"serving {served.name!r} ({how}) on http://{args.host}:{args.port}/v1"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            quiet_accept_errors(asyncio.get_running_loop(), limits)
            await super().startup(sockets)
            if self.started:  # listening now: only then say where
                print(ready, flush=True)

    _log_to_stderr(args.access_log)
    # uvicorn's own access log is off: serve/access.py's line has the duration and tokens too
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=False,
        http=guarded(AutoHTTPProtocol, limits),  # serve/connections.py
        timeout_keep_alive=args.idle_timeout,
    )
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again
        print("stopped", flush=True)
    return 0


def _api_key(given: str | None, environ: str | None) -> str | None:
    """The key from --api-key, else ATTNLAB_API_KEY, else None; an empty one (a shell variable
    that was never set: --api-key "$KEY") is refused, not read as "no key"."""
    for key, where in ((given, "--api-key"), (environ, "ATTNLAB_API_KEY")):
        if key is None:
            continue
        if not key.strip():
            raise ValueError(
                f"{where} is empty (an unset shell variable?), which would serve without "
                f"authentication: give the key itself, or leave out --api-key and unset "
                f"ATTNLAB_API_KEY to serve without one"
            )
        if key != key.strip():  # HTTP strips a header value's ends: it could never match
            raise ValueError(f"{where} starts or ends with whitespace: give the key without it")
        odd = next((c for c in key if not " " <= c <= "~"), None)
        if odd is not None:  # a header value is bytes: clients send ASCII (httpx, the openai
            # client refuse anything else) or UTF-8 (curl), which the server reads as latin-1
            raise ValueError(
                f"{where} holds {odd!r} (U+{ord(odd):04X}), which HTTP clients cannot send in "
                "the Authorization header as it is: use a key of printable ASCII characters, "
                "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return key
    return None


# descriptors the server keeps for itself besides its connections (the listening socket, the
# model's files while they load, torch's; 8 were open once serving, measured here)
OWN_FILES = 32


def _max_connections(asked: int | None) -> int:
    """--max-connections, within what `ulimit -n` allows: the soft limit is raised towards the
    hard one if it must be; the default is 1024, or what the limit leaves. A limit above what the
    process may open is kept with a warning: past it, accept() fails (serve/connections.py logs
    that once)."""
    import resource

    want = asked if asked is not None else 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want + OWN_FILES:
        top = want + OWN_FILES if hard == resource.RLIM_INFINITY else min(hard, want + OWN_FILES)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, top), hard))
            soft = max(soft, top)
        except (ValueError, OSError):
            pass
    room = want if soft == resource.RLIM_INFINITY else max(1, soft - OWN_FILES)
    if want <= room:
        return want
    if asked is None:
        return room
    print(
        f"warning: --max-connections {asked} is more than this process may open (ulimit -n "
        f"{soft}, {OWN_FILES} kept for the server): past about {room} connections new ones wait "
        f"in the kernel's queue; raise ulimit -n or lower --max-connections",
        file=sys.stderr,
        flush=True,
    )
    return asked


def _log_to_stderr(access: bool) -> None:
    """attnlab.serve's messages (a failed engine step, the access log) on stderr, one per line."""
    log = logging.getLogger("attnlab.serve")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO)
    logging.getLogger("attnlab.serve.access").setLevel(logging.INFO if access else logging.WARNING)


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it once the model is loaded), or an
    error naming the taken port and the fix."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        raise ValueError(f"--host {host!r} is not an address this machine knows: {err}") from None
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets that
    # say TCP; with proto 0 a response written in two parts (headers, then the body) waited for
    # the client's delayed ACK, ~40 ms on every /health and every non-streamed answer
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} ({err.strerror}): another server holds the port; "
            f"stop it or choose another --port"
        ) from None
    return sock


def _sizes(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]: sizes >= 1, or argparse's error naming the value."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give sizes >= 1 separated by commas, e.g. 1,2,4,8"
        )
    return sizes


def register(sub) -> None:
    p = add_command(
        sub, "serve", "serve a model over HTTP with OpenAI's /v1/completions and chat API",
        "Continuous batching on a paged KV cache. MODEL: a decoder-only (causal LM) model: a run "
        "directory of `attnlab train`, an HF-format folder, or a .gguf file (a translation run: "
        "attnlab translate; an encoder run: attnlab eval). Needs the serve extra: "
        "pip install 'attnlab[serve]'.",
        examples=(
            "attnlab serve SmolLM2-135M-Instruct.Q4_1.gguf --name smollm2 --port 8765",
            "attnlab serve runs/shakespeare-char --device cuda",
        ),
    )  # fmt: skip
    p.add_argument("model", help="run directory, HF-format folder, or .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="port to listen on")
    p.add_argument(
        "--name", default=None, help="the model name clients send (default: from the model)"
    )
    p.add_argument("--num-blocks", type=integer(1), default=1024, help="KV pool size, in blocks")
    p.add_argument("--block-size", type=integer(1), default=16, help="tokens per KV block")
    p.add_argument("--max-batch", type=integer(1), default=64, help="requests decoded together")
    p.add_argument(
        "--max-prefill-tokens",
        type=integer(1),
        default=4096,
        help="prompt tokens prefilled in one engine step (joining requests share it)",
    )
    p.add_argument(
        "--step-tokens",
        type=integer(0),
        default=512,
        help="chunked prefill: tokens one engine step computes, decodes first, then prompt chunks "
        "(0: each prompt prefilled whole, bounded by --max-prefill-tokens)",
    )
    p.add_argument(
        "--max-step-ms",
        type=real(0, low_open=True),
        default=None,
        metavar="MS",
        help="chunked prefill: while requests decode, a step's prompt chunks get only what fits "
        "in MS milliseconds after its decodes (timed on this machine as it runs; none if not one "
        "token fits): the running streams' inter-token latency stays near MS, at the cost of "
        "slower prompt admission (default: the token budget alone; needs --step-tokens)",
    )
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep full KV blocks for later requests whose context starts the same (a shared "
        "system prompt is computed once; needs --step-tokens)",
    )
    p.add_argument(
        "--max-model-len", type=integer(2), default=None, help="cap on prompt + max_tokens"
    )
    p.add_argument(
        "--capture-rows",
        type=_sizes,
        default=None,
        metavar="N,N,...",
        help="on CUDA: the batch sizes whose decode graphs are compiled and captured at start "
        "(default: the powers of 2 below --max-batch, and it); a step's rows are padded up to "
        "the next (each size × width is a compile of the model: tens of seconds on a GPU)",
    )
    p.add_argument(
        "--capture-widths",
        type=_sizes,
        default=None,
        metavar="N,N,...",
        help="on CUDA: the block-table widths (blocks a row) captured at start (default: powers "
        "of 2 up to the longest request's, --max-model-len or the model's context); /metrics "
        "counts any graph compiled after start",
    )
    p.add_argument("--threads", type=threads, default=None, help="torch intra-op threads")
    p.add_argument("--device", default=None, help="cpu (the default), cuda, cuda:1 ...")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $ATTNLAB_API_KEY, else none; an empty key is refused; bound beyond "
        "loopback without one, serve warns)",
    )
    p.add_argument(
        "--allowed-hosts",
        nargs="*",
        default=[],
        metavar="HOST",
        help="Host header names answered besides the bound address (bound to 127.0.0.1: "
        "127.0.0.1, localhost and ::1 only, against DNS rebinding)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=integer(1),
        default=4_000_000,
        help="larger request bodies get a 413",
    )
    p.add_argument(
        "--max-connections",
        type=integer(1),
        default=None,
        metavar="N",
        help="connections open at once, at most; the one beyond gets a 503 and is closed "
        "(default: 1024, or what ulimit -n leaves)",
    )
    p.add_argument(
        "--header-timeout",
        type=real(0, low_open=True),
        default=10.0,
        metavar="SECONDS",
        help="a connection that has not sent a whole request head this long after connecting "
        "(or after its last answer) is closed",
    )
    p.add_argument(
        "--idle-timeout",
        type=real(0, low_open=True),
        default=5.0,
        metavar="SECONDS",
        help="a kept-alive connection that sends nothing this long after its last answer is "
        "closed (uvicorn's keep-alive timeout)",
    )
    p.add_argument(
        "--max-waiting",
        type=integer(1),
        default=256,
        help="requests submitted and not yet running, at most; beyond it a 429 (retry later), a "
        "request asking for more by itself (n choices) a 400",
    )
    p.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's own log level (info: its start-up and shutdown steps)",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one line per request on stderr: method, path, status, duration, tokens",
    )
    speed_options(p)
    p.set_defaults(func=run)
