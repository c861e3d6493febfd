"""The training loop: one update = `accumulate` micro-batches, clipped, stepped, scheduled.

A batch is a dict of tensors: the model's keyword inputs plus `labels` (-100 = ignored). The
loss of an update is the summed (label-smoothed) cross-entropy of its micro-batches divided by
the number of labels in the whole update (fairseq's normalisation, so accumulation gives the
same gradient as one big batch), plus the MoE auxiliary loss.

Exact resume: a checkpoint holds the weights, the optimizer and scheduler state, every RNG, the
batch stream's position and the loop's own counters (including the partly filled logging
window), saved at an update boundary. Restarting from it replays the same updates on the same
batches with the same dropout masks, so the logged loss curve continues bit for bit. Metrics
logged after the checkpoint by the interrupted process are dropped from metrics.jsonl on resume.

Under torch.distributed (a model wrapped in DistributedDataParallel, each rank with its shard of
the batches) the label count is summed over ranks, so W ranks make the update of one process
that sees all their micro-batches; only rank 0 writes metrics and checkpoints.

Non-finite loss or gradient norm stops training (`TrainingDiverged`) before the update is applied
and before anything is saved, so `last` stays the last good checkpoint.

Beside this file: the checkpoint format and RNG capture (src/attnlab/train/checkpoint.py), the
metrics log (src/attnlab/train/metrics.py), autocast and loss scaling
(src/attnlab/train/precision.py).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import distributed as dist

from ..decode.steps import evaluating
from ..errors import AttnlabError
from ..nn.inputs import check_ids, checked
from ..nn.positional.learned import PositionOutOfRangeError
from . import checkpoint as ckpt
from . import metrics
from .losses import smoothed_cross_entropy_sum, with_aux
from .precision import autocast, check_precision, grad_scaler
from .threads import resume_threads


class TrainingDiverged(AttnlabError, RuntimeError):
    """The loss or gradient norm became NaN/inf; `step` is the update that failed."""

    exit_status = 3

    def __init__(self, step: int, what: str, value: float, last_good: int | None, run_dir: Path):
        self.step = step
        kept = (
            f"the last good checkpoint (step {last_good}) is kept in {run_dir / 'last'}"
            if last_good is not None
            else "no checkpoint had been written yet"
        )
        super().__init__(
            f"{what} is {value} at step {step}: training stopped, {kept}. Try a lower learning "
            f"rate or a longer warm-up, gradient clipping (optimizer.clip_norm), bf16 instead of "
            f"fp16, or pre-norm (model.overrides.norm_placement=pre); then resume with --resume"
        )


class TrainingInterrupted(AttnlabError):
    """SIGINT (Ctrl-C) or SIGTERM during `fit`: the run stopped at an update boundary after
    saving `last` there (when it checkpoints), so re-running the same command resumes exactly."""

    exit_status = 130  # the shell's status for a process stopped by SIGINT

    def __init__(self, step: int, saved: Path | None, signame: str):
        self.step, self.saved = step, saved
        where = (
            f"saved a checkpoint of step {step} in {saved}: run the same command again to "
            f"continue exactly from there"
            if saved is not None
            else f"nothing was saved (this run writes no checkpoints); it stopped at step {step}"
        )
        super().__init__(f"interrupted ({signame}): {where}")


class _StopSignals:
    """While active, SIGINT and SIGTERM only set `received`: the loop finishes the update it is
    in, saves and stops. A second signal restores the default behaviour (a second Ctrl-C kills
    at once). Signal handlers exist only in the main thread; elsewhere this does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name
        for sig, old in self._old.items():  # the next one is not caught
            signal.signal(sig, old)

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


