"""A training run from a recipe: data, model, optimizer, schedule, Trainer, final evaluation.

    RUN_DIR/
      recipe.yaml     the recipe as run (with --set overrides applied)
      metrics.jsonl   one JSON object per line: train (step, loss, lr, grad_norm, tokens_per_s),
                      eval (val_loss, ...), test (BLEU / accuracy) records
      last/ best/     checkpoints (train/checkpoint.py)
      results.json    final metrics and samples

A run directory that holds a checkpoint is resumed: same recipe (only `steps` may change),
the tokenizer saved in the checkpoint, and the exact training state.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from ..build import build_model, count_parameters
from . import checkpoint as ckpt
from .loop import METRICS, Checkpointing, Trainer
from .recipes import Recipe, model_config
from .schedules import constant, cosine, lambda_lr, noam
from .tasks import Task, prepare

TOKENIZER = "tokenizer.json"


def build_optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    """Adam or AdamW; weight decay on matrices and embeddings only (nanoGPT, GPT-2), never on
    biases and norm gains."""
    spec = recipe.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    cls = torch.optim.AdamW if spec.kind == "adamw" else torch.optim.Adam
    return cls(groups, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, recipe: Recipe, d_model: int):
    s = recipe.schedule
    if s.kind == "noam":
        fn = noam(d_model, s.warmup)  # optimizer.lr is the factor (1.0: the paper's rate)
    elif s.kind == "cosine":
        fn = cosine(s.warmup, recipe.steps, s.min_ratio)
    else:
        fn = constant(s.warmup)
    return lambda_lr(optimizer, fn)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _load_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / TOKENIZER))


def _recipe_differences(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _recipe_differences(a, b, f"{prefix}{key}.")
        elif a != b and f"{prefix}{key}" != "steps":
            out.append(f"{prefix}{key}: {a!r} in the run, {b!r} now")
    return out


def checkpoint_recipe(run_dir: str | Path, name: str = "last") -> Recipe | None:
    folder = ckpt.resolve(run_dir, name)
    return Recipe.from_dict(ckpt.load_recipe(folder)) if folder is not None else None


def train(
    recipe: Recipe,
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    device: str | torch.device | None = None,
    progress: bool | None = None,
    stop_at: int | None = None,
    final_eval: bool = True,
) -> dict[str, Any]:
    """Train (or resume) a recipe into run_dir; returns the final metrics. `stop_at` ends the
    run early at that step (for tests: the state is as if the process had been killed there)."""
    run_dir = Path(run_dir)
    device = torch.device(device) if device is not None else default_device()
    folder = ckpt.resolve(run_dir, "last")
    tok = None
    if folder is not None:
        ckpt.verify(folder)
        diff = _recipe_differences(ckpt.load_recipe(folder), recipe.to_dict())
        if diff:
            raise ValueError(
                f"{run_dir} holds a run of another recipe, so it cannot be resumed exactly:\n  "
                + "\n  ".join(diff)
                + "\nchoose another --run-dir, or delete that one to start afresh"
            )
        tok = _load_tokenizer(folder)
    torch.manual_seed(recipe.seed)
    task: Task = prepare(recipe, data_dir, tok, train=True)
    cfg = model_config(recipe.model, **task.model_sizes)
    model = build_model(cfg).to(device)
    optimizer = build_optimizer(model, recipe)
    scheduler = build_scheduler(optimizer, recipe, cfg.d_model)
    trainer = Trainer(
        model,
        optimizer,
        scheduler,
        task.train,
        run_dir,
        steps=recipe.steps if stop_at is None else min(stop_at, recipe.steps),
        accumulate=recipe.batch.accumulate,
        clip_norm=recipe.optimizer.clip_norm,
        label_smoothing=recipe.optimizer.label_smoothing,
        precision=recipe.precision,
        log_every=recipe.log_every,
        eval_every=recipe.eval.every,
        evaluate=task.validate,
        best_metric=task.best_metric,
        best_mode=task.best_mode,
        checkpointing=Checkpointing(
            cfg, recipe.to_dict(), {TOKENIZER: task.tokenizer.to_str().encode()}
        ),
        progress=progress,
        device=device,
    )
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    if folder is not None:
        step = trainer.resume(folder)
        print(f"resumed {run_dir} at step {step} of {recipe.steps}")
    else:
        print(
            f"{recipe.name}: {count_parameters(cfg):,} parameters, {recipe.steps} steps on {device}"
            + "".join(f"; {k}: {v}" for k, v in task.info.items())
        )
    t0 = time.perf_counter()
    result = trainer.fit()
    result["train_seconds"] = time.perf_counter() - t0
    if (stop_at is not None and stop_at < recipe.steps) or not final_eval:
        return result
    result.update(finish(task, model, run_dir, device))
    (run_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def finish(task: Task, model: torch.nn.Module, run_dir: Path, device) -> dict[str, Any]:
    """Test metrics and samples from the best checkpoint (or the model as it is, without one)."""
    best = ckpt.resolve(run_dir, "best")
    if best is not None:
        ckpt.load_weights(best, model)
    model.eval()
    out: dict[str, Any] = {"evaluated": str(best) if best is not None else "final weights"}
    if task.test is not None:
        t0 = time.perf_counter()
        with torch.no_grad():
            out["test"] = task.test(model)
        out["test_seconds"] = time.perf_counter() - t0
        print("test: " + ", ".join(f"{k} {v:.4g}" for k, v in out["test"].items()))
    samples = task.recipe.eval.samples
    if samples and task.show is not None:
        out["samples"] = dict(zip(samples, task.show(model, list(samples)), strict=True))
        for src, hyp in out["samples"].items():
            print(f"  {src!r}\n    -> {hyp!r}")
    if "test" in out:
        src = best or ckpt.resolve(run_dir, "last")
        step = ckpt.verify(src)["step"] if src is not None else None
        with open(run_dir / METRICS, "a") as f:
            f.write(json.dumps({"step": step, "split": "test", **out["test"]}) + "\n")
    return out
