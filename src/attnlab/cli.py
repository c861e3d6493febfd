"""The `attnlab` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def _presets(args: argparse.Namespace) -> int:
    from . import presets
    from .build import count_parameters

    if args.markdown:
        print(presets.components_table())
        return 0
    rows = []
    for name in presets.names():
        cfg = presets.get(name)
        rows.append(
            (name, f"{count_parameters(cfg):,}", presets.describe(cfg), presets.source(name))
        )
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"{'preset':<{w0}}  {'parameters':>{w1}}  components")
    for name, count, desc, src in rows:
        print(f"{name:<{w0}}  {count:>{w1}}  {desc}")
        if args.sources:
            print(f"{'':<{w0}}  {'':>{w1}}  {src}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .summary import format_summary, resolve

    print(format_summary(*resolve(args.target)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("presets", help="list every preset with its exact parameter count")
    p.add_argument(
        "--sources", action="store_true", help="also print the paper or model card of each"
    )
    p.add_argument(
        "--markdown", action="store_true", help="print the preset x components table (docs)"
    )
    p.set_defaults(func=_presets)
    p = sub.add_parser("inspect", help="architecture summary of a preset or an HF-format folder")
    p.add_argument(
        "target", help="a preset name (see `attnlab presets`) or a folder with config.json"
    )
    p.set_defaults(func=_inspect)
    from .train.cli import register as register_train  # train, eval, translate, plot

    register_train(sub)
    from .textgen import register as register_generate

    register_generate(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
