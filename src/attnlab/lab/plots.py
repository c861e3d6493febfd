"""The figures of a lab report (matplotlib, PNG), from results.jsonl records. Values are means
over seeds; error bars span the seeds' minimum and maximum when there are several.

    lines     metric template with {x} over x values, one line per variant (loss vs length)
    bars      one bar per variant
    scatter   x_metric vs metric, one point per variant (loss vs parameters)
    curves    a list metric (a per-position loss curve), one line per variant
    training  validation loss vs step from each variant's first seed's metrics.jsonl
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .spec import Plot


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("the lab's plots need matplotlib: pip install 'attnlab[plot]'") from None
    return plt


def file_name(p: Plot) -> str:
    return p.file or re.sub(r"[^a-z0-9]+", "-", p.title.lower()).strip("-") + ".png"


def _values(records: list[dict], variant: str, metric: str) -> list[float]:
    return [
        float(r["metrics"][metric])
        for r in records
        if r["variant"] == variant and isinstance(r["metrics"].get(metric), (int, float))
    ]


def _err(xs: list[float]) -> tuple[float, float, float]:
    m = sum(xs) / len(xs)
    return m, m - min(xs), max(xs) - m


def draw(p: Plot, records: list[dict[str, Any]], variants: list[str], out: Path) -> Path | None:
    """Draw one plot into out/; None when there is nothing to draw."""
    plt = _plt()
    names = p.variants or variants
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    if p.kind == "lines":
        for v in names:
            pts = [(x, _values(records, v, p.metric.format(x=x))) for x in p.x]
            pts = [(x, _err(ys)) for x, ys in pts if ys]
            if pts:
                xs = [x for x, _ in pts]
                ax.errorbar(xs, [e[0] for _, e in pts], yerr=[[e[1] for _, e in pts], [e[2] for _, e in pts]], marker="o", capsize=3, label=v)  # fmt: skip
                drawn = True
    elif p.kind == "bars":
        pts = [(v, _values(records, v, p.metric)) for v in names]
        pts = [(v, _err(ys)) for v, ys in pts if ys]
        if pts:
            ax.bar([v for v, _ in pts], [e[0] for _, e in pts], yerr=[[e[1] for _, e in pts], [e[2] for _, e in pts]], capsize=3)  # fmt: skip
            ax.tick_params(axis="x", labelrotation=30)
            drawn = True
    elif p.kind == "scatter":
        for v in names:
            xs, ys = _values(records, v, p.x_metric or ""), _values(records, v, p.metric)
            if xs and ys:
                ax.errorbar([_err(xs)[0]], [_err(ys)[0]], yerr=[[_err(ys)[1]], [_err(ys)[2]]], marker="o", capsize=3, label=v)  # fmt: skip
                drawn = True
    elif p.kind == "curves":
        for v in names:
            curves = [r["metrics"][p.metric] for r in records if r["variant"] == v and isinstance(r["metrics"].get(p.metric), list)]  # fmt: skip
            if curves:
                n = min(len(c) for c in curves)
                mean = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
                ax.plot([(i + 0.5) / n for i in range(n)], mean, label=v)
                drawn = True
    elif p.kind == "training":
        from ..train import metrics as M

        for v in names:
            runs = [r for r in records if r["variant"] == v]
            if not runs:
                continue
            try:
                recs = M.read(out / runs[0]["run_dir"])
            except FileNotFoundError:
                continue
            pts = [(r["step"], r.get(p.metric, r.get("loss"))) for r in recs if r.get("split") == ("eval" if p.metric != "loss" else "train")]  # fmt: skip
            pts = [(s, y) for s, y in pts if isinstance(y, (int, float))]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=v)
                drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_title(p.title)
    ax.set_xlabel(p.xlabel)
    ax.set_ylabel(p.ylabel or p.metric.replace("{x}", "·"))
    if p.logx:
        ax.set_xscale("log")
    numeric = all(isinstance(x, (int, float)) for x in p.x)  # not method names (categories)
    if (
        p.kind == "lines" and numeric
    ):  # label exactly the evaluated x values (a log axis would pick others)
        from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

        ax.xaxis.set_major_locator(FixedLocator([float(x) for x in p.x]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
    if p.logy:
        ax.set_yscale("log")
    if p.kind != "bars":
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / file_name(p)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
