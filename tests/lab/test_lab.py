"""The lab (src/attnlab/lab/): the verdict logic on synthetic results, experiment validation,
and every experiment of configs/labs/ run end to end with --quick on a tiny stand-in corpus."""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from attnlab.cli import main as cli
from attnlab.config import ConfigError
from attnlab.lab import decide, measure, spec
from attnlab.lab.report import judge
from attnlab.lab.runner import plan, run_lab
from attnlab.lab.verdict import t_quantiles
from helpers.lab import tiny_lab

# every test in a fresh HOME (tests/lab/conftest.py)
pytestmark = pytest.mark.usefixtures("own_cache")

# --- the verdict: a pure function ---------------------------------------------------------------


def test_paired_interval_is_the_t_interval_of_per_seed_differences():
    a = {1: (2.0, None), 2: (2.2, None), 3: (2.1, None)}
    b = {1: (2.5, None), 2: (2.6, None), 3: (2.7, None)}
    m = measure(a, b)
    d = [-0.5, -0.4, -0.6]  # per seed
    sd = math.sqrt(sum((x + 0.5) ** 2 for x in d) / 2)
    assert m.n == 3 and m.method == "paired over 3 seeds"
    assert m.estimate == pytest.approx(-0.5)
    assert m.hi == pytest.approx(-0.5 + 4.303 * sd / math.sqrt(3))  # t(0.975, df 2) = 4.303
    assert m.mde == pytest.approx((4.303 + 1.061) * sd / math.sqrt(3))


def test_verdicts_pass_fail_inconclusive_and_gate():
    # pass: clearly lower, as claimed
    clear = measure({1: (1.5, 0.01)}, {1: (1.7, 0.01)})
    assert decide(clear, "lower").status == "pass"
    # fail: clearly the other way
    assert decide(clear, "higher").status == "fail"
    # inconclusive: the interval straddles 0; the minimum detectable effect is stated
    noisy = measure({1: (1.69, 0.05)}, {1: (1.70, 0.05)})
    v = decide(noisy, "lower")
    assert v.status == "inconclusive"
    assert f"minimum detectable effect {(1.96 + 0.842) * math.sqrt(2) * 0.05:.3g}" in v.reason
    # a margin: an effect of 0.2 is not "at least 0.3"
    assert decide(clear, "lower", margin=0.3).status == "fail"
    # equal within a tolerance; and a model that did not learn gives no verdict at all
    same = measure({1: (1.70, 0.001)}, {1: (1.701, 0.001)})
    assert decide(same, "equal", margin=0.02).status == "pass"
    assert decide(clear, "equal", margin=0.02).status == "fail"
    gated = decide(clear, "lower", gate_failed=["rope s1 val_loss 3.1 > 2.0"])
    assert gated.status == "no verdict" and "quality gate failed" in gated.reason
    assert decide(None, "lower").status == "no verdict"


def test_equal_needs_a_passing_positive_control():
    same = measure({1: (1.70, 0.001)}, {1: (1.701, 0.001)})
    v = decide(same, "equal", margin=0.02, control_passed=False)
    assert v.status == "inconclusive" and "positive control" in v.reason
    assert decide(same, "equal", margin=0.02, control_passed=True).status == "pass"


def test_log_claims_compare_ratios_and_constants():
    m = measure({1: (50.0, 0.5)}, 100.0, log=True)
    assert math.exp(m.estimate) == pytest.approx(0.5)
    assert m.se == pytest.approx(0.5 / 50.0)  # delta method
    assert decide(m, "lower").status == "pass"
    assert "ratio 0.5" in m.describe()
    assert t_quantiles(math.inf) == (1.960, 0.842)
    assert measure({1: (1.0, None)}, {1: (2.0, None)}) is None  # one seed, no error bars


def test_judge_on_synthetic_results_with_the_gate():
    lab = spec.from_dict(tiny_lab())

    def rec(variant, seed, loss):
        return {"variant": variant, "seed": seed, "metrics": {"val_loss": loss}}

    good = [
        rec("rope", 1, 1.50),
        rec("rope", 2, 1.52),
        rec("alibi", 1, 1.60),
        rec("alibi", 2, 1.63),
    ]
    (r,) = judge(lab, good)
    assert r.verdict.status == "pass" and r.measurement.method == "paired over 2 seeds"
    bad = [*good[:3], rec("alibi", 2, 3.9)]  # one run did not learn
    (r,) = judge(lab, bad)
    assert r.verdict.status == "no verdict" and "alibi s2 val_loss 3.900 > 2.0" in r.verdict.reason


# --- experiment files ---------------------------------------------------------------------------


