"""Running an experiment: one training run per (variant, seed), then its evaluations.

    runs/labs/NAME/               (NAME-quick/ with --quick)
      lab.yaml                    the experiment as run
      VARIANT-sSEED/              a training run directory (src/attnlab/train/run.py) plus
        lab.json                  its evaluations: written last, so its presence means done
        log.txt                   what training printed
      results.jsonl               one line per finished run: variant, seed, metrics
      report.md, *.png            src/attnlab/lab/report.py

Resumable at two levels: a run with lab.json is not redone; a run killed mid-training resumes
from its last checkpoint (the trainer's exact resume). A recipe = the base recipe, the lab's
shared overrides, --quick's, then the variant's; `seed` is set per run, and as it fixes both the
initial draw and the order of batches (src/attnlab/data/batching.py, LMBatcher), runs of two
variants with the same seed are paired. A variant with `init_from` starts from the weights of
that variant's run with the same seed, so it runs after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, merge_dicts
from . import spec as S
from .report import RESULTS, write_report

DONE = "lab.json"


@dataclass(frozen=True)
class Run:
    variant: str
    seed: int
    recipe: dict[str, Any]  # the raw recipe (validated by `plan`)
    base_context: int
    train: bool
    init_from: str | None  # a variant

    @property
    def name(self) -> str:
        return f"{self.variant}-s{self.seed}"


def default_out(lab: S.Lab, quick: bool, corpus: str | None = None) -> Path:
    """runs/labs/NAME[-CORPUS][-quick]"""
    name = lab.name + (f"-{corpus}" if corpus else "") + ("-quick" if quick else "")
    return Path("runs") / "labs" / name


def plan(
    lab: S.Lab,
    out: Path,
    quick: bool = False,
    seeds: list[int] | None = None,
    sets: list[str] | None = None,
    corpus: str | None = None,
) -> list[Run]:
    """Every (variant, seed) run with its recipe; every invalid recipe reported at once. `sets`
    (`--set key.sub=value`) change every run's recipe after the variant's own keys; `corpus`
    (one of the lab's `corpora`) changes the data after the lab's overrides. With
    `quick`, a warm-up as long as the few steps is cut to a tenth of them (the run checks the
    pipeline; a rate that never leaves its warm-up would only print a warning per run)."""
    from ..train import recipes

    recipes.parse_set(sets or [])  # a malformed --set is reported once, not per variant
    base = yaml.safe_load(recipes.find(lab.recipe).read_text())
    base = merge_dicts(base, lab.overrides)
    chosen = lab.corpus(corpus)
    if chosen is not None:
        base = merge_dicts(base, chosen.overrides)
    if quick:
        base = merge_dicts(base, lab.quick.overrides)
    base_context = int(base.get("data", {}).get("context", 0) or 0)
    default_seeds = seeds or (lab.quick.seeds if quick and lab.quick.seeds else lab.seeds)
    runs, problems = [], []
    for name, v in lab.variants.items():
        own = {k: val for k, val in v.items() if k not in S.RESERVED}
        data = merge_dicts(base, own)
        if quick and v.get("quick"):
            data = merge_dicts(data, v["quick"])
        vseeds = seeds or (lab.quick.seeds if quick and lab.quick.seeds else v.get("seeds", default_seeds))  # fmt: skip
        for seed in vseeds:
            raw = merge_dicts(data, {"seed": seed, "name": f"{lab.name}-{name}"})
            src = v.get("init_from")
            if src is not None:
                raw = merge_dicts(raw, {"model": {"init_from": str((out / f"{src}-s{seed}").resolve())}})  # fmt: skip
            try:
                checked = recipes.Recipe.from_dict(raw)
                if quick and checked.schedule.warmup >= checked.steps:
                    raw = merge_dicts(raw, {"schedule": {"warmup": checked.steps // 10}})
                if sets:
                    raw = recipes.apply_set(raw, sets)
                recipes.Recipe.from_dict(raw)
            except ConfigError as err:
                problems += [f"variants.{name}: {p}" for p in err.problems]
                break
            train = lab.train and v.get("train", True)
            runs.append(Run(name, seed, raw, base_context, train, src))
    if problems:
        raise ConfigError(f"experiment {lab.name} (recipes of its variants)", problems)
    return runs


def evaluations(lab: S.Lab, quick: bool, variant: str | None = None) -> list[tuple[str, Any]]:
    """(kind, validated arguments) of each evaluation of `variant`, with --quick's changes."""
    from .evals import EVALS

    out = []
    for ev in lab.evaluate:
        if variant is not None and ev.variants is not None and variant not in ev.variants:
            continue
        args = dict(ev.model_extra or {})
        if quick:
            args |= lab.quick.evaluate.get(ev.kind, {})
        out.append((ev.kind, EVALS.get(ev.kind).args.model_validate(args)))
    return out


def execute(lab: S.Lab, run: Run, out: Path, quick: bool, data_dir=None, device: str = "cpu",
            threads: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Train (or resume) one run and evaluate it; returns its record (also in RUN/lab.json)."""
    import torch

    from ..train.threads import cpu_name

    run_dir = out / run.name
    done = run_dir / DONE
    if done.exists():
        record = json.loads(done.read_text())
        if record.get("recipe") != run.recipe:
            raise ValueError(
                f"{run_dir} holds a finished run of another recipe (the experiment or --quick "
                f"changed): delete {run_dir}, or choose another --out"
            )
        return record
    if threads:
        torch.set_num_threads(threads)
    run_dir.mkdir(parents=True, exist_ok=True)
    load_before = _load()
    t0 = time.perf_counter()
    with open(run_dir / "log.txt", "a") as log, contextlib.redirect_stdout(log):
        ctx, diverged = _model(run, run_dir, data_dir, torch.device(device))
        metrics: dict[str, Any] = {}
        errors: dict[str, str] = {}
        from .evals import EVALS, model_stats

        for kind, args in evaluations(lab, quick, run.variant):
            if EVALS.get(kind).timed or (EVALS.get(kind).needs_training and not ctx.trained):
                continue  # timings: after training, alone (time_runs)
            try:
                metrics |= EVALS.get(kind).fn(ctx, args)
            except (ValueError, RuntimeError) as err:  # recorded; the report shows it
                errors[kind] = f"{type(err).__name__}: {err}"
        metrics |= model_stats(ctx)
    record = {
        "variant": run.variant,
        "seed": run.seed,
        "run_dir": run.name,
        "trained": ctx.trained,
        "diverged": diverged,
        "metrics": metrics,
        "errors": errors,
        "seconds": time.perf_counter() - t0,
        # what the timings were taken on: the cores' load before and after, threads, processor
        "load_average": _load(),
        "load_before": load_before,
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "cpu": cpu_name(),
        "device": device,
        "torch": torch.__version__,
        "timing": None,  # the timed evaluations' conditions, once time_runs has run them
        "recipe": run.recipe,
    }
    _write_record(done, record)
    return record


def _write_record(done: Path, record: dict[str, Any]) -> None:
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, done)


def _timed(lab: S.Lab, quick: bool, variant: str) -> list[tuple[str, Any]]:
    from .evals import EVALS

    return [(k, a) for k, a in evaluations(lab, quick, variant) if EVALS.get(k).timed]


def time_runs(lab: S.Lab, runs: list[Run], out: Path, quick: bool, data_dir=None,
              device: str = "cpu", threads: int | None = None, log=print) -> None:  # fmt: skip
    """The timed evaluations of every finished run not timed yet, after all training, one run
    at a time in seed order (the runs a claim pairs are timed one after the other), with
    `threads` torch threads (default 1: the steadiest on a shared machine). Each record gets
    `timing`: the threads, the load average before and after, the processor, and whether the
    trained weights or a fresh draw were timed (a run whose checkpoints are gone; a time does
    not depend on the weights' values)."""
    import torch

    todo = []
    for r in sorted(runs, key=lambda r: r.seed):  # stable: plan order within a seed
        done = out / r.name / DONE
        if done.exists() and _timed(lab, quick, r.variant):
            record = json.loads(done.read_text())
            if record.get("timing") is None:
                todo.append((r, done, record))
    if not todo:
        return
    was = torch.get_num_threads()
    torch.set_num_threads(threads or 1)
    try:
        log(f"timing {len(todo)} run(s), one at a time, {torch.get_num_threads()} thread(s)")
        others = busy_cores()
        if others is not None and others >= 0.5:
            log(f"warning: other processes keep {others:.1f} of {os.cpu_count()} core(s) busy: "
                f"the timings will measure them too (each record says how busy the cores were)")  # fmt: skip
        for r, done, record in todo:
            before, others = _load(), busy_cores()
            with open(out / r.name / "log.txt", "a") as logf, contextlib.redirect_stdout(logf):
                ctx, weights = _timing_model(r, out / r.name, data_dir, torch.device(device))
                from .evals import EVALS

                for kind, args in _timed(lab, quick, r.variant):
                    try:
                        record["metrics"] |= EVALS.get(kind).fn(ctx, args)
                        record.get("errors", {}).pop(kind, None)
                    except (ValueError, RuntimeError) as err:
                        record.setdefault("errors", {})[kind] = f"{type(err).__name__}: {err}"
            record["timing"] = {
                "threads": torch.get_num_threads(), "load_before": before, "load_after": _load(),
                "cpu": _processor(device), "device": device, "weights": weights,
                "busy_cores": others,  # other processes' use of the cores just before
            }  # fmt: skip
            _write_record(done, record)
    finally:
        torch.set_num_threads(was)


def _processor(device: str) -> str:
    """What a timing ran on: the GPU's name on CUDA, else the CPU's model name."""
    import torch

    from ..train.threads import cpu_name

    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return cpu_name()


def _timing_model(run: Run, run_dir: Path, data_dir, device):
    """(RunContext, "trained" | "fresh draw") for the timed evaluations: the run's best
    checkpoint where there is one, else the architecture freshly drawn with the run's seed."""
    from ..train import checkpoint as ckpt

    if run.train and ckpt.best_or_last(run_dir) is not None:
        return _model(run, run_dir, data_dir, device, load_only=True)[0], "trained"
    return _model(replace(run, train=False), run_dir, data_dir, device)[0], "fresh draw"


def busy_cores(window: float = 0.5) -> float | None:
    """How many cores other processes keep busy, measured over `window` seconds while this one
    waits (/proc/stat; None elsewhere). Unlike the load average, which trails by a minute, it
    does not count this lab's own training that just finished."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + (v[4] if len(v) > 4 else 0)  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(window)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if t1 <= t0:
        return None
    return (1 - (i1 - i0) / (t1 - t0)) * (os.cpu_count() or 1)


def _load() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _model(run: Run, run_dir: Path, data_dir, device, load_only: bool = False):
    """(RunContext, diverged message or None): the trained model (best checkpoint; after a
    divergence the last good one), or a fresh draw for runs without training; `load_only`:
    a training run's best checkpoint as it is, without training (or resuming) first."""
    import torch

    from ..build import build_model
    from ..train import checkpoint as ckpt
    from ..train.loop import TrainingDiverged
    from ..train.recipes import Recipe, model_config
    from ..train.run import load_tokenizer, train
    from ..train.tasks import prepare
    from .evals import RunContext

    recipe = Recipe.from_dict(run.recipe)
    diverged = None
    if run.train:
        if not load_only:
            try:
                train(recipe, run_dir, data_dir, device, progress=False)
            except TrainingDiverged as err:
                diverged = str(err)
        folder = ckpt.best_or_last(run_dir)
        if folder is None:
            raise RuntimeError(f"{run_dir}: training left no checkpoint ({diverged})")
        model, cfg = ckpt.load(folder)
        tok = load_tokenizer(folder)
    else:
        task = prepare(recipe, data_dir, train=False)
        tok = task.tokenizer
        cfg = model_config(recipe.model, **task.model_sizes)
        torch.manual_seed(recipe.seed)
        model = build_model(cfg)
    ctx = RunContext(recipe, cfg, model.to(device), run_dir, run.base_context or recipe.data.context,
                     tok, data_dir, device, trained=run.train)  # fmt: skip
    return ctx, diverged


def recipe_hash(recipe: dict[str, Any]) -> str:
    """SHA-256 of a run's recipe (canonical JSON): results.jsonl keeps it, so a finished run can
    be recognised without its folder (`lab run --from`)."""
    import hashlib

    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def adopt(out: Path, runs: list[Run], source: Path, log=print) -> int:
    """Count the finished runs of another lab folder (its results.jsonl: e.g. the committed
    docs/lab/NAME) as done here, where their recipe's hash equals this plan's run of the same
    variant and seed; their per-run metrics.jsonl comes along where the folder has it. Returns
    how many were adopted; a run whose recipe differs, or an older row without a hash, is not."""
    import shutil

    from .report import read_results

    rows = {(r["variant"], r["seed"]): r for r in read_results(source)}
    n, stale = 0, []
    for run in runs:
        row = rows.get((run.variant, run.seed))
        done = out / run.name / DONE
        if row is None or done.exists():
            continue
        if row.get("recipe_sha256") != recipe_hash(run.recipe):
            stale.append(run.name)
            continue
        done.parent.mkdir(parents=True, exist_ok=True)
        if (source / run.name / "metrics.jsonl").exists():
            shutil.copy(source / run.name / "metrics.jsonl", done.parent / "metrics.jsonl")
        _write_record(done, row | {"recipe": run.recipe, "adopted": str(source)})
        n += 1
    log(f"adopted {n} finished run(s) from {source}")
    if stale:
        log(f"not adopted (another recipe, or results without a recipe hash): {', '.join(stale)}")
    return n


def write_results(out: Path, runs: list[Run]) -> list[dict[str, Any]]:
    """results.jsonl from the finished runs' lab.json, in plan order."""
    records = []
    for r in runs:
        done = out / r.name / DONE
        if done.exists():
            rec = json.loads(done.read_text())
            rec["recipe_sha256"] = recipe_hash(rec.pop("recipe", None) or r.recipe)
            records.append(rec)
    (out / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def run_lab(
    name: str | Path,
    quick: bool = False,
    jobs: int = 1,
    seeds: list[int] | None = None,
    out: str | Path | None = None,
    data_dir=None,
    device: str = "cpu",
    log=print,
    sets: list[str] | None = None,
    threads: int | None = None,
    most: int | None = None,
    corpus: str | None = None,
    retime: bool = False,
    source: str | Path | None = None,
) -> Path:
    """Run (or continue) experiment `name`; writes results.jsonl, plots and report.md into
    `out` (default runs/labs/NAME[-quick]) and returns it. `sets`: `--set key=value` for every
    run; `threads`: each run's torch threads (default: all cores, shared out between jobs);
    `most`: plan the seeds (src/attnlab/lab/power.py): start with at least 3, then add the
    paired seeds the inconclusive claims need for 80 % power, up to `most` seeds in all;
    `corpus`: replicate on one of the lab's `corpora` (default out runs/labs/NAME-CORPUS);
    `retime`: time every finished run again (e.g. on a quiet machine); `source`: a lab folder
    whose finished runs of the same recipes count as done (`--from docs/lab/NAME`)."""
    from .power import START
    from .report import judge, planned_seeds, read_results

    lab = S.load(name)
    if jobs < 1:
        raise ValueError(f"--jobs ({jobs}) must be >= 1")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads ({threads}) must be >= 1")
    if most is not None and most < START:
        raise ValueError(f"--plan ({most}) must be >= {START}: a plan starts with {START} seeds")
    lab.corpus(corpus)  # an unknown corpus is refused before anything runs
    _check_device(device)  # and a device torch does not have, rather than in every job
    out = Path(out) if out is not None else default_out(lab, quick, corpus)
    out.mkdir(parents=True, exist_ok=True)
    if threads is None and jobs > 1:  # the cores shared out, so jobs do not oversubscribe them
        threads = max(1, (os.cpu_count() or 1) // jobs)
    (out / "lab.yaml").write_text(yaml.safe_dump({"mode": "quick" if quick else "full", "corpus": corpus, **lab.model_dump(mode="json")}, sort_keys=False))  # fmt: skip
    if most is not None:
        first = seeds or (lab.quick.seeds if quick and lab.quick.seeds else lab.seeds)
        seeds = _more_seeds(list(first), START)
    if retime:
        for r in plan(lab, out, quick, seeds, sets, corpus):
            done = out / r.name / DONE
            if done.exists():
                _write_record(done, json.loads(done.read_text()) | {"timing": None})
    while True:
        runs = plan(lab, out, quick, seeds, sets, corpus)
        if source is not None:
            adopt(out, runs, Path(source), log)
        _execute_all(lab, runs, out, quick, data_dir, device, jobs, threads, log)
        time_runs(lab, runs, out, quick, data_dir, device, threads if jobs == 1 else None, log)
        write_results(out, runs)
        if most is None:
            break
        assert seeds is not None  # set above for a plan
        undecided = [r for r in judge(lab, read_results(out), quick, corpus) if r.verdict.status == "inconclusive"]  # fmt: skip
        wanted = max((planned_seeds(r)[0] or most for r in undecided), default=0)
        n = min(wanted, most)
        if n <= len(seeds):
            why = "every claim decided" if not undecided else f"the plan asks for {wanted} seeds, at most {most}"  # fmt: skip
            log(f"plan: {len(seeds)} seeds ({why})")
            break
        log(f"plan: {len(undecided)} claim(s) undecided; {n} seeds for 80 % power (at most {most})")
        seeds = _more_seeds(seeds, n)
    report = write_report(out, lab, corpus)
    log(f"report: {report}")
    return out


def _check_device(device: str) -> None:
    """ValueError for a device name torch does not know, or a CUDA device it does not have."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r}: {err}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index or 0) >= count:
            raise ValueError(f"--device {device}: torch sees {count} CUDA device(s)")


def _more_seeds(seeds: list[int], n: int) -> list[int]:
    """seeds, then the next unused integers, to n in all."""
    out, nxt = list(seeds), max(seeds, default=0) + 1
    while len(out) < n:
        out.append(nxt)
        nxt += 1
    return out


def _execute_all(lab, runs, out, quick, data_dir, device, jobs, threads, log) -> None:
    """Every run not done yet, in two waves (init_from runs after their sources)."""
    waves = [[r for r in runs if r.init_from is None], [r for r in runs if r.init_from is not None]]
    log(f"{lab.name}: {len(runs)} runs ({len(lab.variants)} variants) -> {out}")
    for wave in waves:
        if jobs == 1 or len(wave) <= 1:
            for r in wave:
                rec = execute(lab, r, out, quick, data_dir, device, threads)
                _say(log, rec)
                write_results(out, runs)
        else:
            with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
                futs = [pool.submit(execute, lab, r, out, quick, data_dir, device, threads) for r in wave]  # fmt: skip
                for f in futs:
                    _say(log, f.result())
                    write_results(out, runs)  # run_lab writes the last one, after the timings


def _say(log, rec: dict[str, Any]) -> None:
    m = rec["metrics"]
    loss = f"val_loss {m['val_loss']:.4f}" if isinstance(m.get("val_loss"), float) else ""
    extra = "; errors: " + "; ".join(rec["errors"]) if rec.get("errors") else ""
    div = " (diverged)" if rec.get("diverged") else ""
    log(f"  {rec['run_dir']}: {loss}{div} [{rec['seconds']:.0f}s]{extra}")
