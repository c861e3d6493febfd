"""benchmarks/gpu.py cannot waste a GPU (issue 47): every section runs in a process of its own
with its own time budget, rows are written as they finish, and a section that hangs is stopped
and loses only itself. Run on the CPU with --smoke: correctness (flex and the selector against
the naive kernel), presets (made to hang after its 2nd row: GPU_BENCH_STALL, as a compile that
never ends), then serve, which must still run and be kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT


def test_a_hung_section_is_stopped_and_loses_only_itself(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, GPU_BENCH_STALL="presets:2")
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--device", "cpu",
         "--sections", "correctness,presets,serve", "--section-budget", "presets=40",
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    # correctness: every kind, fused flex and the selector within 1e-3 of naive (fp32)
    assert [r["kind"] for r in result["correctness"]] == [
        "none", "alibi", "t5", "softcap", "sinks", "window", "longformer", "bigbird", "padding"
    ]  # fmt: skip
    assert all(r["ok"] for r in result["correctness"]), result["correctness"]
    assert result["counters"]["correctness"]["unfused_flex_warnings"] == 0
    assert result["counters"]["correctness"]["flex_fallback_calls"] == 0
    assert any(v.startswith("PASS correctness padding") for v in result["verdicts"])
    assert any(v.startswith("FAIL presets: stopped") for v in result["verdicts"])
    # presets: its two rows kept, then stopped past its budget; no counters (it never ended)
    assert len(result["presets"]) == 2 and "error" not in result["presets"][0]
    assert "past its 40 s" in result["sections"]["presets"]["stopped"]
    assert "presets" not in result["counters"]
    # serve ran after it: its rows and counters are there, every request's tokens checked
    assert [r["requests"] for r in result["serve"]] == [4, 8]
    for row in result["serve"]:
        assert row["rows"]["differs"] == 0 and row["compiles_in_timed_run"] == 0, row
    assert "serve" in result["counters"]
    assert not (tmp_path / "gpu.json.rows.jsonl").exists()  # folded into the JSON at the end
