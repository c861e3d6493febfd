"""The `attnlab` command: one entry point, one module per subcommand in this folder.

Each module has `register(subparsers)`, which adds its parser (`add_command`, with two to four
runnable examples that end its --help: tests/cli/test_cli_help.py parses every one with the real
parser) and sets `func` (the function that runs the subcommand). Adding a subcommand: a module
here and its name in SUBCOMMANDS.
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
    it ("default: ..."). A text with line breaks of its own (the examples) keeps them, as
    RawDescriptionHelpFormatter keeps every text's; one long line (a description) is wrapped."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        shown = not (d is None or d is False or d == [] or d is argparse.SUPPRESS)  # 0 is shown
        if shown and "default" not in text and (action.option_strings or action.nargs == "?"):
            text += " (default: %(default)s)"
        return text


def add_command(
    sub, name: str, about: str, details: str = "", examples: tuple[str, ...] = ()
) -> argparse.ArgumentParser:
    """A subcommand's parser: `about` is its line in `attnlab --help` and the first sentence of
    its own page, `details` the rest of that page's description, `examples` command lines (each
    `attnlab ...`, optionally `  # what it does`) listed under "examples:" at the end of the page."""
    description = f"{about[0].upper()}{about[1:]}." + (f" {details}" if details else "")
    epilog = "examples:\n" + "".join(f"  {line}\n" for line in examples) if examples else None
    return sub.add_parser(
        name, help=about, description=description, epilog=epilog, formatter_class=HelpFormatter
    )


def version() -> str:
    """The installed package's version (its metadata), else the source tree's."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("attnlab")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return sys.modules["attnlab"].__version__  # the package above this one: loaded


def build_parser() -> argparse.ArgumentParser:
    """`attnlab` with every subcommand (each module's `register`); imports no torch."""
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Every Transformer component as a small, swappable, tested module.",
        epilog="Each command's --help ends in examples (attnlab COMMAND --help).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..errors import AttnlabError

    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C (training catches its own: it saves and says so itself)
        print("interrupted (Ctrl-C)", file=sys.stderr)  # asked for, not an error
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
