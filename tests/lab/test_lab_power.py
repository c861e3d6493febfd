"""The seed plan and the power of the lab's verdicts (src/attnlab/lab/power.py), on synthetic
results: Student's t against its own quantile table and closed forms, and the plan's promise — a
known effect is detected at the planned seed count in >= 75 % of simulated repeats (80 % is the
target) — checked by simulation through the real verdict logic."""

from __future__ import annotations

import math
import random

import pytest
import yaml

from attnlab.cli import main as cli
from attnlab.lab import decide, measure
from attnlab.lab.power import power, seeds_for, t_cdf
from attnlab.lab.verdict import _T80, _T975


@pytest.mark.parametrize("df", [1, 2, 3, 5, 10, 30])
def test_t_cdf_gives_back_the_quantile_table(df):
    assert t_cdf(_T975[df - 1], df) == pytest.approx(0.975, abs=2e-5)
    assert t_cdf(_T80[df - 1], df) == pytest.approx(0.80, abs=2e-4)
    assert t_cdf(0.0, df) == pytest.approx(0.5)
    assert t_cdf(-1.3, df) == pytest.approx(1 - t_cdf(1.3, df))


def test_t_cdf_closed_forms():
    # df 1 is Cauchy: 1/2 + atan(x)/pi; df 2: 1/2 + x / (2 sqrt(2 + x^2)); inf: the normal
    for x in (-3.0, -0.4, 0.7, 5.0):
        assert t_cdf(x, 1) == pytest.approx(0.5 + math.atan(x) / math.pi, abs=1e-12)
        assert t_cdf(x, 2) == pytest.approx(0.5 + x / (2 * math.sqrt(2 + x * x)), abs=1e-12)
        assert t_cdf(x, math.inf) == pytest.approx(0.5 * math.erfc(-x / math.sqrt(2)), abs=1e-15)


def test_power_grows_with_seeds_and_the_plan_is_the_first_count_past_80_percent():
    n = seeds_for(0.02, 0.02)
    assert n is not None and n > 2
    at = lambda k: power(0.02, 0.02 / math.sqrt(k), k - 1)  # noqa: E731
    assert at(n) >= 0.8 > at(n - 1)
    assert [at(k) for k in range(2, 12)] == sorted(at(k) for k in range(2, 12))
    assert seeds_for(0.01, 0.02, margin=0.01) is None  # an effect no larger than the margin
    assert seeds_for(0.5, 0.02) == 2  # a large effect: two paired seeds already show it


@pytest.mark.parametrize(("effect", "sd", "margin"), [(0.02, 0.02, 0.0), (0.05, 0.03, 0.01),
                                                      (0.016, 0.01, 0.0)])  # fmt: skip
def test_a_known_effect_is_detected_at_the_planned_seed_count(effect, sd, margin):
    """2,000 simulated experiments at the planned seed count, each decided by measure + decide
    (paired seeds, the same code the reports use): the claim passes in >= 75 % of them."""
    n = seeds_for(effect, sd, margin)
    rng = random.Random(0)
    passed = 0
    for _ in range(2000):
        a = {s: (rng.gauss(-effect, sd), None) for s in range(n)}  # a lower than b by `effect`
        b = {s: (0.0, None) for s in range(n)}
        passed += decide(measure(a, b), "lower", margin).status == "pass"
    assert passed / 2000 >= 0.75, (n, passed / 2000)
    # and one seed fewer than the plan falls short of the target more often than not
    if n > 3:
        passed = 0
        for _ in range(2000):
            a = {s: (rng.gauss(-effect, sd), None) for s in range(n - 1)}
            b = {s: (0.0, None) for s in range(n - 1)}
            passed += decide(measure(a, b), "lower", margin).status == "pass"
        assert passed / 2000 < 0.8 + 0.03


def test_plan_adds_seeds_until_decided_or_the_maximum(tmp_path, capsys):
    """--plan starts at 3 seeds and reports its stopping reason; the report shows power beside
    each inconclusive verdict (a --quick run: the mechanics, not the verdicts)."""
    import gzip

    data = tmp_path / "data"
    (data / "tinyshakespeare").mkdir(parents=True)
    text = "".join(f"ROMEO:\nFirst Citizen {i % 7}: speak, speak.\n" for i in range(400))
    (data / "tinyshakespeare" / "input.txt.gz").write_bytes(gzip.compress(text.encode()))
    lab = {
        "name": "tiny", "recipe": "shakespeare-char",
        "overrides": {"steps": 2, "batch": {"size": 2}, "eval": {"every": 2, "batches": 2, "samples": []},
                      "model": {"overrides": {"d_model": 16, "n_layers": 1, "n_heads": 2}}},
        "variants": {"rope": {"model": {"overrides": {"positional": {"kind": "rope"}}}},
                     "alibi": {"model": {"overrides": {"positional": {"kind": "alibi"}}}}},
        "seeds": [1],
        "evaluate": [{"kind": "val_loss", "max_windows": 3}],
        "claims": [{"id": "alibi-differs", "text": "t", "literature": "l", "citation": "c",
                    "a": "alibi.val_loss", "b": "rope.val_loss", "expect": "lower",
                    "effect": 0.5, "gated": False, "control": True}],
    }  # fmt: skip
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(lab, sort_keys=False))
    out = tmp_path / "out"
    argv = ["lab", "run", str(path), "--quick", "--out", str(out), "--data-dir", str(data),
            "--plan", "4", "--threads", "1"]  # fmt: skip
    assert cli(argv) == 0
    said = capsys.readouterr().out
    seeds = {p.name.rsplit("-s", 1)[1] for p in out.iterdir() if p.is_dir()}
    assert {"1", "2", "3"} <= seeds <= {"1", "2", "3", "4"}
    assert "plan: " in said
    report = (out / "report.md").read_text()
    assert "| power (inconclusive) |" in report
    row = next(x for x in report.splitlines() if x.startswith("| **alibi-differs**"))
    assert ("**inconclusive" in row) == ("power " in row and "the stated effect 0.5" in row)
    with pytest.raises(SystemExit) as refused:  # argparse's one line (cli/numbers.py)
        cli(["lab", "run", str(path), "--plan", "2"])
    assert refused.value.code == 2
    assert "argument --plan: 2 is not >= 3" in capsys.readouterr().err
