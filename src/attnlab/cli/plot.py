"""`attnlab plot RUN_DIR`: a run's loss, learning rate and throughput curves as a PNG."""

from __future__ import annotations

import argparse

from .runs import fail


def run(args: argparse.Namespace) -> int:
    from ..train.plot import plot

    try:
        out = plot(args.run_dir, args.output)
    except (FileNotFoundError, ImportError) as err:
        return fail(err)
    print(out)
    return 0


def register(sub) -> None:
    p = sub.add_parser("plot", help="draw a run's loss, learning rate and throughput to a PNG")
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", help="PNG path (default RUN_DIR/curves.png)")
    p.set_defaults(func=run)
