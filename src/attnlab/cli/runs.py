"""Loading what `attnlab train` wrote, for the subcommands that use a run (eval, translate).

A run directory holds `best/` and `last/` checkpoints (src/attnlab/train/checkpoint.py); these
helpers pick one, rebuild the model from its own config, and read the run's recipe and tokenizer.
`check_decoder_only` is the line `generate`, `chat` and `serve` give for a model they cannot
continue (a translation or encoder run), naming the command that was run and the one to use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


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


# what each command does with a decoder-only model, for the line that refuses any other
_DOES = {"serve": "serves", "generate": "continues text with", "chat": "talks with"}


def check_decoder_only(model, path: Path, command: str) -> None:
    """ValueError naming what `path` holds and the command for it, unless `model` is decoder-only
    (`attnlab generate`, `chat` and `serve` continue a prompt token by token); `command` is the
    one the user ran, so the line names it."""
    from ..loading import source_of
    from ..nn.model import DecoderOnlyModel, EncoderDecoderModel

    if isinstance(model, DecoderOnlyModel):
        return
    run = source_of(path) == "run"
    does = _DOES.get(command, "needs")
    head = f"attnlab {command} {does} decoder-only (causal LM) models; {path} holds"
    if isinstance(model, EncoderDecoderModel):
        use = (
            f'translate with it: attnlab translate {path} "a sentence"'
            if run
            else "decode it in Python: attnlab.generate"
        )
        raise ValueError(f"{head} an encoder-decoder (translation) model: {use}")
    use = f"evaluate it with attnlab eval {path}" if run else "it has no next token to generate"
    raise ValueError(f"{head} an encoder ({type(model).__name__}), which generates no text: {use}")
