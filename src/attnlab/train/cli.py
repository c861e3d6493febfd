"""Subcommands `attnlab train | eval | translate | plot` (registered into attnlab.cli)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _train(args: argparse.Namespace) -> int:
    from . import recipes
    from .checkpoint import CheckpointError
    from .loop import TrainingDiverged
    from .run import checkpoint_recipe, train

    run_dir = Path(args.resume) if isinstance(args.resume, str) else None
    if run_dir is not None and args.run_dir and Path(args.run_dir) != run_dir:
        print("error: --resume RUN_DIR and --run-dir name different folders", file=sys.stderr)
        return 2
    run_dir = run_dir or (Path(args.run_dir) if args.run_dir else None)
    try:
        if args.config is None:
            if run_dir is None or checkpoint_recipe(run_dir) is None:
                print(
                    "error: give a CONFIG, or --resume RUN_DIR holding a checkpoint",
                    file=sys.stderr,
                )
                return 2
            data = recipes.apply_set(checkpoint_recipe(run_dir).to_dict(), args.set)
            recipe = recipes.Recipe.from_dict(data)
        else:
            recipe = recipes.load(args.config, args.set)
        run_dir = run_dir or Path("runs") / recipe.name
        if args.resume and checkpoint_recipe(run_dir) is None:
            print(f"error: --resume: no checkpoint in {run_dir}", file=sys.stderr)
            return 2
        train(recipe, run_dir, args.data_dir, args.device, stop_at=args.stop_at, fsdp=args.fsdp)
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"run directory: {run_dir}")
    return 0


def _checkpoint(run_dir: str, which: str):
    from .checkpoint import CheckpointError, resolve

    folder = resolve(run_dir, which) or (resolve(run_dir, "last") if which == "best" else None)
    if folder is None:
        if (Path(run_dir) / "manifest.json").exists():  # a checkpoint folder itself
            return Path(run_dir)
        raise CheckpointError(f"no checkpoint in {run_dir} (looked for {which}/ and last/)")
    return folder


def _load(args):
    import torch

    from . import checkpoint as ckpt
    from .recipes import Recipe
    from .run import _load_tokenizer, default_device

    folder = _checkpoint(args.run_dir, args.checkpoint)
    model, _ = ckpt.load(folder)
    device = torch.device(args.device) if args.device else default_device()
    recipe = Recipe.from_dict(ckpt.load_recipe(folder))
    return folder, model.to(device).eval(), recipe, _load_tokenizer(folder)


def _eval(args: argparse.Namespace) -> int:
    import torch

    from .checkpoint import CheckpointError
    from .tasks import prepare

    try:
        folder, model, recipe, tok = _load(args)
        task = prepare(recipe, args.data_dir, tok, train=False)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with torch.no_grad():
        metrics = {**task.validate(model), **(task.test(model) if task.test else {})}
    print(json.dumps({"checkpoint": str(folder), **metrics}, indent=2))
    return 0


def _translate(args: argparse.Namespace) -> int:
    from .checkpoint import CheckpointError
    from .tasks import translate

    try:
        _, model, recipe, tok = _load(args)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if recipe.data.kind != "translation":
        print(
            f"error: {args.run_dir} is a {recipe.data.kind!r} run, not translation", file=sys.stderr
        )
        return 2
    sentences = args.sentences or [line.strip() for line in sys.stdin if line.strip()]
    if recipe.data.lowercase:
        sentences = [s.lower() for s in sentences]
    for hyp in translate(model, tok, sentences, recipe, beams=args.beams):
        print(hyp)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from .plot import plot

    try:
        out = plot(args.run_dir, args.output)
    except (FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


def register(sub) -> None:
    """Add the training subcommands to attnlab's subparsers."""
    p = sub.add_parser("train", help="train a recipe (configs/NAME.yaml or a path); resumable")
    p.add_argument("config", nargs="?", help="recipe name or YAML path (omit with --resume DIR)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set optimizer.lr=5e-4 (repeatable)")  # fmt: skip
    p.add_argument(
        "--run-dir", help="output folder (default runs/NAME); resumed if it holds a checkpoint"
    )
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                   help="continue a run exactly where its last checkpoint left it")  # fmt: skip
    p.add_argument(
        "--data-dir", help="folder holding the data sets (else ATTNLAB_DATA, ../shared/data)"
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model with FSDP2 instead of DDP")  # fmt: skip
    p.add_argument("--stop-at", type=int, help=argparse.SUPPRESS)  # tests: stop early at a step
    p.set_defaults(func=_train)
    for name, fn, help_ in (
        ("eval", _eval, "evaluate a run's best checkpoint (validation and test metrics)"),
        ("translate", _translate, "translate sentences with a translation run (beam search)"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("run_dir", help="a run folder (or a checkpoint folder)")
        if name == "translate":
            p.add_argument("sentences", nargs="*", help="source sentences (default: stdin lines)")
            p.add_argument(
                "--beams", type=int, default=None, help="beam size (default: the recipe's)"
            )
        p.add_argument("--checkpoint", default="best", choices=("best", "last"))
        p.add_argument("--data-dir")
        p.add_argument("--device")
        p.set_defaults(func=fn)
    p = sub.add_parser("plot", help="draw a run's loss, learning rate and throughput to a PNG")
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", help="PNG path (default RUN_DIR/curves.png)")
    p.set_defaults(func=_plot)
