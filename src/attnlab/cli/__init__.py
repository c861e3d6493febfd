"""The `attnlab` command: one entry point, one module per subcommand in this folder.

Each module has `register(subparsers)`, which adds its parser and sets `func` (the function that
runs the subcommand). Adding a subcommand: a module here and its name in SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# OpenMP threads that wait for work sleep instead of spinning (GNU OpenMP, torch's, spins first):
# with another busy process on the cores, spinning threads take the cores the working ones need,
# and two torch threads ran 9x slower than one (benchmarks/threads_under_load.py). OpenMP reads
# this once, when torch loads, so it is set here, before any subcommand imports torch; a value
# in the environment is kept. Library users set it themselves (docs/performance.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# in the order `attnlab --help` lists them
SUBCOMMANDS = (
    "presets",
    "inspect",
    "train",
    "eval",
    "translate",
    "generate",
    "chat",
    "serve",
    "convert",
    "plot",
    "lab",
)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with each option's default appended, as ArgumentDefaultsHelpFormatter,
    except where there is nothing to show (None, False, an empty list) or the help already says
    it ("default: ...")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        shown = not (d is None or d is False or d == [] or d is argparse.SUPPRESS)  # 0 is shown
        if shown and "default" not in text and (action.option_strings or action.nargs == "?"):
            text += " (default: %(default)s)"
        return text


def add_command(sub, name: str, about: str, details: str = "") -> argparse.ArgumentParser:
    """A subcommand's parser: `about` is its line in `attnlab --help` and the first sentence of
    its own page, `details` the rest of that page's description."""
    description = f"{about[0].upper()}{about[1:]}." + (f" {details}" if details else "")
    return sub.add_parser(name, help=about, description=description, formatter_class=HelpFormatter)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Every Transformer component as a small, swappable, tested module.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    args = parser.parse_args(argv)
    from ..errors import AttnlabError

    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside training (which saves and says so itself)
        print("error: interrupted", file=sys.stderr)
        return 130  # the shell's status for a process stopped by SIGINT
    except BrokenPipeError:  # the reader went away (`attnlab presets | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return 0
    except AttnlabError as err:  # a checkpoint missing, a run diverged or interrupted, ...
        print(f"error: {err}", file=sys.stderr)
        return err.exit_status
    except (ValueError, OSError) as err:  # bad input, a missing / unreadable file, a port taken
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
