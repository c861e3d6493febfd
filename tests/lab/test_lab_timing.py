"""The lab's timed evaluations run after training, one run at a time, in seed order, and each
record says what they were taken on (src/attnlab/lab/runner.py time_runs, evals.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import yaml

from attnlab.cli import main as cli
from attnlab.lab import evals
from attnlab.lab.runner import busy_cores, run_lab
from helpers.lab import tiny_lab

# every test in a fresh HOME (tests/lab/conftest.py)
pytestmark = pytest.mark.usefixtures("own_cache")

TIMED = [
    {"kind": "val_loss", "max_windows": 3},
    {"kind": "norm_timing", "rows": 8, "reps": 2},
    {"kind": "step_timing", "reps": 2, "warmup": 0},
]


@pytest.fixture
def lab_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_lab(evaluate=TIMED), sort_keys=False))
    return path


def _records(out):
    return {r["run_dir"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}  # fmt: skip


def test_timings_come_after_training_in_seed_order(lab_file, data_dir, tmp_path, monkeypatch):
    data = data_dir
    order, real = [], evals.EVALS.get("step_timing").fn
    trained_when_timed = []

    def spy(ctx, a):
        order.append(ctx.run_dir.name)
        trained_when_timed.append(sorted(p.name for p in ctx.run_dir.parent.glob("*/lab.json")))
        return real(ctx, a)

    spied = dataclasses.replace(evals.EVALS.get("step_timing"), fn=spy)
    get = evals.EVALS.get
    monkeypatch.setattr(evals.EVALS, "get", lambda n: spied if n == "step_timing" else get(n))
    out = tmp_path / "out"
    run_lab(lab_file, out=out, data_dir=data, jobs=1, log=lambda *a: None)
    # every run trained (its lab.json written) before the first timing; then seed-major order
    assert all(len(seen) == 4 for seen in trained_when_timed)
    assert order == ["rope-s1", "alibi-s1", "rope-s2", "alibi-s2"]
    recs = _records(out)
    for r in recs.values():
        assert r["metrics"]["train_step_ms"] > 0 and r["metrics"]["norm_call_us"] > 0
        t = r["timing"]
        assert t["threads"] == 1 and t["weights"] == "trained" and t["cpu"] and t["device"] == "cpu"  # fmt: skip
        assert t["busy_cores"] is None or 0 <= t["busy_cores"] <= (os.cpu_count() or 1) + 1e-6
    # a rerun times nothing again; --retime times every run again
    order.clear()
    run_lab(lab_file, out=out, data_dir=data, log=lambda *a: None)
    assert order == []
    assert cli(["lab", "run", str(lab_file), "--out", str(out), "--data-dir", str(data), "--retime"]) == 0  # fmt: skip
    assert order == ["rope-s1", "alibi-s1", "rope-s2", "alibi-s2"]
    # a run whose checkpoints are gone (results kept, e.g. committed) is timed on a fresh draw
    for ck in (out / "rope-s1").iterdir():
        if ck.is_dir():
            shutil.rmtree(ck)
    run_lab(lab_file, out=out, data_dir=data, retime=True, log=lambda *a: None)
    recs = _records(out)
    assert recs["rope-s1"]["timing"]["weights"] == "fresh draw"
    assert recs["alibi-s1"]["timing"]["weights"] == "trained"
    report = (out / "report.md").read_text()
    assert "Timings: taken after training, one run at a time" in report
    assert "timed on a fresh draw" in report


def test_busy_cores_measures_the_machine():
    b = busy_cores(0.05)
    if not os.path.exists("/proc/stat"):
        assert b is None
    else:
        assert b is not None and 0 <= b <= (os.cpu_count() or 1) + 1e-6


def test_timed_evaluations_are_marked():
    timed = {n for n in evals.EVALS.names() if evals.EVALS.get(n).timed}
    assert timed == {"decode_latency", "attention_cost", "norm_timing", "step_timing"}
