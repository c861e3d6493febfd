"""One picker for the decode step: what computes the next logits of a decoding loop's rows
(generate, beam search: steps.py `decode_step`) and of the engine's decode batches (runner.py),
asked the same way by both: the first of PROVIDERS whose `why_not(model, cache)` is None.

    provider     serves                                          its step
    cuda-graphs  the engine's pool on CUDA, a model the          (seqs) -> logits | None
                 compiled step serves (batch_step.py)
    native       a static fp32 CPU cache of one row (a loop),    (token, cache) -> logits
                 or the engine's fp32 CPU pool (native_step.py)  (seqs) -> logits | None
    compiled     a "fixed" cache, a model it serves              (token, cache) -> logits
                 (compiled_step.py; CUDA's default, graphs)
    eager        everything: the model's own forward             None (the caller's forward)

An engine step returns None for a batch it does not take (past NATIVE_ROWS rows, or a graph
torch.compile could not build): the runner runs the eager forward for it. A compiled step that
cannot be built says so once (src/attnlab/graphs.py `run_or_fall_back`, the one fallback) and
records its model, which both compiled providers then pass over with the reason. `Picked`
keeps why the providers before the chosen one did not serve: `attnlab inspect --kernels` prints
it beside the attention kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from . import batch_step, compiled_step, native_step


@dataclass(frozen=True)
class Provider:
    """A kind of decode step: `why_not(model, cache)` (None: it serves) and `build(model,
    cache)`, the step; the eager forward's build is None."""

    name: str
    why_not: Callable[[nn.Module, Any], str | None]
    build: Callable[[nn.Module, Any], Callable] | None


PROVIDERS: tuple[Provider, ...] = (
    Provider("cuda-graphs", batch_step.why_not, batch_step.BatchStep),
    Provider("native", native_step.why_not_on, native_step.build),
    Provider("compiled", compiled_step.why_not, compiled_step.CompiledStep),
    Provider("eager", lambda model, cache: None, None),
)


@dataclass(frozen=True)
class Picked:
    """The step chosen for a model and cache: its provider's name, the step (None: the eager
    forward), and (provider, why not) for each provider asked before it."""

    name: str
    step: Callable | None
    passed: tuple[tuple[str, str], ...] = ()

    def explain(self) -> str:
        """'native (cuda-graphs: on the CPU ...)': the step, then why the ones before did not
        serve."""
        why = "; ".join(f"{name}: {reason}" for name, reason in self.passed)
        return f"{self.name} ({why})" if why else self.name


def pick(model: nn.Module, cache: Any) -> Picked:
    """The decode step for `model` on `cache`: the first provider that serves."""
    passed = []
    for p in PROVIDERS:
        why = p.why_not(model, cache)
        if why is None:
            return Picked(p.name, p.build(model, cache) if p.build else None, tuple(passed))
        passed.append((p.name, why))
    raise RuntimeError("no decode step serves: PROVIDERS must end with the eager forward")
