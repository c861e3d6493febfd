"""What every task shares: the `Task` it hands the run, the `TASKS` registry, `prepare`, and the
batch helpers of the token-budget tasks.

A task module (src/attnlab/train/tasks/translation.py, lm.py, classification.py) registers one
function `build(recipe, data_dir, tokenizer, train, rank, world_size) -> Task` under the recipe's
`data.kind`; `prepare` looks that kind up. Given a tokenizer (the one saved in a checkpoint), a
task trains no tokenizer and reads no training data unless `train=True`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ... import data as D
from ...registry import Registry
from ..losses import smoothed_cross_entropy_sum
from ..recipes import Recipe


@dataclass
class Task:
    recipe: Recipe
    tokenizer: Any  # tokenizers.Tokenizer
    model_sizes: dict[str, Any]  # vocab_size, pad_token_id, num_labels: merged into ModelConfig
    train: Any = None  # the batch stream (None when only evaluating)
    validate: Callable[[torch.nn.Module], dict[str, float]] | None = None
    test: Callable[[torch.nn.Module], dict[str, float]] | None = None
    best_metric: str = "val_loss"
    best_mode: str = "min"
    show: Callable[[torch.nn.Module, list[str]], list[str]] | None = None  # samples -> outputs
    info: dict[str, Any] = field(default_factory=dict)


class TaskBuilder(Protocol):
    """A task module's `build`: `tokenizer` None trains one on the training split."""

    def __call__(
        self,
        recipe: Recipe,
        data_dir: str | Path | None,
        tokenizer: Any,
        train: bool,
        rank: int,
        world_size: int,
    ) -> Task: ...


TASKS: Registry[TaskBuilder] = Registry("task")


def prepare(
    recipe: Recipe,
    data_dir: str | Path | None = None,
    tokenizer: Any = None,
    train: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> Task:
    """The task of `recipe.data.kind`: its batches, model sizes, tokenizer and evaluation."""
    build = TASKS.get(recipe.data.kind)
    return build(recipe, data_dir, tokenizer, train, rank, world_size)


class IndexBatches:
    """An endless stream of collated batches over a TokenBudgetBatcher's epochs (resumable)."""

    def __init__(self, batcher: D.TokenBudgetBatcher, collate: Callable[[list[int]], dict]):
        self.batcher, self.collate, self._it = batcher, collate, None

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            self._it = iter(self.batcher)
        try:
            idx = next(self._it)
        except StopIteration:  # epoch done: the batcher moved to the next one
            self._it = iter(self.batcher)
            idx = next(self._it)
        return self.collate(idx)

    def state_dict(self) -> dict[str, Any]:
        return self.batcher.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batcher.load_state_dict(state)
        self._it = None


def fixed_batches(
    batcher: D.TokenBudgetBatcher, collate: Callable[[list[int]], dict], limit: int | None
) -> list[dict]:
    """The first epoch's batches of an unshuffled batcher, at most `limit` (evaluation sets)."""
    out = [collate(idx) for idx in batcher.global_batches(0)]
    return out[:limit] if limit is not None else out


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches) -> float:
    """Mean cross-entropy per label (no smoothing) over batches."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        loss, n = smoothed_cross_entropy_sum(model(**batch).logits, labels)
        total, count = total + float(loss), count + int(n)
    return total / max(count, 1)
