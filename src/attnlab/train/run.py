"""A training run from a recipe: data, model, optimizer, schedule, Trainer, final evaluation.

    RUN_DIR/
      recipe.yaml     the recipe as run (with --set overrides applied)
      metrics.jsonl   one JSON object per line: train (step, loss, lr, grad_norm, tokens_per_s),
                      eval (val_loss, ...), test (BLEU / accuracy) records
                      (src/attnlab/train/metrics.py)
      last/ best/     checkpoints (src/attnlab/train/checkpoint.py)
      results.json    final metrics and samples

A run directory that holds a checkpoint is resumed: same recipe (only `steps` may change),
the tokenizer saved in the checkpoint, and the exact training state. A run that already finished
its steps is left as it is (the same command again says so and exits at once); asking for fewer
steps than the run has done is refused. One trainer at a time: the run directory is locked
while it trains (src/attnlab/train/lock.py).

Launched by torchrun (WORLD_SIZE > 1), `attnlab train` joins the process group (gloo on CPU,
nccl on CUDA with one device per LOCAL_RANK), wraps the model in DistributedDataParallel, and
gives each rank its shard of the batches; only rank 0 prints and writes the run directory:

    torchrun --nproc_per_node 2 -m attnlab train RECIPE --run-dir RUN_DIR
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from ..build import build_model, count_parameters
from ..errors import problem_list
from . import checkpoint as ckpt
from . import metrics
from .lock import RunLock
from .loop import Checkpointing, Trainer
from .recipes import Recipe, model_config
from .schedules import SCHEDULES, lambda_lr
from .tasks import Task, prepare
from .threads import busy_cores_warning, choose

TOKENIZER = "tokenizer.json"


def build_optimizer(
    model: torch.nn.Module, recipe: Recipe, fused: bool = False
) -> torch.optim.Optimizer:
    """Adam or AdamW; weight decay on matrices and embeddings only (nanoGPT, GPT-2), never on
    biases and norm gains. `fused`: torch's one-kernel update (CUDA), the same arithmetic."""
    spec = recipe.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    cls = torch.optim.AdamW if spec.kind == "adamw" else torch.optim.Adam
    extra = {"fused": True} if fused else {}
    return cls(groups, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, **extra)