class BatchStream(Protocol):
    """An endless, resumable source of batches (dicts of tensors with `labels`)."""

    def __next__(self) -> dict[str, torch.Tensor]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Checkpointing:
    """What a checkpoint carries besides the training state."""

    model_config: Any  # attnlab.ModelConfig
    recipe: dict[str, Any] = field(default_factory=dict)
    extra_files: dict[str, bytes] = field(default_factory=dict)


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        batches: BatchStream | Iterator[dict[str, torch.Tensor]],
        run_dir: str | Path,
        steps: int,
        *,
        accumulate: int = 1,
        clip_norm: float | None = None,
        label_smoothing: float = 0.0,
        precision: str = "fp32",
        log_every: int = 10,
        eval_every: int | None = None,
        save_every: int | None = None,
        save_every_s: float | None = None,
        evaluate: Callable[[torch.nn.Module], dict[str, float]] | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        checkpointing: Checkpointing | None = None,
        progress: bool | None = None,
        device: torch.device | str | None = None,
        compile: bool = False,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.module = getattr(model, "module", model)  # the bare model under DDP: saved, evaluated
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.is_main = self.world == 1 or dist.get_rank() == 0  # writes metrics and checkpoints
        self.batches, self.run_dir, self.steps = batches, Path(run_dir), steps
        self.accumulate, self.clip_norm, self.smoothing = accumulate, clip_norm, label_smoothing
        self.precision, self.log_every, self.eval_every = precision, log_every, eval_every
        # checkpoints between evaluations: every `save_every` steps and/or once `save_every_s`
        # seconds have passed since the last save (both bound the work an interrupt loses)
        self.save_every, self.save_every_s = save_every, save_every_s
        self.evaluate, self.best_metric, self.best_mode = evaluate, best_metric, best_mode
        self.checkpointing, self.progress = checkpointing, progress
        self.device = (
            torch.device(device) if device is not None else next(model.parameters()).device
        )
        check_precision(precision, self.device)
        self.scaler = grad_scaler(precision)
        self.step = 0
        self.best: float | None = None
        self.last_saved: int | None = None
        self.window = {"loss": 0.0, "steps": 0, "tokens": 0, "grad_norm": 0.0}
        self.tokens_seen = 0
        # (step, loss, norm) of the first update that went bad; step inf: none (`_track`)
        self._bad = torch.full((3,), math.inf, device=self.device)
        # the training forward, compiled when asked (`compile`); evaluation runs the model
        self.compiled = torch.compile(model) if compile else None
        self.run_dir.mkdir(parents=True, exist_ok=True)

    # --- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        data = self.batches.state_dict() if hasattr(self.batches, "state_dict") else None
        return {
            "step": self.step,
            "best": self.best,
            "window": {k: float(v) if k != "steps" else v for k, v in self.window.items()},
            "tokens_seen": self.tokens_seen,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": ckpt.rng_state(),
            "threads": torch.get_num_threads(),  # the summation orders depend on it
            "data": data,
        }

    def resume(self, folder: str | Path | None = None, threads_asked_by: str | None = None) -> int:
        """Restore everything from a checkpoint (default: the run's `last`); returns its step.
        The run's own thread count is taken again (bit-exact), unless `threads_asked_by` names
        an explicit choice ("--threads 1"), which is kept (train/threads.py)."""
        folder = Path(folder) if folder is not None else ckpt.resolve(self.run_dir, "last")
        if folder is None:
            raise ckpt.CheckpointError(f"no checkpoint to resume from in {self.run_dir}")
        ckpt.verify(folder)
        ckpt.load_weights(folder, self.module)
        state = ckpt.load_state(folder)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("data") is not None:
            self.batches.load_state_dict(state["data"])
        self.step, self.best = state["step"], state["best"]
        self.window, self.tokens_seen = state["window"], state["tokens_seen"]
        self.last_saved = self.step
        resume_threads(state.get("threads"), threads_asked_by, self.is_main)
        ckpt.set_rng_state(state["rng"])
        if self.is_main:
            metrics.truncate(self.run_dir, self.step)
        return self.step

    def _save(self, improved: bool) -> None:
        if self.checkpointing is None:
            return
        self._check()  # never a checkpoint after an update that went bad
        module, optim = self.full_states()  # under FSDP2 a collective: every rank takes part
        if not self.is_main:
            self.last_saved = self.step
            return
        c = self.checkpointing
        state = self.state_dict()
        if optim is not None:
            state["optimizer"] = optim
        args = (module, c.model_config, c.recipe, state, c.extra_files)
        if improved:  # best first: a crash in between leaves `last` older, never ahead of best
            ckpt.save(self.run_dir, "best", *args)
            ckpt.copy(self.run_dir, "best", "last")
        else:
            ckpt.save(self.run_dir, "last", *args)
        self.last_saved = self.step

    def full_states(self) -> tuple[torch.nn.Module | None, dict[str, Any] | None]:
        """(model, optimizer state) to save. Under FSDP2 (every rank must call this) rank 0 gets
        an unsharded copy of the model and the full optimizer state keyed by parameter name
        (other ranks get None); otherwise (the model itself, None)."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.module, FSDPModule):
            return self.module, None
        from torch.distributed.checkpoint import state_dict as dcp

        options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = dcp.get_model_state_dict(self.module, options=options)
        optim = dcp.get_optimizer_state_dict(self.module, self.optimizer, options=options)
        if not self.is_main:
            return None, None
        from ..build import build_model

        copy = build_model(self.checkpointing.model_config)
        copy.load_state_dict(weights)
        return copy, optim

    def _log(self, record: dict[str, Any]) -> None:
        if self.is_main:
            metrics.append(self.run_dir, record)

    # --- one update ----------------------------------------------------------------------------

    def _micro_batches(self) -> list[tuple[dict[str, torch.Tensor], int, int]]:
        """The update's micro-batches on the device, each with its label and token counts,
        counted on the host before the copy (no device synchronisation)."""
        out = []
        for _ in range(self.accumulate):
            batch = next(self.batches)
            self._check_inputs(batch)
            labels = int((batch["labels"] != -100).sum())
            tokens = 0
            for ids, mask in (
                ("input_ids", "attention_mask"),
                ("decoder_input_ids", "decoder_attention_mask"),
            ):
                if ids in batch:
                    tokens += int(batch[mask].sum()) if mask in batch else batch[ids].numel()
            moved = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            out.append((moved, labels, tokens))
        return out

    def _check_inputs(self, batch: dict[str, torch.Tensor]) -> None:
        """The model's input checks that read values (ids in the vocabulary, lengths within a
        learned position table), done here on the host copy so that the forward passes, run
        under `inputs.checked()`, read nothing back from the device."""
        vocab = getattr(self.module, "vocab_size", 0)
        into = "encoder" if hasattr(self.module, "encoder") else "decoder"
        for name, stack in (("input_ids", into), ("decoder_input_ids", "decoder")):
            ids = batch.get(name)
            if ids is None:
                continue
            if vocab:
                check_ids(ids, vocab, name)
            limit = getattr(getattr(self.module, stack, None), "positional", None)
            limit = getattr(limit, "max_positions", None)
            if limit is not None and ids.shape[1] > limit:
                raise PositionOutOfRangeError(
                    f"{name} holds {ids.shape[1]} tokens per row, beyond the {stack}'s learned "
                    f"position table of {limit}: shorten data.context (or the batcher's "
                    f"sequences) to {limit}, or use a scheme that extrapolates (rope, alibi)"
                )

    def _update(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One optimizer step; returns (loss per label, gradient norm) as device tensors, read
        only when logged (no host synchronisation per step on one process), and the tokens."""
        micro = self._micro_batches()
        n_labels = sum(n for _, n, _ in micro)
        tokens = sum(t for _, _, t in micro)
        if self.world > 1:  # the update's labels on all ranks: the loss of one global batch
            count = torch.tensor([n_labels], dtype=torch.long, device=self.device)
            dist.all_reduce(count)
            n_labels = int(count)
        if n_labels == 0:
            raise ValueError("an update with no labels (every label is -100): check the batcher")
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        forward = self.compiled if self.compiled is not None else self.model
        for i, (batch, _, _) in enumerate(micro):
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            # DDP: gradients are all-reduced (averaged) on the last micro-batch only
            last = i == len(micro) - 1
            sync = self.model.no_sync() if not last and hasattr(self.model, "no_sync") else None
            with sync or nullcontext():
                with autocast(self.device, self.precision), checked():  # _check_inputs did
                    out = forward(**inputs)
                loss_sum, n = smoothed_cross_entropy_sum(
                    out.logits, batch["labels"], self.smoothing
                )
                loss = with_aux(loss_sum, n, out.aux_loss) / n_labels
                # several ranks: a rank that stopped here would leave the others waiting in the
                # gradient all-reduce; the NaN travels with the reduced loss (checked below) and
                # gradients instead, so every rank stops at the same update. One process: the
                # loss is checked when it is read (_check, at logs and saves)
                scaled = loss * self.world  # DDP averages over ranks: undo it to sum
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            total = total + loss.detach().float()
        if self.world > 1:  # the global loss and tokens, for the log
            sums = torch.stack((total.double(), torch.tensor(float(tokens), dtype=torch.float64,
                                device=self.device)))  # fmt: skip
            dist.all_reduce(sums)
            total, tokens = sums[0].float(), int(sums[1])
            if not math.isfinite(float(total)):  # the same value on every rank: all stop together
                raise TrainingDiverged(
                    self.step + 1, "the loss", float(total), self.last_saved, self.run_dir
                )
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.clip_norm if self.clip_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2
        if self.world > 1 and self.scaler is None and not math.isfinite(float(norm)):
            raise TrainingDiverged(
                self.step + 1, "the gradient norm", float(norm), self.last_saved, self.run_dir
            )
        self._track(total, norm)
        if self.scaler is not None:  # fp16: an overflowing step is skipped and the scale lowered
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        return total, norm.detach().float(), tokens

    def _track(self, loss: torch.Tensor, norm: torch.Tensor) -> None:
        """Remember, on the device, the first update whose loss (or, without fp16's scaler,
        whose gradient norm) is not finite: read by `_check` before anything is logged or saved."""
        ok = torch.isfinite(loss)
        if self.scaler is None:  # fp16 skips overflowing steps itself
            ok = ok & torch.isfinite(norm)
        step = torch.tensor(float(self.step + 1), device=self.device)
        first = ~ok & torch.isinf(self._bad[0])
        values = torch.stack((step, loss.float(), norm.detach().float()))
        self._bad = torch.where(first, values, self._bad)

    def _check(self) -> None:
        """TrainingDiverged naming the first update that went bad, if one did (one read)."""
        step, loss, norm = self._bad.tolist()
        if math.isfinite(step):
            what, value = (
                ("the loss", loss) if not math.isfinite(loss) else ("the gradient norm", norm)
            )
            raise TrainingDiverged(int(step), what, value, self.last_saved, self.run_dir)

    # --- the loop ------------------------------------------------------------------------------

    def _run_eval(self) -> dict[str, float]:
        if self.evaluate is None:
            return {}
        self._check()
        with evaluating(self.model), torch.no_grad(), autocast(self.device, self.precision):
            results = self.evaluate(self.module)
        self._log({"step": self.step, "split": "eval", **results})
        return results

    def _improved(self, results: dict[str, float]) -> bool:
        if self.best_metric is None or self.best_metric not in results:
            return False
        value = results[self.best_metric]
        better = self.best is None or (
            value < self.best if self.best_mode == "min" else value > self.best
        )
        if better:
            self.best = value
        return better

    def _stop_requested(self, stop: _StopSignals) -> bool:
        """Whether any rank received a stop signal (ranks agree, so all save and stop at the
        same update; one scalar all-reduce per update under DDP/FSDP)."""
        flag = stop.received is not None
        if self.world > 1:
            t = torch.tensor([float(flag)], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
        return flag

    def _interrupt(self, stop: _StopSignals) -> None:
        """Save `last` at this update boundary (unless it is already saved) and stop."""
        if self.checkpointing is not None and self.last_saved != self.step:
            self._save(improved=False)
        saved = self.run_dir / "last" if self.checkpointing is not None else None
        raise TrainingInterrupted(self.step, saved, stop.received or "a signal on another rank")

    def fit(self) -> dict[str, Any]:
        """Train from the current step to `steps`; returns the last logged and eval metrics.
        SIGINT / SIGTERM stop it at the next update boundary, after saving `last` there
        (`TrainingInterrupted`)."""
        from tqdm.auto import tqdm

        self.model.train()
        bar = tqdm(  # progress None: a bar on a terminal, plain log lines otherwise
            total=self.steps,
            initial=self.step,
            disable=not self.is_main or (None if self.progress is None else not self.progress),
            unit="step",
            dynamic_ncols=True,
        )
        t0 = saved_at = time.perf_counter()
        last: dict[str, Any] = {}
        evals: dict[str, float] = {}
        stop = _StopSignals()
        try:
            with stop:
                while self.step < self.steps:
                    if self._stop_requested(stop):
                        self._interrupt(stop)
                    loss, norm, tokens = self._update()
                    self.step += 1
                    self.tokens_seen += tokens
                    w = self.window
                    w["loss"] += loss
                    w["steps"] += 1
                    w["tokens"] += tokens
                    w["grad_norm"] += norm
                    if self.step % self.log_every == 0 or self.step == self.steps:
                        self._check()  # the one read of the device's losses per log
                        elapsed = time.perf_counter() - t0
                        last = {
                            "step": self.step,
                            "split": "train",
                            "loss": float(w["loss"]) / w["steps"],
                            "lr": self.scheduler.get_last_lr()[0],
                            "grad_norm": float(w["grad_norm"]) / w["steps"],
                            "tokens_per_s": w["tokens"] / elapsed if elapsed > 0 else 0.0,
                            "tokens": self.tokens_seen,
                        }
                        self._log(last)
                        if bar.disable and self.progress is None and self.is_main:  # plain lines
                            eta = (self.steps - self.step) * elapsed / w["steps"]
                            print(metrics.progress_line(last, self.steps, eta), flush=True)
                        bar.set_postfix(
                            loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_s']:.0f}"
                        )
                        self.window = {"loss": 0.0, "steps": 0, "tokens": 0, "grad_norm": 0.0}
                        t0 = time.perf_counter()
                    bar.update(1)
                    paused = time.perf_counter()
                    due = self.eval_every is not None and self.step % self.eval_every == 0
                    if due or self.step == self.steps:
                        evals = self._run_eval()
                        if evals and self.is_main:
                            bar.write(
                                f"step {self.step}: "
                                + ", ".join(f"{k} {v:.4g}" for k, v in evals.items())
                            )
                        self._save(self._improved(evals))
                    elif self._save_due(paused - saved_at):
                        self._save(improved=False)
                    if self.last_saved == self.step:
                        saved_at = time.perf_counter()
                    t0 += time.perf_counter() - paused  # throughput counts training time only
        finally:
            bar.close()
        return {"train": last, "eval": evals, "step": self.step, "best": self.best}

    def _save_due(self, since_save_s: float) -> bool:
        """A periodic checkpoint between evaluations. The time rule is decided on rank 0 and
        shared, so every rank takes part in the same saves."""
        due = self.save_every is not None and self.step % self.save_every == 0
        timed = self.save_every_s is not None and since_save_s >= self.save_every_s
        if self.world > 1 and self.save_every_s is not None:
            t = torch.tensor([float(timed)], device=self.device)
            dist.broadcast(t, src=0)
            timed = bool(t.item())
        return due or timed
