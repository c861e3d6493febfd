"""`attnlab serve MODEL`: an OpenAI-compatible HTTP server (src/attnlab/serve/app.py) over the
continuous-batching engine (src/attnlab/decode/engine.py).

MODEL is a run directory from `attnlab train`, an HF-format folder or a .gguf file
(src/attnlab/serve/loading.py); `--fuse`, `--quantize int8|int4|bf16` and `--packed` swap in the faster inference
modules first (src/attnlab/nn/fuse.py, quantize.py). Needs the `serve` extra:
pip install 'attnlab[serve]'.
"""

from __future__ import annotations

import argparse
import os
import socket

from . import add_command
from .generate import apply_speed_options, packs_on_load, speed_options
from .runs import fail


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        return fail("attnlab serve needs FastAPI and uvicorn: pip install 'attnlab[serve]'")
    import torch

    from ..decode.engine import Engine
    from ..serve.app import create_app
    from ..serve.guard import allowed_hosts
    from ..serve.loading import load_served

    if args.threads:
        torch.set_num_threads(args.threads)
    sock = _bind(args.host, args.port)  # before the (slow) load: a taken port fails at once
    served = load_served(args.model, args.name, packed=packs_on_load(args))
    served.model = apply_speed_options(served.model, args)
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
    engine.warm_up()  # builds the kernels (first use) before the first client waits on them
    app = create_app(
        served,
        engine,
        args.max_model_len,
        hosts=allowed_hosts(args.host, args.allowed_hosts),
        api_key=args.api_key or os.environ.get("ATTNLAB_API_KEY") or None,
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
            await super().startup(sockets)
            if self.started:  # listening now: only then say where
                print(ready, flush=True)

    Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[sock])
    return 0


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


def register(sub) -> None:
    p = add_command(
        sub, "serve", "serve a model over HTTP with OpenAI's /v1/completions and chat API",
        "Continuous batching on a paged KV cache. MODEL: a run directory of `attnlab train`, "
        "an HF-format folder, or a .gguf file. Needs the serve extra: "
        "pip install 'attnlab[serve]'.",
    )  # fmt: skip
    p.add_argument("model", help="run directory, HF-format folder, or .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--name", default=None, help="the model name clients send (default: from the model)"
    )
    p.add_argument("--num-blocks", type=int, default=1024, help="KV pool size, in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-batch", type=int, default=64, help="requests decoded together")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=4096,
        help="prompt tokens prefilled in one engine step (joining requests share it)",
    )
    p.add_argument(
        "--step-tokens",
        type=int,
        default=512,
        help="chunked prefill: tokens one engine step computes, decodes first, then prompt chunks "
        "(0: each prompt prefilled whole, bounded by --max-prefill-tokens)",
    )
    p.add_argument(
        "--max-step-ms",
        type=float,
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
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + max_tokens")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $ATTNLAB_API_KEY, else none)",
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
        "--max-body-bytes", type=int, default=4_000_000, help="larger request bodies get a 413"
    )
    p.add_argument(
        "--max-waiting", type=int, default=256, help="queued requests beyond it get a 429"
    )
    p.add_argument("--docs", action="store_true", help="serve /docs and /openapi.json")
    p.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level (info: one line per request)",
    )
    speed_options(p)
    p.set_defaults(func=run)
