"""`attnlab lab`: run the experiments of configs/labs/ and report their verdicts.

attnlab lab list
attnlab lab run NAME [--quick] [--jobs N] [--seeds 1 2 3 | --plan MAX] [--set KEY=VALUE ...]
                     [--threads N] [--corpus NAME] [--retime] [--from DIR]
                     [--out DIR] [--data-dir DIR] [--device cpu|cuda]
attnlab lab report RUN_DIR
attnlab lab summary [ROOT] [--write FILE]
attnlab lab attention RUN_DIR "sentence" [--layer I] [--head H] [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import textwrap

from ..lab import spec
from . import add_command
from .numbers import integer, threads
from .runs import fail


def _list(args: argparse.Namespace) -> int:

    width = max(60, shutil.get_terminal_size().columns)
    for name in spec.names():
        lab = spec.load(name)
        took = _measured(name)
        print(f"{name}: {len(lab.variants)} variants x {len(lab.seeds)} seed(s){took}")
        about = " ".join(lab.description.strip().split("\n\n")[0].split())  # first paragraph
        if about:  # whole, wrapped: never cut mid-sentence
            print(textwrap.fill(about, width - 1, initial_indent="    ", subsequent_indent="    "))
    return 0


def _measured(name: str) -> str:
    """', about N min in full (measured)' from the committed report's runs (docs/lab/NAME/
    results.jsonl, one line per run with its seconds), or '' where there is none."""
    import json

    results = spec.LABS.parents[1] / "docs" / "lab" / name / "results.jsonl"
    try:
        seconds = sum(json.loads(x).get("seconds", 0) for x in results.read_text().splitlines())
    except (OSError, ValueError):
        return ""
    if not seconds:
        return ""
    took = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    return f", about {took} in full (its committed runs, one after another, one thread each)"


def _run(args: argparse.Namespace) -> int:
    from ..lab import run_lab

    try:
        run_lab(args.name, quick=args.quick, jobs=args.jobs, seeds=args.seeds, out=args.out,
                data_dir=args.data_dir, device=args.device, sets=args.set,
                threads=args.threads, most=args.plan, corpus=args.corpus,
                retime=args.retime, source=args.source)  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        return fail(err)
    return 0


def _report(args: argparse.Namespace) -> int:
    from ..lab import write_report

    try:
        print(write_report(args.run_dir).read_text())
    except (ValueError, FileNotFoundError) as err:
        return fail(err)
    return 0


def _summary(args: argparse.Namespace) -> int:
    from ..lab import summary

    try:
        text = summary.table(args.root)
        if args.write:
            summary.write_into(args.write, text)
            print(f"wrote the summary into {args.write}")
        else:
            print(text, end="")
    except (ValueError, FileNotFoundError) as err:
        return fail(err)
    return 0


def _attention(args: argparse.Namespace) -> int:
    from ..lab.attention import attention_maps

    try:
        paths = attention_maps(args.run_dir, args.sentence, layer=args.layer, head=args.head,
                               out=args.out, data_dir=args.data_dir)  # fmt: skip
    except (ValueError, FileNotFoundError) as err:
        return fail(err)
    for p in paths:
        print(p)
    return 0


def register(sub) -> None:
    p = add_command(
        sub, "lab", "reproduce the field's claims: experiments with verdicts",
        "Each experiment (configs/labs/) trains its variants, measures, and judges every claim.",
        examples=(
            "attnlab lab list                           # the experiments and what each checks",
            "attnlab lab run positions --quick          # one end to end at toy sizes, in seconds",
            "attnlab lab report runs/labs/positions-quick   # its report.md again",
            "attnlab lab summary                        # every claim's verdict, one table",
        ),
    )  # fmt: skip
    lab = p.add_subparsers(dest="lab_command", required=True)
    q = add_command(
        lab,
        "list",
        "the experiments in configs/labs/, with what each checks",
        examples=("attnlab lab list",),
    )  # fmt: skip
    q.set_defaults(func=_list)
    q = add_command(
        lab, "run", "run (or continue) an experiment; writes report.md",
        examples=(
            "attnlab lab run positions --quick                  # seconds: checks the pipeline",
            "attnlab lab run kv-heads --jobs 2 --threads 1      # two runs at a time",
            "attnlab lab run positions --seeds 1 2 3 4 5 6 7    # more seeds than the YAML's",
            "attnlab lab run positions --plan 10 --corpus wikitext-2   # seeds for 80% power",
        ),
    )  # fmt: skip
    q.add_argument("name", help="experiment name (attnlab lab list) or a YAML path")
    q.add_argument("--quick", action="store_true",
                   help="a few steps at toy sizes: checks the pipeline, verdicts mean nothing")  # fmt: skip
    q.add_argument(
        "--jobs", type=integer(1), default=1, help="runs trained in parallel (processes)"
    )
    q.add_argument("--seeds", type=integer(0, 2**64 - 1), nargs="+",  # torch's seed range
                   help="override the experiment's seeds")  # fmt: skip
    q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key in every run, after the variant's own, e.g. "
                        "--set steps=2000 (repeatable)")  # fmt: skip
    q.add_argument("--plan", type=integer(3), default=None, metavar="MAX",
                   help="plan the seeds: start with 3, add the paired seeds undecided claims "
                        "need for 80%% power, up to MAX in all (src/attnlab/lab/power.py)")  # fmt: skip
    q.add_argument("--threads", type=threads, default=None,
                   help="torch intra-op threads per run (default: all cores, shared out "
                        "between --jobs)")  # fmt: skip
    q.add_argument("--corpus", default=None,
                   help="replicate on one of the experiment's corpora (e.g. wikitext-2); "
                        "default out runs/labs/NAME-CORPUS")  # fmt: skip
    q.add_argument("--from", dest="source", metavar="DIR",
                   help="count DIR's finished runs of the same recipes as done, e.g. the "
                        "committed docs/lab/NAME: only new seeds train")  # fmt: skip
    q.add_argument("--retime", action="store_true",
                   help="time every finished run again (timings run after training, one run "
                        "at a time: do it on a quiet machine)")  # fmt: skip
    q.add_argument("--out", help="output folder (default runs/labs/NAME, NAME-quick with --quick)")
    q.add_argument("--data-dir", help="folder holding the data sets (default: located)")
    q.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    q.set_defaults(func=_run)
    q = add_command(lab, "report", "rewrite and print report.md of a lab run folder",
                    examples=("attnlab lab report runs/labs/positions-quick   # of lab run --quick",
                              "attnlab lab report runs/labs/positions"))  # fmt: skip
    q.add_argument("run_dir", help="a lab run folder (runs/labs/NAME)")
    q.set_defaults(func=_report)
    q = add_command(
        lab, "summary", "every claim of every experiment, one column per corpus",
        examples=(
            "attnlab lab summary                           # of the committed runs, docs/lab",
            "attnlab lab summary runs/labs                 # of your own",
            "attnlab lab summary --write docs/lab.md       # into the docs' summary block",
        ),
    )  # fmt: skip
    q.add_argument("root", nargs="?", default="docs/lab",
                   help="folder of run folders NAME and NAME-CORPUS (default docs/lab)")  # fmt: skip
    q.add_argument("--write", metavar="FILE",
                   help="replace the summary block of FILE (e.g. docs/lab.md) instead of printing")  # fmt: skip
    q.set_defaults(func=_summary)
    q = add_command(
        lab, "attention", "attention heatmaps (PNG) of a trained run",
        examples=(
            'attnlab lab attention runs/multi30k-de-en-quick "Ein Hund läuft."',
            'attnlab lab attention runs/labs/positions/rope-s1 "ROMEO: speak" --layer 0 --head 1',
        ),
    )  # fmt: skip
    q.add_argument(
        "run_dir", help="a training run folder (attnlab train / a lab run's VARIANT-sSEED)"
    )
    q.add_argument("sentence", help="the text whose attention is drawn")
    q.add_argument("--layer", type=integer(0), help="layer from 0 (default: the last)")
    q.add_argument(
        "--head", type=integer(0), help="head from 0 (default: every head, one panel each)"
    )
    q.add_argument("--out", help="folder for the PNGs (default RUN_DIR/attention)")
    q.add_argument("--data-dir", help=argparse.SUPPRESS)
    q.set_defaults(func=_attention)
