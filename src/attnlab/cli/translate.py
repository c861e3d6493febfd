"""`attnlab translate RUN_DIR "Ein Hund läuft."`: beam-search translations with a translation run
(sentences as arguments, or one per line on stdin). Options and sentences may come in any order
(`translate RUN --beams 1 "Ein Hund."`); a language-model run is sent to `attnlab generate`, a
classification run to `attnlab eval`."""

from __future__ import annotations

import argparse
import sys

from . import add_command
from .numbers import integer
from .runs import add_run_arguments, fail, load_run
from .text_input import check_text, read_stdin


class _Intermixed(argparse.ArgumentParser):
    """A parser that takes options between its positionals (argparse's intermixed parsing):
    with plain parsing, `RUN --beams 1 "Ein Hund."` gives RUN and no sentences (nargs="*"
    matches nothing at RUN), then refuses "Ein Hund." as unrecognized. The subcommand's parser is
    called by the top-level one through `parse_known_args`, so that is where it intermixes."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixing:  # parse_known_intermixed_args calls this twice itself
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def _other_task(run_dir: str, kind: str) -> str:
    """Why a run of another task does not translate, and the command that uses it."""
    if kind == "lm":
        return (
            f"{run_dir} is a language-model run (data.kind 'lm'), not translation: continue "
            f'text with it: attnlab generate {run_dir} --prompt "some text"'
        )
    if kind == "classification":
        return (
            f"{run_dir} is a classification run (an encoder: it labels text, it writes none), "
            f"not translation: evaluate it with attnlab eval {run_dir}"
        )
    return f"{run_dir} is a {kind!r} run, not translation"


def _sentences(args: argparse.Namespace) -> list[str]:
    """The sentences given after RUN_DIR, else stdin's non-empty lines; ValueError for none."""
    if args.sentences:
        return [check_text(s, "a sentence") for s in args.sentences]
    if sys.stdin.isatty():
        print(
            "type sentences, one per line, then Ctrl-D (or give them after RUN_DIR, or pipe a "
            "file of them)",
            file=sys.stderr,
            flush=True,
        )
    sentences = [line.strip() for line in read_stdin().splitlines() if line.strip()]
    if not sentences:
        raise ValueError(
            f"no sentences to translate: give them after RUN_DIR (attnlab translate {args.run_dir} "
            f'"Ein Hund läuft.") or one per line on stdin'
        )
    return sentences


def run(args: argparse.Namespace) -> int:
    from ..train.checkpoint import CheckpointError
    from ..train.tasks import translate

    try:
        _, model, recipe, tok = load_run(args)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        return fail(err)
    if recipe.data.kind != "translation":
        return fail(_other_task(args.run_dir, recipe.data.kind))
    sentences = _sentences(args)
    if recipe.data.lowercase:
        sentences = [s.lower() for s in sentences]
    for hyp in translate(model, tok, sentences, recipe, beams=args.beams):
        print(hyp)
    return 0


def register(sub) -> None:
    p = add_command(
        sub, "translate", "translate sentences with a translation run (beam search)",
        "One translation per line, in the order given.",
        examples=(
            'attnlab translate runs/multi30k-de-en-quick "Zwei Hunde spielen im Schnee."',
            'attnlab translate runs/multi30k-de-en-quick "Ein Hund läuft." "Eine Frau liest." --beams 1',
        ),
    )  # fmt: skip
    p.__class__ = _Intermixed  # sub.add_parser makes every subcommand's parser one class
    add_run_arguments(p)
    p.add_argument("sentences", nargs="*", help="source sentences (default: stdin lines)")
    p.add_argument(
        "--beams",
        type=integer(1),
        default=None,
        help="beam size (default: the recipe's); 1: greedy",
    )
    p.set_defaults(func=run)
