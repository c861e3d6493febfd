"""`attnlab plot RUN_DIR`: loss, learning rate and throughput curves from metrics.jsonl to PNG."""

from __future__ import annotations

from pathlib import Path

from . import metrics


def plot(run_dir: str | Path, output: str | Path | None = None) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("attnlab plot needs matplotlib: pip install 'attnlab[plot]'") from None
    records = metrics.read(run_dir)
    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in train]
    ax = axes[0]
    ax.plot(steps, [r["loss"] for r in train], label="train loss", lw=1)
    for key in sorted({k for r in evals for k in r if k.endswith("loss")}):
        pts = [(r["step"], r[key]) for r in evals if key in r]
        ax.plot(*zip(*pts, strict=True), "o-", label=key, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.legend()
    ax.grid(alpha=0.3)
    for ax, key, label in (
        (axes[1], "lr", "learning rate"),
        (axes[2], "tokens_per_s", "tokens / s"),
    ):
        ax.plot(steps, [r[key] for r in train], lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(output) if output is not None else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
