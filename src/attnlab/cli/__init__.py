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
    from ..errors import AttnlabError

    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside training (which saves and says so itself)
        print("error: interrupted", file=sys.stderr)
        return 130  # the shell's status for a process stopped by SIGINT
    except AttnlabError as err:  # a checkpoint missing, a run diverged or interrupted, ...
        print(f"error: {err}", file=sys.stderr)
        return err.exit_status
    except (ValueError, OSError) as err:  # bad input, a missing / unreadable file, a port taken
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
