"""Learning-rate schedules as LambdaLR multipliers of the optimizer's base rate.

    noam      factor · d_model^-0.5 · min(s^-0.5, s · warmup^-1.5)
              Vaswani et al. 2017, arXiv:1706.03762, section 5.3, eq. 3 (with base lr 1 and
              factor 1 this is the paper's rate; The Annotated Transformer uses the same form)
    cosine    linear warm-up to 1 over `warmup` updates, then a half cosine down to `min_ratio`
              at `total` updates (Loshchilov & Hutter 2017, arXiv:1608.03983, without restarts;
              nanoGPT's `get_lr`)
    constant  linear warm-up to 1, then 1

`s` is the 1-based number of the update about to be taken. `torch.optim.lr_scheduler.LambdaLR`
calls its function with its own counter, 0 before the first `scheduler.step()`, so each function
here takes that counter and evaluates the formula at s = counter + 1: the first update uses
s = 1 (the paper's step 0 would divide by zero).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..registry import Registry

Schedule = Callable[[int], float]


def noam(d_model: int, warmup: int, factor: float = 1.0) -> Schedule:
    if d_model <= 0 or warmup <= 0:
        raise ValueError(f"noam needs d_model > 0 and warmup > 0, got {d_model}, {warmup}")

    def rate(counter: int) -> float:
        s = counter + 1
        return factor * d_model**-0.5 * min(s**-0.5, s * warmup**-1.5)

    return rate


def cosine(warmup: int, total: int, min_ratio: float = 0.1) -> Schedule:
    if total <= 0 or warmup < 0 or not 0 <= min_ratio <= 1:
        raise ValueError(
            f"cosine needs total > 0, warmup >= 0 and 0 <= min_ratio <= 1, got total {total}, "
            f"warmup {warmup}, min_ratio {min_ratio}"
        )

    def rate(counter: int) -> float:
        s = counter + 1
        if s <= warmup:
            return s / warmup
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return rate


def constant(warmup: int = 0) -> Schedule:
    if warmup < 0:
        raise ValueError(f"constant needs warmup >= 0, got {warmup}")

    def rate(counter: int) -> float:
        s = counter + 1
        return min(1.0, s / warmup) if warmup else 1.0

    return rate


# a recipe's schedule.kind -> the function; built with Registry.build from the schedule's fields
# plus d_model and total (the run's steps), so a new schedule needs no edit in run.py
SCHEDULES: Registry[Callable[..., Schedule]] = Registry("learning-rate schedule")
for _name, _fn in (("noam", noam), ("cosine", cosine), ("constant", constant)):
    SCHEDULES.register(_name)(_fn)


def lambda_lr(
    optimizer: torch.optim.Optimizer, schedule: Schedule
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `schedule`; its state_dict holds only the counter (the function is rebuilt
    from the recipe on resume)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
