"""`attnlab train RECIPE [--set key=value ...]`: train a recipe from configs/ (or a YAML path);
re-running it, or `--resume RUN_DIR`, continues exactly where the last checkpoint left off."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import add_command
from .numbers import integer, threads
from .runs import fail


class KeyValue(argparse.Action):
    """`--set KEY=VALUE`, appended to a list; anything without `=` (`--set steps 50`) is a usage
    error that shows the form, instead of argparse's `unrecognized arguments: 50` (one `error:`
    line, as every attnlab error; exit status 2)."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        key, sep, _ = value.partition("=")
        if not sep or not key.strip():
            fix = f"; write --set {value}=VALUE, one argument" if value and not sep else ""
            parser.exit(2, f"error: --set takes KEY=VALUE, e.g. --set steps=50 (expected "
                           f"key.sub=value, got {value!r}{fix})\n")  # fmt: skip
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), value])


def run(args: argparse.Namespace) -> int:
    from ..errors import AttnlabError
    from ..train import recipes
    from ..train.loop import TrainingInterrupted
    from ..train.run import checkpoint_recipe, train

    run_dir = Path(args.resume) if isinstance(args.resume, str) else None
    if run_dir is not None and args.run_dir and Path(args.run_dir) != run_dir:
        return fail("--resume RUN_DIR and --run-dir name different folders")
    run_dir = run_dir or (Path(args.run_dir) if args.run_dir else None)
    try:
        if args.config is None:
            if run_dir is None or checkpoint_recipe(run_dir) is None:
                return fail("give a CONFIG, or --resume RUN_DIR holding a checkpoint")
            data = recipes.apply_set(checkpoint_recipe(run_dir).to_dict(), args.set)
            recipe = recipes.Recipe.from_dict(data)
        else:
            recipe = recipes.load(args.config, args.set)
        run_dir = run_dir or Path("runs") / recipe.name
        if args.resume and checkpoint_recipe(run_dir) is None:
            return fail(f"--resume: no checkpoint in {run_dir}")
        train(recipe, run_dir, args.data_dir, args.device, stop_at=args.stop_at, fsdp=args.fsdp,
              threads=args.threads)  # fmt: skip
    except TrainingInterrupted as stop:  # Ctrl-C / SIGTERM: it saved and says where, not an error
        print(stop, file=sys.stderr)
        return stop.exit_status
    except KeyboardInterrupt:  # before training, in the final test, or a second Ctrl-C
        print(interrupted(run_dir), file=sys.stderr)
        return TrainingInterrupted.exit_status
    except AttnlabError as err:  # diverged, run dir locked, a checkpoint unwritable
        fail(err)
        return err.exit_status
    except (ValueError, FileNotFoundError) as err:
        return fail(err)
    print(f"run directory: {run_dir}")
    return 0


def interrupted(run_dir: Path | None) -> str:
    """What a Ctrl-C outside the training loop's own handling left: the loop saves and stops at an
    update boundary (TrainingInterrupted); before it starts, during the final test, or at a second
    Ctrl-C the process stops where it is, and the last checkpoint written (whole or not at all:
    src/attnlab/train/checkpoint.py) is what the same command continues from."""
    from ..train import checkpoint as ckpt

    folder = ckpt.resolve(run_dir, "last") if run_dir is not None else None
    if folder is None:
        return "interrupted (Ctrl-C) before a checkpoint was saved: the same command starts again"
    step = ckpt._step(folder)  # its manifest's step: no hashing of the files on the way out
    return (
        f"interrupted (Ctrl-C): the checkpoint of step {step} in {folder} is kept: run the same "
        f"command again to continue from there"
    )


def register(sub) -> None:
    p = add_command(
        sub, "train", "train a recipe (configs/NAME.yaml or a path); resumable",
        "Ctrl-C saves a checkpoint and stops; the same command again continues exactly.",
        examples=(
            "attnlab train shakespeare-char     # configs/shakespeare-char.yaml, runs/shakespeare-char",
            "attnlab train shakespeare-char --set steps=200 --set optimizer.lr=5e-4 --run-dir runs/short",
            "attnlab train --resume runs/shakespeare-char --set steps=4000   # a finished run, longer",
            "attnlab train multi30k-de-en-quick --device cuda --threads 4",
        ),
    )  # fmt: skip
    p.add_argument("config", nargs="?", help="recipe name or YAML path (omit with --resume DIR)")
    p.add_argument("--set", action=KeyValue, default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set optimizer.lr=5e-4 (repeatable)")  # fmt: skip
    p.add_argument(
        "--run-dir", help="output folder (default runs/NAME); resumed if it holds a checkpoint"
    )
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                   help="continue a run exactly where its last checkpoint left it")  # fmt: skip
    p.add_argument(
        "--data-dir",
        help="folder holding the data sets (an explicit choice: it must hold them); "
        "else ATTNLAB_DATA, ../shared/data, the user cache",
    )
    p.add_argument(
        "--device", help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu)"
    )
    p.add_argument("--threads", type=threads, default=None,
                   help="torch intra-op threads (default: OMP_NUM_THREADS, else one per core; a "
                   "resume without either takes the run's own count, bit-exact)")  # fmt: skip
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model with FSDP2 instead of DDP")  # fmt: skip
    p.add_argument("--stop-at", type=integer(1), help=argparse.SUPPRESS)  # tests: stop early
    p.set_defaults(func=run)
