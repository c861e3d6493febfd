"""`attnlab serve MODEL`: an OpenAI-compatible HTTP server (src/attnlab/serve/app.py) over the
continuous-batching engine (src/attnlab/decode/engine.py).

MODEL is a run directory from `attnlab train`, an HF-format folder or a .gguf file
(src/attnlab/serve/loading.py); `--fuse` and `--quantize int8|bf16` swap in the faster inference
modules first (src/attnlab/nn/fuse.py, quantize.py). Needs the `serve` extra:
pip install 'attnlab[serve]'.
"""

from __future__ import annotations

import argparse

from .generate import apply_speed_options, speed_options
from .runs import fail


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        return fail("attnlab serve needs FastAPI and uvicorn: pip install 'attnlab[serve]'")
    import torch

    from ..decode.engine import Engine
    from ..serve.app import create_app
    from ..serve.loading import load_served

    if args.threads:
        torch.set_num_threads(args.threads)
    served = load_served(args.model, args.name)
    served.model = apply_speed_options(served.model, args)
    try:
        engine = Engine(
            served.model,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_batch=args.max_batch,
            max_prefill_tokens=args.max_prefill_tokens,
        )
    except TypeError as err:
        return fail(err)
    app = create_app(served, engine, args.max_model_len)
    how = "fp32" if not args.quantize else f"weight-only {args.quantize}"
    how += ", fused projections" if args.fuse or args.quantize else ""
    print(f"serving {served.name!r} ({how}) on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a model over HTTP with OpenAI's /v1/completions and chat API"
    )
    p.add_argument("model", help="run directory, HF-format folder, or .gguf file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--name", default=None, help="the model name clients send (default: folder)")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV pool size, in blocks")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-batch", type=int, default=64, help="requests decoded together")
    p.add_argument("--max-prefill-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + max_tokens")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--log-level", default="warning")
    speed_options(p)
    p.set_defaults(func=run)
