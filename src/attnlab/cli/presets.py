"""`attnlab presets`: every preset with its exact parameter count (built on the meta device, a
mixture of experts with its fewest experts and the rest counted: src/attnlab/cli/inspect.py)."""

from __future__ import annotations

import argparse

from . import add_command


def run(args: argparse.Namespace) -> int:
    from .. import presets
    from .inspect import count_parameters

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


def register(sub) -> None:
    p = add_command(
        sub, "presets", "list every preset with its exact parameter count",
        examples=(
            "attnlab presets                # name, parameters, components",
            "attnlab presets --sources      # and the paper or model card each follows",
            "attnlab presets --markdown     # the preset x components table of the docs",
        ),
    )  # fmt: skip
    p.add_argument(
        "--sources", action="store_true", help="also print the paper or model card of each"
    )
    p.add_argument(
        "--markdown", action="store_true", help="print the preset x components table (docs)"
    )
    p.set_defaults(func=run)