def test_bad_experiments_are_refused_with_every_problem():
    data = tiny_lab(
        evaluate=[{"kind": "val_los"}, {"kind": "length", "multiples": "x"}],
        claims=[{"id": "c", "text": "t", "literature": "l", "citation": "x", "a": "rop.val_loss",
                 "b": 1.0, "expect": "lower"}],
        plots=[{"kind": "lines", "title": "t", "metric": "val_loss"}],
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        spec.from_dict(data)
    text = str(err.value)
    assert "unknown evaluation 'val_los'" in text and "Did you mean 'val_loss'" in text
    assert "evaluate.1.multiples" in text
    assert "unknown variant 'rop'" in text and "'rope'" in text
    assert "a 'lines' plot needs x values" in text
    assert "positive control" in text
    with pytest.raises(ConfigError, match="varaints: unknown key"):
        spec.from_dict({**tiny_lab(), "varaints": {}})
    with pytest.raises(FileNotFoundError, match="Did you mean 'positions'"):
        spec.load("positons")


def test_every_experiment_validates_and_plans(tmp_path):
    names = spec.names()
    assert {"positions", "rope-scaling", "norm-placement", "norms", "activations", "kv-heads",
            "moe", "shape-vs-size", "kv-cache", "sqrt-dk", "attention-cost"} <= set(names)  # fmt: skip
    for name in names:
        lab = spec.load(name)
        assert any(c.control for c in lab.claims), name
        for quick in (False, True):
            runs = plan(lab, tmp_path, quick)
            assert {r.variant for r in runs} == set(lab.variants)
    # paired seeds: variants share each seed, and a seed sets the recipe's seed (init, data order)
    runs = plan(spec.load("norms"), tmp_path)
    assert sorted((r.variant, r.recipe["seed"]) for r in runs)[:2] == [("layernorm", 1), ("layernorm", 2)]  # fmt: skip


# --- end to end --------------------------------------------------------------------------------


def test_a_lab_runs_resumes_and_reports(data_dir, tmp_path, monkeypatch):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_lab(plots=[{"kind": "bars", "title": "Loss", "metric": "val_loss"}]), sort_keys=False))  # fmt: skip
    out = tmp_path / "out"
    run_lab(path, out=out, data_dir=data_dir, log=lambda *a: None)
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["seed"]) for r in records] == [("rope", 1), ("rope", 2), ("alibi", 1), ("alibi", 2)]  # fmt: skip
    assert all(r["errors"] == {} and r["metrics"]["val_loss_se"] > 0 for r in records)
    report = (out / "report.md").read_text()
    for heading in ("# Lab: tiny", "## Claims", "## Runs", "## Plots", "## Verdicts"):
        assert heading in report
    assert "paired over 2 seeds" in report and "(positive control)" in report
    assert "--quick run" not in report and "mode: full" in (out / "lab.yaml").read_text()
    assert "no verdict (quality gate failed" in report  # 4 steps do not learn
    assert (out / "loss.png").stat().st_size > 1000
    # finished runs are not redone
    stamp = (out / "rope-s1" / "lab.json").stat().st_mtime_ns
    run_lab(path, out=out, data_dir=data_dir, log=lambda *a: None)
    assert (out / "rope-s1" / "lab.json").stat().st_mtime_ns == stamp
    # a run killed mid-training continues from its checkpoint
    import attnlab.train.run as R

    (out / "alibi-s2" / "lab.json").unlink()
    (out / "alibi-s2" / "results.json").unlink()  # what a kill before the final test leaves
    seen = []
    real = R.train
    monkeypatch.setattr(R, "train", lambda *a, **k: seen.append(1) or real(*a, **k))
    run_lab(path, out=out, data_dir=data_dir, log=lambda *a: None)
    assert seen == [1] and "resumed" in (out / "alibi-s2" / "log.txt").read_text()
    # the same folder with another recipe is refused rather than mixed
    path.write_text(
        yaml.safe_dump(tiny_lab(overrides={**tiny_lab()["overrides"], "steps": 5}), sort_keys=False)
    )
    with pytest.raises(ValueError, match="holds a finished run of another recipe"):
        run_lab(path, out=out, data_dir=data_dir, log=lambda *a: None)


@pytest.mark.parametrize("name", sorted(spec.names()))
def test_every_experiment_runs_quick(name, data_dir, tmp_path):
    out = tmp_path / name
    argv = ["lab", "run", name, "--quick", "--out", str(out), "--data-dir", str(data_dir)]
    assert cli(argv) == 0
    lab = spec.load(name)
    records = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert {r["variant"] for r in records} == set(lab.variants)
    assert all(r["errors"] == {} for r in records), [r["errors"] for r in records]
    report = (out / "report.md").read_text()
    assert "--quick run" in report
    for c in lab.claims:
        assert f"**{c.id}**" in report
    rows = [x for x in report.splitlines() if x.startswith("| **")]
    assert len(rows) == len(lab.claims)
    assert all(any(f"**{s}" in row for s in ("pass", "fail", "inconclusive", "no verdict")) for row in rows)  # fmt: skip
    assert cli(["lab", "report", str(out)]) == 0


