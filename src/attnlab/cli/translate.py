"""`attnlab translate RUN_DIR "Ein Hund läuft."`: beam-search translations with a translation run
(sentences as arguments, or one per line on stdin)."""

from __future__ import annotations

import argparse
import sys

from . import add_command
from .runs import add_run_arguments, fail, load_run


def run(args: argparse.Namespace) -> int:
    from ..train.checkpoint import CheckpointError
    from ..train.tasks import translate

    try:
        _, model, recipe, tok = load_run(args)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        return fail(err)
    if recipe.data.kind != "translation":
        return fail(f"{args.run_dir} is a {recipe.data.kind!r} run, not translation")
    sentences = args.sentences or [line.strip() for line in sys.stdin if line.strip()]
    if recipe.data.lowercase:
        sentences = [s.lower() for s in sentences]
    for hyp in translate(model, tok, sentences, recipe, beams=args.beams):
        print(hyp)
    return 0


def register(sub) -> None:
    p = add_command(
        sub, "translate", "translate sentences with a translation run (beam search)",
        "One translation per line, in the order given.",
    )  # fmt: skip
    add_run_arguments(p)
    p.add_argument("sentences", nargs="*", help="source sentences (default: stdin lines)")
    p.add_argument("--beams", type=int, default=None, help="beam size (default: the recipe's)")
    p.set_defaults(func=run)
