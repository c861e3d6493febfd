"""report.md of a lab run: per claim the literature's number and citation, our measurement with
its 95% interval and the verdict (src/attnlab/lab/verdict.py); the runs; the plots."""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import spec as S
from .plots import draw
from .verdict import Measurement, Verdict, decide, measure

RESULTS = "results.jsonl"  # one line per finished run (src/attnlab/lab/runner.py writes it)


@dataclass(frozen=True)
class ClaimResult:
    claim: S.Claim
    measurement: Measurement | None
    verdict: Verdict
    a_mean: float | None
    b_mean: float | None


def read_results(out: str | Path) -> list[dict[str, Any]]:
    path = Path(out) / RESULTS
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {out} a lab run folder (attnlab lab run NAME)?")  # fmt: skip
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def values(records: list[dict[str, Any]], ref: str) -> dict[int, tuple[float, float | None]]:
    """seed -> (value, standard error) of 'variant.metric' over the finished runs."""
    variant, _, metric = ref.partition(".")
    out = {}
    for r in records:
        v = r["metrics"].get(metric)
        if r["variant"] == variant and isinstance(v, (int, float)) and math.isfinite(v):
            se = r["metrics"].get(f"{metric}_se")
            out[r["seed"]] = (float(v), float(se) if isinstance(se, (int, float)) else None)
    return out


