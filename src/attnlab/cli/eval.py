"""`attnlab eval RUN_DIR`: a run's validation and test metrics, as JSON."""

from __future__ import annotations

import argparse
import json

from . import add_command
from .numbers import threads
from .runs import add_run_arguments, fail, load_run


def run(args: argparse.Namespace) -> int:
    import torch

    from ..train.checkpoint import CheckpointError
    from ..train.tasks import prepare

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        folder, model, recipe, tok = load_run(args)
        task = prepare(recipe, args.data_dir, tok, train=False)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        return fail(err)
    with torch.no_grad():
        metrics = {**task.validate(model), **(task.test(model) if task.test else {})}
    print(json.dumps({"checkpoint": str(folder), **metrics}, indent=2))
    return 0


def register(sub) -> None:
    p = add_command(
        sub, "eval", "evaluate a run's best checkpoint (validation and test metrics)",
        "Prints the metrics as JSON.",
        examples=(
            "attnlab eval runs/multi30k-de-en-quick                 # validation loss, test BLEU",
            "attnlab eval runs/shakespeare-char --checkpoint last   # the latest, not the best",
        ),
    )  # fmt: skip
    add_run_arguments(p)
    p.add_argument("--threads", type=threads, default=None, help="torch intra-op threads")
    p.set_defaults(func=run)
