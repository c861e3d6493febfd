"""metrics.jsonl: the log of a run, one JSON record per line, each with `step` and `split`:

    train   loss, lr, grad_norm (means over the logging window), tokens_per_s, tokens
    eval    the task's validation metrics (val_loss, val_bleu, dev_accuracy, ...)
    test    the task's test metrics, appended by the final evaluation

Only rank 0 writes it (src/attnlab/train/loop.py). A line cut by a crash is skipped on reading;
on resume, records logged after the checkpoint by the interrupted process are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"


def append(run_dir: str | Path, record: dict[str, Any]) -> None:
    with open(Path(run_dir) / METRICS, "a") as f:
        f.write(json.dumps(record) + "\n")


def _lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    for line in path.read_text().splitlines():
        try:
            yield line, json.loads(line)
        except ValueError:  # a line cut by a crash
            continue


def read(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a training run folder?")
    return [rec for _, rec in _lines(path)]


def truncate(run_dir: str | Path, step: int) -> None:
    """Keep the records up to `step`, less the test ones (recomputed at the end of the resumed
    run) and the lines cut by the crash."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return
    keep = [
        line
        for line, rec in _lines(path)
        if rec.get("split") != "test" and rec.get("step", 0) <= step
    ]
    path.write_text("".join(x + "\n" for x in keep))


def progress_line(record: dict[str, Any], steps: int, eta_s: float) -> str:
    """The plain log line of a train record (when no progress bar is shown)."""
    m, s = divmod(int(eta_s), 60)
    return (
        f"step {record['step']}/{steps}  loss {record['loss']:.4f}  lr {record['lr']:.3g}  "
        f"grad norm {record['grad_norm']:.3g}  {record['tokens_per_s']:.0f} tok/s  "
        f"ETA {m}:{s:02d}"
    )