def build_scheduler(optimizer: torch.optim.Optimizer, recipe: Recipe, d_model: int):
    """The recipe's schedule (SCHEDULES in schedules.py) as a LambdaLR; noam's rate multiplies
    optimizer.lr (1.0 and factor 1.0: the paper's rate)."""
    s = recipe.schedule
    fn = SCHEDULES.build(s.kind, s.model_dump(), {"d_model": d_model, "total": recipe.steps})
    return lambda_lr(optimizer, fn)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def init_distributed(device: torch.device | None) -> tuple[int, int, torch.device | None]:
    """(rank, world_size, device): joins the torchrun process group when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, device
    from torch import distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = default_device()
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def load_tokenizer(folder: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / TOKENIZER))


# what a resume may change: how long to train and how often to save, not what is trained
RESUMABLE = ("steps", "checkpoint")


def _recipe_differences(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if f"{prefix}{key}" in RESUMABLE:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += _recipe_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} in the run, {b!r} now")
    return out


def _check_model_keys(recipe: Recipe, saved: Any) -> None:
    """Validate the recipe's model overrides against the model config schema (on the run's own
    config), so a misspelt `--set model.overrides.KEY` is reported as such, with a did-you-mean,
    rather than as a difference from the run."""
    from ..config import ModelConfig, merge_dicts

    if recipe.model.overrides:
        ModelConfig.from_dict(merge_dicts(saved.to_dict(), dict(recipe.model.overrides)))


def checkpoint_recipe(run_dir: str | Path, name: str = "last") -> Recipe | None:
    folder = ckpt.resolve(run_dir, name)
    return Recipe.from_dict(ckpt.load_recipe(folder)) if folder is not None else None


def init_from(model: torch.nn.Module, run_dir: str | Path) -> None:
    """Load another run's weights (best, else last checkpoint) into `model`; a model with fewer
    K/V heads gets them mean-pooled (src/attnlab/surgery.py, Ainslie et al. 2023)."""
    src = ckpt.best_or_last(run_dir)
    if src is None:
        raise ValueError(f"model.init_from: no checkpoint in {run_dir}: train that run first")
    source, cfg = ckpt.load(src)
    if cfg.kv_heads != model.config.kv_heads:
        from ..surgery import to_gqa

        source = to_gqa(source, model.config.kv_heads)
    try:
        model.load_state_dict(source.state_dict())
    except RuntimeError as err:
        raise ValueError(
            f"model.init_from {run_dir}: its weights do not fit this architecture (only "
            f"n_kv_heads and non-parameter settings such as RoPE scaling may differ): {err}"
        ) from None


def deterministic(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` with torch's deterministic algorithms on (an op without one warns instead of
    failing), then restore the setting: with the same thread count (recorded in every
    checkpoint and restored on resume, train/loop.py) two runs, and a run and its resume, give
    the same bits. Without it, two 2-thread CPU runs already differed (losses by 5e-7)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        was = torch.are_deterministic_algorithms_enabled()
        warn = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.use_deterministic_algorithms(was, warn_only=warn)

    return run


@deterministic
def train(
    recipe: Recipe,
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    device: str | torch.device | None = None,
    progress: bool | None = None,
    stop_at: int | None = None,
    final_eval: bool = True,
    fsdp: bool = False,
    threads: int | None = None,
) -> dict[str, Any]:
    """Train (or resume) a recipe into run_dir; returns the final metrics. `stop_at` ends the
    run early at that step (for tests: the state is as if the process had been killed there).
    `fsdp`: under torchrun, shard the model with FSDP2 `fully_shard` instead of DDP (a fresh run
    only: its checkpoints hold full weights, and the optimizer state keyed by parameter name).
    `threads`: torch's intra-op threads; given (or OMP_NUM_THREADS set) it also holds on resume,
    else a resume takes the run's own count again (train/threads.py). The run directory is
    locked for the time of the call: a second trainer on it raises RunLocked."""
    run_dir = Path(run_dir)
    asked_by = choose(threads)
    rank, world, device = init_distributed(torch.device(device) if device is not None else None)
    device = device if device is not None else default_device()
    main = rank == 0
    with RunLock(run_dir) if main else contextlib.nullcontext():
        args = (recipe, run_dir, data_dir, device, progress, stop_at, final_eval, fsdp, asked_by)
        return _train(*args, rank, world)


def _train(
    recipe: Recipe,
    run_dir: Path,
    data_dir: str | Path | None,
    device: torch.device,
    progress: bool | None,
    stop_at: int | None,
    final_eval: bool,
    fsdp: bool,
    asked_by: str | None,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """`train` with the run directory locked."""
    main = rank == 0
    folder = ckpt.resolve(run_dir, "last")
    tok = None
    if folder is not None and fsdp and world > 1:
        raise ValueError(f"{run_dir}: resuming with --fsdp is not supported; resume with DDP")
    if folder is not None:
        ckpt.verify(folder)
        diff = _recipe_differences(ckpt.load_recipe(folder), recipe.to_dict())
        if any(line.startswith("model.") for line in diff):
            _check_model_keys(recipe, ckpt.load_config(folder))  # a typo first, with a fix
        if diff:
            title = f"resume of {run_dir}, which holds a run of another recipe"
            raise ValueError(
                problem_list(title, diff) + "\nit cannot be resumed exactly: choose another "
                "--run-dir, or delete that one to start afresh (only `steps` and `checkpoint` may "
                "change)"
            )
        done = _already_done(run_dir, folder, recipe, main)
        if done is not None:
            return done
        tok = load_tokenizer(folder)
    torch.manual_seed(recipe.seed)
    if world > 1 and not main:
        torch.distributed.barrier()  # rank 0 first: it writes the tokenizer cache the rest read
    task: Task = prepare(recipe, data_dir, tok, train=True, rank=rank, world_size=world)
    if world > 1 and main:
        torch.distributed.barrier()
    # a resumed run is rebuilt from its own checkpoint's config (a pretrained source may have
    # moved or changed since); a fresh one from the recipe and the data
    cfg = (
        ckpt.load_config(folder)
        if folder is not None
        else model_config(recipe.model, **task.model_sizes)
    )
    model = build_model(cfg)
    if recipe.model.pretrained is not None and folder is None:  # a fresh fine-tuning run
        from ..interop import load_pretrained_weights

        new = load_pretrained_weights(model, recipe.model.pretrained)
        if main:
            print(
                f"weights from {recipe.model.pretrained}"
                + (f"; initialised: {', '.join(new)}" if new else "")
            )
    if recipe.model.init_from is not None and folder is None:  # a fresh run from trained weights
        init_from(model, recipe.model.init_from)
    model = model.to(device)
    wrapped = model
    if world > 1 and fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)  # in place: parameters become shards (DTensors); before the optimizer
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids)
    # CUDA: the fused AdamW kernel (one launch for every parameter instead of a loop of them)
    optimizer = build_optimizer(model, recipe, fused=device.type == "cuda" and not fsdp)
    scheduler = build_scheduler(optimizer, recipe, cfg.d_model)
    trainer = Trainer(
        wrapped,
        optimizer,
        scheduler,
        task.train,
        run_dir,
        steps=recipe.steps if stop_at is None else min(stop_at, recipe.steps),
        accumulate=recipe.batch.accumulate,
        clip_norm=recipe.optimizer.clip_norm,
        label_smoothing=recipe.optimizer.label_smoothing,
        precision=recipe.precision,
        compile=recipe.compile,
        log_every=recipe.log_every,
        eval_every=recipe.eval.every,
        save_every=recipe.checkpoint.every,
        save_every_s=None if recipe.checkpoint.minutes is None else 60 * recipe.checkpoint.minutes,
        evaluate=task.validate,
        best_metric=task.best_metric,
        best_mode=task.best_mode,
        checkpointing=Checkpointing(
            cfg, recipe.to_dict(), {TOKENIZER: task.tokenizer.to_str().encode()}
        ),
        progress=progress if main else False,
        device=device,
    )
    if folder is not None:
        # a resume that fails leaves the run directory as it was
        step = trainer.resume(folder, threads_asked_by=asked_by)
        if main:
            print(f"resumed {run_dir} at step {step} of {recipe.steps}")
    elif main:  # a fresh start: records of a run killed before its first checkpoint go
        metrics.truncate(run_dir, 0)
        print(
            f"{recipe.name}: {count_parameters(cfg):,} parameters, {recipe.steps} steps on {device}"
            + "".join(f"; {k}: {v}" for k, v in task.info.items())
        )
    if main:
        (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    if main and recipe.schedule.warmup >= recipe.steps:
        print(
            f"warning: schedule.warmup ({recipe.schedule.warmup}) >= steps ({recipe.steps}): the "
            f"learning rate never leaves its warm-up; lower schedule.warmup (e.g. --set "
            f"schedule.warmup={max(recipe.steps // 10, 1)}) or train longer",
            file=sys.stderr,
        )
    busy = busy_cores_warning() if main and device.type == "cpu" else None
    if busy:
        print(busy, file=sys.stderr)
    t0 = time.perf_counter()
    result = trainer.fit()
    result["train_seconds"] = time.perf_counter() - t0
    if fsdp and world > 1:  # rank 0 evaluates an unsharded copy (a collective to gather it)
        model = trainer.full_states()[0]
        model = model.to(device) if model is not None else model
    if (stop_at is not None and stop_at < recipe.steps) or not final_eval or not main:
        return result
    result.update(finish(task, model, run_dir, device))
    (run_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _already_done(
    run_dir: Path, folder: Path, recipe: Recipe, speak: bool
) -> dict[str, Any] | None:
    """The results of a run that has already done what is asked, None if there is training (or
    its final test) left. A run at its last step that wrote results.json is finished: it is not
    tested again. Fewer steps than the run has done cannot be honoured: ValueError with the fix."""
    step = ckpt.verify(folder)["step"]
    if step is None or step < recipe.steps:
        return None
    if step > recipe.steps:
        raise ValueError(
            f"{run_dir} is already at step {step}, past the steps asked for ({recipe.steps}): "
            f"nothing to train. To train longer, raise steps above {step} (--set steps=N); to "
            f"train {recipe.steps} steps afresh, choose another run folder (--run-dir) or "
            f"delete {run_dir}"
        )
    try:
        results = json.loads((run_dir / "results.json").read_text())
    except (OSError, ValueError):
        return None  # stopped before its final test: the resume runs it
    if not isinstance(results, dict) or results.get("step") != step:
        return None
    if speak:
        print(
            f"{run_dir} already finished its {step} steps (results in {run_dir / 'results.json'}): "
            f"nothing to do. To train longer, raise steps (--set steps=N with N > {step}); to "
            f"evaluate it again, attnlab eval {run_dir}"
        )
    return results


def sample_lines(source: str, output: str) -> str:
    """A sample as text, its line breaks kept: the source indented by 2, the output after an
    arrow, each further line of it under the first ("ROMEO:" -> a 300-character scene)."""
    first, *rest = output.split("\n")
    return "\n".join(
        [f"  {source}", f"    -> {first}", *(f"       {line}".rstrip() for line in rest)]
    )


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
            print(sample_lines(src, hyp))
    if "test" in out:
        src = ckpt.best_or_last(run_dir)
        step = ckpt.verify(src)["step"] if src is not None else None
        metrics.append(run_dir, {"step": step, "split": "test", **out["test"]})
    return out