def test_run_takes_set_and_threads_and_quick_needs_no_warmup_advice(data_dir, tmp_path, capsys):
    """--set changes every run's recipe after the variant's own keys; --threads sets each run's
    torch threads; --quick cuts a warm-up longer than its few steps (no warning per run)."""
    import torch

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_lab(seeds=[1]), sort_keys=False))
    out, before = tmp_path / "out", torch.get_num_threads()
    argv = ["lab", "run", str(path), "--quick", "--out", str(out), "--data-dir", str(data_dir),
            "--set", "steps=3", "--set", "optimizer.lr=0.002", "--threads", "1"]  # fmt: skip
    try:
        assert cli(argv) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "warm-up" not in "".join(capsys.readouterr())
    for variant, kind in (("rope", "rope"), ("alibi", "alibi")):
        recipe = yaml.safe_load((out / f"{variant}-s1" / "recipe.yaml").read_text())
        assert recipe["steps"] == 3 and recipe["optimizer"]["lr"] == 0.002
        assert recipe["schedule"]["warmup"] < 3
        assert recipe["model"]["overrides"]["positional"]["kind"] == kind  # the variant's own
    assert cli(["lab", "run", str(path), "--set", "steps"]) == 2
    assert "expected key.sub=value, got 'steps'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's one line (cli/numbers.py)
        cli(["lab", "run", str(path), "--threads", "0"])
    assert refused.value.code == 2
    assert "argument --threads: 0 is not >= 1" in capsys.readouterr().err


def test_cli_lists_and_refuses_unknown_names(capsys):
    assert cli(["lab", "list"]) == 0
    listed = capsys.readouterr().out
    assert "positions" in listed
    assert re.search(r"positions: \d+ variants x \d+ seed\(s\), about \d+ min in full", listed)
    assert cli(["lab", "run", "positons", "--quick"]) == 2
    assert "Did you mean 'positions'" in capsys.readouterr().err


# --- attention maps ----------------------------------------------------------------------------


def test_capture_returns_the_naive_weights_and_restores_the_model():
    import torch

    import attnlab as al
    from attnlab.lab.attention import capture

    cfg = al.presets.tiny(al.presets.get("transformer-base-2017"))
    torch.manual_seed(0)
    model = al.build_model(cfg).eval()
    src, tgt = torch.randint(4, cfg.vocab_size, (1, 7)), torch.randint(4, cfg.vocab_size, (1, 5))
    before = model(src, tgt).logits
    with capture(model) as w:
        during = model(src, tgt).logits
    cross = w["decoder.blocks.0.cross_attn"]  # (B, H, T, S): target rows over source columns
    assert cross.shape == (1, cfg.n_heads, 5, 7)
    torch.testing.assert_close(cross.sum(-1), torch.ones(1, cfg.n_heads, 5))
    self_w = w["decoder.blocks.0.self_attn"]
    assert (
        float(self_w[0, :, 0, 1:].abs().max()) == 0.0
    )  # causal: the first target sees itself only
    torch.testing.assert_close(during, before, rtol=1e-5, atol=1e-5)  # naive == sdpa
    layer = model.decoder.blocks[0].self_attn
    assert "forward" not in vars(layer) and layer.kernel == "auto"  # restored


def test_attention_command_draws_heatmaps(data_dir, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_lab(seeds=[1]), sort_keys=False))
    out = tmp_path / "out"
    run_lab(path, out=out, data_dir=data_dir, log=lambda *a: None)
    assert cli(["lab", "attention", str(out / "rope-s1"), "ROMEO: speak", "--layer", "0"]) == 0
    png = out / "rope-s1" / "attention" / "self-attention-layer0.png"
    assert png.stat().st_size > 1000
    assert cli(["lab", "attention", str(out / "rope-s1"), "ROMEO", "--layer", "5"]) == 2


def test_line_plots_label_exactly_the_evaluated_lengths(tmp_path, monkeypatch):
    """A log x axis labels the x values evaluated (1, 2, 4, 8), not matplotlib's choice (3, 6)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnlab.lab.plots import draw
    from attnlab.lab.spec import Plot

    shown = []
    monkeypatch.setattr(plt, "close", lambda fig=None: shown.append(fig))
    plot = Plot(kind="lines", title="loss vs length", metric="len_loss_x{x}", x=[1, 2, 4, 8],
                logx=True)  # fmt: skip
    records = [{"variant": "rope", "metrics": {f"len_loss_x{x}": 1.0 + x for x in (1, 2, 4, 8)}}]
    assert draw(plot, records, ["rope"], tmp_path) is not None
    ax = shown[-1].axes[0]
    shown[-1].canvas.draw()
    assert list(ax.get_xticks()) == [1, 2, 4, 8]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8"]
    assert len(ax.xaxis.get_minorticklocs()) == 0


def test_model_stats_active_parameters_skip_dense_blocks(tmp_path):
    """DeepSeek's first blocks are dense: only the sparse blocks' idle experts are subtracted
    (the count `attnlab inspect` prints, checked by hand in tests/cli/test_inspect.py)."""
    import attnlab as al
    from attnlab.cli.inspect import active_parameters
    from attnlab.lab.evals import RunContext, model_stats

    cfg = al.presets.tiny(al.presets.get("deepseek-v3"))
    ctx = RunContext(recipe=None, cfg=cfg, model=al.build_model(cfg), run_dir=tmp_path,
                     base_context=16)  # fmt: skip
    stats = model_stats(ctx)
    assert stats["active_params"] == active_parameters(cfg) < stats["params"]
