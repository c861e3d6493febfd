"""The `attnlab` command: one entry point, one module per subcommand in this folder.

Each module has `register(subparsers)`, which adds its parser and sets `func` (the function that
runs the subcommand). Adding a subcommand: a module here and its name in SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# in the order `attnlab --help` lists them
SUBCOMMANDS = (
    "presets",
    "inspect",
    "train",
    "eval",
    "translate",
    "generate",
    "serve",
    "plot",
    "lab",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Every Transformer component as a small, swappable, tested module.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:  # bad input: the message, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
