"""The tiny training recipes (`--set` overrides per recipe) and the records a run writes
(tests/train/)."""

from __future__ import annotations

import json
from pathlib import Path

# recipe -> `--set` overrides that make it a seconds-long run on the tiny data sets
# (tests/train/conftest.py)
TINY = {
    "multi30k-de-en-quick": [
        "model.overrides.d_model=64", "model.overrides.n_heads=2", "model.overrides.d_ff=128",
        "model.overrides.n_layers=1", "data.vocab_size=400", "batch.max_tokens=400",
        "optimizer.lr=0.5", "optimizer.label_smoothing=0", "schedule.warmup=20",
        "decoding.num_beams=2",
    ],
    "shakespeare-char": ["model.overrides.d_model=32", "data.context=16", "eval.batches=4"],
    "sst2": ["model.overrides.d_model=32", "model.overrides.d_ff=64", "data.vocab_size=200",
             "batch.max_tokens=256", "optimizer.lr=3e-3", "schedule.warmup=5"],
}  # fmt: skip


def set_args(sets: list[str]) -> list[str]:
    """The command-line form of `--set` overrides."""
    return [x for s in sets for x in ("--set", s)]


def train_records(run_dir) -> list[tuple[int, float]]:
    """(step, loss) of every train record in metrics.jsonl, in file order (duplicates kept)."""
    recs = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["split"] == "train"]