def _gate(lab: S.Lab, records: list[dict[str, Any]], variants: set[str], quick: bool,
          corpus: str | None):  # fmt: skip
    """(record, gate value, limit, its variant's seed spread, learned) for every trained run of
    `variants`: learned when the value is at most the limit plus the seed-to-seed spread
    (standard deviation) of that variant's runs; with one seed there is no spread and the
    maximum is strict. Nothing without a gate."""
    limit = lab.gate_max(quick, corpus)
    if lab.gate is None or limit is None:
        return
    metric = lab.gate.metric
    for variant in sorted(variants):
        runs = [r for r in records if r["variant"] == variant and r.get("trained", True)]
        vals = [r["metrics"].get(metric) for r in runs]
        finite = [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
        spread = statistics.stdev(finite) if len(finite) >= 2 else 0.0
        for r, v in zip(runs, vals, strict=True):
            yield r, v, limit, spread, isinstance(v, (int, float)) and v <= limit + spread


def gate_failures(lab: S.Lab, records: list[dict[str, Any]], variants: set[str], quick: bool,
                  corpus: str | None = None) -> list[str]:  # fmt: skip
    """The runs of `variants` whose model did not learn: the gate metric above its maximum by
    more than the seed-to-seed spread of that variant's runs (`_gate`). A run that misses by
    less is as good as its variant's seeds are alike, and is counted as having learned."""
    out = []
    for r, v, limit, spread, learned in _gate(lab, records, variants, quick, corpus):
        if not learned:
            shown = f"{v:.3f}" if isinstance(v, (int, float)) else "missing"
            within = f" + seed spread {spread:.3f}" if spread else ""
            out.append(f"{r['variant']} s{r['seed']} {lab.gate.metric} {shown} > {limit}{within}")
    return out


def gate_notes(lab: S.Lab, records: list[dict[str, Any]], quick: bool, corpus: str | None = None) -> list[str]:  # fmt: skip
    """The runs above the gate's maximum that count as having learned (within their spread)."""
    return [f"{r['variant']} s{r['seed']} ({v:.3f})"
            for r, v, limit, _, learned in _gate(lab, records, set(lab.variants), quick, corpus)
            if learned and v > limit]  # fmt: skip


def judge(lab: S.Lab, records: list[dict[str, Any]], quick: bool = False,
          corpus: str | None = None) -> list[ClaimResult]:  # fmt: skip
    """Every claim's measurement and verdict; positive controls first, as the others need them."""
    results: dict[str, ClaimResult] = {}
    control_passed: bool | None = None
    claims = [_scaled(c, lab.loss_scale(corpus)) for c in lab.claims]
    for c in sorted(claims, key=lambda c: not c.control):
        if not c.control and control_passed is None:
            ctl = [r for r in results.values() if r.claim.control]
            control_passed = all(r.verdict.status == "pass" for r in ctl) if ctl else None
        a = values(records, c.a)
        b = values(records, c.b) if isinstance(c.b, str) else float(c.b)
        involved = {c.a.partition(".")[0]} | ({c.b.partition(".")[0]} if isinstance(c.b, str) else set())  # fmt: skip
        failed = gate_failures(lab, records, involved, quick, corpus) if c.gated else []
        try:
            m = measure(a, b, log=c.log)
        except ValueError:  # e.g. a non-positive value in a log claim
            m = None
        v = decide(m, c.expect, c.margin, failed, None if c.control else control_passed)
        mean = lambda d: sum(x for x, _ in d.values()) / len(d) if d else None  # noqa: E731
        results[c.id] = ClaimResult(c, m, v, mean(a), mean(b) if isinstance(b, dict) else b)
    return [results[c.id] for c in lab.claims]


def _scaled(c: S.Claim, scale: float) -> S.Claim:
    """Claim c in a corpus's loss units: margin and effect times `scale` unless c is a ratio."""
    if scale == 1.0 or c.log:
        return c
    return c.model_copy(update={"margin": c.margin * scale, "effect": c.effect * scale if c.effect else None})  # fmt: skip


def planned_seeds(r: ClaimResult) -> tuple[int | None, str]:
    """(the paired seeds that would decide claim r with 80 % power, why) from the spread of its
    per-seed effects: for its stated `effect`, else for the effect measured. (None, why) when
    there is nothing to plan from (one seed, no measurement) or no count would do."""
    from .power import seeds_for

    m, c = r.measurement, r.claim
    if m is None or not m.method.startswith("paired"):
        return None, "needs >= 2 paired seeds to measure the seed-to-seed spread"
    sd = m.se * math.sqrt(m.n)
    target, what = (
        (c.effect, "the stated effect") if c.effect else (m.estimate, "the measured effect")
    )
    if c.expect == "equal":  # an equality is decided when the interval fits inside ±margin
        target, what = c.margin, "the tolerance"
        n = seeds_for(target, sd, 0.0, most=1000) if target else None
    else:
        n = seeds_for(target, sd, c.margin, most=1000)
    return n, f"{what} {abs(target):.3g}" if target else what


def power_note(r: ClaimResult) -> str:
    """For an inconclusive claim: the power these seeds had for the effect the claim states (or
    the one measured) and the seeds that would reach 80 %."""
    from .power import power

    m, c = r.measurement, r.claim
    if r.verdict.status != "inconclusive" or m is None:
        return ""
    n, why = planned_seeds(r)
    target = c.effect if c.effect else abs(m.estimate)
    margin = 0.0 if c.expect == "equal" else c.margin
    achieved = power(target if c.expect != "equal" else c.margin, m.se, m.df, margin)
    if c.expect == "equal":
        what = f"the tolerance {c.margin:.3g}"
    else:
        what = f"{'the stated' if c.effect else 'the measured'} effect {target:.3g}"
    if not m.method.startswith("paired"):  # one seed: no spread to plan from
        return f"power {achieved:.0%} for {what} (within-run error only); {why}"
    need = f"{n} paired seeds would reach 80 %" if n else "no seed count up to 1,000 would"
    return f"power {achieved:.0%} for {what}; {need}"


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "—" if x is None else str(x)


def write_report(out: str | Path, lab: S.Lab | None = None, corpus: str | None = None) -> Path:
    """(Re)write out/report.md and its plots from out/results.jsonl; `corpus`: the lab's
    corpus the runs used (default: what out/lab.yaml records)."""
    out = Path(out)
    spec_data = yaml.safe_load((out / "lab.yaml").read_text()) if (out / "lab.yaml").exists() else None  # fmt: skip
    if spec_data is None and lab is None:
        raise FileNotFoundError(f"{out}/lab.yaml does not exist: is {out} a lab run folder?")
    quick = spec_data is not None and spec_data.get("mode") == "quick"
    if corpus is None and spec_data is not None:
        corpus = spec_data.get("corpus")
    if lab is None:
        lab = S.from_dict({k: v for k, v in spec_data.items() if k not in ("mode", "corpus")})
    records = read_results(out)
    claims = judge(lab, records, quick, corpus)
    scale = lab.loss_scale(corpus)
    L: list[str] = [f"# Lab: {lab.name}", "", lab.description.strip(), ""]
    if quick:
        L += ["**--quick run**: a few steps at toy sizes to exercise the pipeline; its verdicts mean nothing.", ""]  # fmt: skip
    seeds = sorted({r["seed"] for r in records})
    L += [f"Runs finished: {len(records)} (variants: {', '.join(lab.variants)}; seeds: {', '.join(map(str, seeds))}). Base recipe: `{lab.recipe}`."]  # fmt: skip
    if corpus is not None:
        about = lab.corpora[corpus].description.strip()
        L += ["", f"Corpus: **{corpus}**{' — ' + about if about else ''} (a replication: the recipe's data replaced by `{json.dumps(lab.corpora[corpus].overrides)}`)."]  # fmt: skip
        if scale != 1.0:
            L += [f"Losses are per token here: the margins and stated effects of the loss claims are {scale:g}× the recipe's (its characters per token), the same effect per character."]  # fmt: skip
    if lab.gate is not None:
        limit = lab.gate_max(quick, corpus)
        L += [f"Quality gate: {lab.gate.metric} ≤ {limit} — a run above it by more than its variant's seed-to-seed spread did not learn, and claims that depend on it get no verdict."]  # fmt: skip
        near = gate_notes(lab, records, quick, corpus)
        if near:
            L += [f"Above {limit} but within their variant's seed spread (counted as learned): {', '.join(near)}."]  # fmt: skip
    L += ["", "## Claims", "", "| claim | literature | measured: a − b, 95% CI | verdict | power (inconclusive) |", "|---|---|---|---|---|"]  # fmt: skip
    for r in claims:
        c = r.claim
        tag = " (positive control)" if c.control else ""
        meas = r.measurement.describe() if r.measurement else "—"
        L.append(f"| **{c.id}**{tag}: {c.text} | {c.literature} ({c.citation}) | {meas} | **{r.verdict}** | {power_note(r) or '—'} |")  # fmt: skip
    L += ["", "### What was compared", ""]
    for r in claims:
        c = r.claim
        b = c.b if isinstance(c.b, str) else f"the constant {c.b}"
        rule = {"lower": "a < b", "higher": "a > b", "equal": "|a − b| small"}[c.expect]
        margin = f", {'tolerance' if c.expect == 'equal' else 'margin'} {c.margin}" if c.margin else ""  # fmt: skip
        L.append(f"- **{c.id}**: a = `{c.a}` (mean {_fmt(r.a_mean)}), b = `{b}` (mean {_fmt(r.b_mean)}); expected {rule}{margin}{' on log values (a ratio)' if c.log else ''}.")  # fmt: skip
    timed = [r for r in records if r.get("timing")]
    if timed:
        cpus = sorted({r["timing"].get("cpu", "?") for r in timed})
        thr = sorted({r["timing"].get("threads") for r in timed})
        busy = [r for r in timed if (r["timing"].get("busy_cores") or 0) >= 0.5]
        L += ["", f"Timings: taken after training, one run at a time, paired runs one after the other, on {', '.join(cpus)} with {'/'.join(map(str, thr))} thread(s)."]  # fmt: skip
        if busy:
            worst = max(r["timing"]["busy_cores"] for r in busy)
            L += [f"**Warning:** {len(busy)} of {len(timed)} runs were timed while other processes kept up to {worst:.1f} cores busy: those timings measure contention as much as the code (`attnlab lab run {lab.name} --retime` on a quiet machine times them again)."]  # fmt: skip
    L += ["", "## Runs", "", "| run | val_loss | parameters | tokens/s | time (s) | load | notes |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    cpus_all = {rec.get("cpu", "?") for rec in records}  # named per run when they differ
    for rec in records:
        m = rec["metrics"]
        notes = [v for k, v in m.items() if k.startswith("len_note_")][:1]
        notes += [f"diverged: {rec['diverged'][:80]}"] if rec.get("diverged") else []
        notes += [f"{k} failed: {e[:120]}" for k, e in rec.get("errors", {}).items()]
        notes += [] if rec.get("trained", True) else ["not trained"]
        notes += [f"cpu: {rec.get('cpu', '?')}"] if len(cpus_all) > 1 else []
        tm = rec.get("timing") or {}
        notes += [f"timed on a {tm['weights']}"] if tm.get("weights") == "fresh draw" and rec.get("trained", True) else []  # fmt: skip
        notes += [f"timed with {tm['busy_cores']:.1f} cores busy"] if (tm.get("busy_cores") or 0) >= 0.5 else []  # fmt: skip
        L.append(f"| {rec['run_dir']} | {_fmt(m.get('val_loss'))} | {_fmt(m.get('params'))} | {_fmt(m.get('tokens_per_s'))} | {rec['seconds']:.0f} | {_fmt(rec.get('load_average'))} | {'; '.join(notes)} |")  # fmt: skip
    L += ["", f"load: the machine's 1-minute load average when the run finished; timings taken under a load above its core count ({os.cpu_count() or 1} here) measure contention as much as the code."]  # fmt: skip
    if lab.plots:
        L += ["", "## Plots", ""]
        for p in lab.plots:
            path = draw(p, records, list(lab.variants), out)
            L += (
                [f"![{p.title}]({path.name})", ""]
                if path
                else [f"({p.title}: nothing to plot)", ""]
            )
    L += ["", "## Verdicts", "",
          "pass: the 95% interval lies on the claimed side (beyond the margin). fail: it lies on "
          "the other side. inconclusive: it straddles; the minimum detectable effect says how "
          "large an effect these seeds could have shown. no verdict: a model did not learn (the "
          "quality gate) or a number is missing. Intervals are paired over seeds when both sides "
          "share them (same initial draw and data order); with one seed they come from the "
          "run's own evaluation windows or timing repetitions and ignore seed-to-seed variation.",
          "", f"Rerun: `attnlab lab run {lab.name}{' --corpus ' + corpus if corpus else ''}{' --quick' if quick else ''}`; `attnlab lab report {out}` rewrites this page.", ""]  # fmt: skip
    path = out / "report.md"
    path.write_text("\n".join(L))
    return path
