"""Loading what `attnlab train` wrote, for the subcommands that use a run (eval, translate).

A run directory holds `best/` and `last/` checkpoints (src/attnlab/train/checkpoint.py); these
helpers pick one, rebuild the model from its own config, and read the run's recipe and tokenizer.
"""

from __future__ import annotations

import argparse
import sys


def load_run(args: argparse.Namespace):
    """(checkpoint folder, model in eval mode on the device, recipe, tokenizer)."""
    import torch

    from ..train import checkpoint as ckpt
    from ..train.recipes import Recipe
    from ..train.run import default_device, load_tokenizer

    folder = ckpt.find(args.run_dir, args.checkpoint)
    model, _ = ckpt.load(folder)
    device = torch.device(args.device) if args.device else default_device()
    recipe = Recipe.from_dict(ckpt.load_recipe(folder))
    return folder, model.to(device).eval(), recipe, load_tokenizer(folder)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments every run-reading subcommand takes."""
    p.add_argument("run_dir", help="a run folder (or a checkpoint folder)")
    p.add_argument(
        "--checkpoint",
        default="best",
        choices=("best", "last"),
        help="which checkpoint: the best validation score, or the latest",
    )
    p.add_argument("--data-dir", help="folder holding the data sets (an explicit choice)")
    p.add_argument(
        "--device", help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu)"
    )


def fail(err: Exception | str) -> int:
    """Print `error: ...` to stderr; the exit status of a usage or input error."""
    print(f"error: {err}", file=sys.stderr)
    return 2
