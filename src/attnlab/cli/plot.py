"""`attnlab plot RUN_DIR`: a run's loss, learning rate and throughput curves as a PNG."""

from __future__ import annotations

import argparse

from . import add_command
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
    p = add_command(
        sub, "plot", "draw a run's loss, learning rate and throughput to a PNG",
        examples=(
            "attnlab plot runs/multi30k-de-en-quick          # runs/multi30k-de-en-quick/curves.png",
            "attnlab plot runs/shakespeare-char -o shakespeare.png",
        ),
    )  # fmt: skip
    p.add_argument("run_dir", help="a run folder of `attnlab train` (holding metrics.jsonl)")
    p.add_argument("-o", "--output", help="PNG path (default RUN_DIR/curves.png)")
    p.set_defaults(func=run)
