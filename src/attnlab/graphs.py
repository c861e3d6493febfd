"""Compiled graphs a long-lived process can hold: one `torch.compile` per key, bounded.

Dynamo keeps the graphs it compiles on the code object of the function it compiles, and at
most `recompile_limit` (8) of them: with `fullgraph=True` the 9th shape raises
`FailOnRecompileLimitHit` (a plain Exception); without, dynamo runs the function eagerly from
then on and says so once (FlexAttention then runs unfused: the whole (T, S) score matrix).
One compiled function for every model, batch size and length of a process — a server, a
notebook, a benchmark — hits that after eight. So a `Graphs` holds one copy of its function
per key (a model and its shape buckets; flex's shapes), each copy a fresh code object with a
dynamo cache of its own, in a bounded least-recently-used table:

    key -> (generation, compiled copy)       at most `capacity` keys; the least recently used
                                             is dropped (its graphs go with its code object),
                                             never a pinned one (`pin`)
    a copy that still hits the limit         (guards that vary within one key) is replaced by
                                             the key's next generation, compiled afresh
    compiles                                 graphs built so far (dynamo's own count), for
                                             /metrics and the tests' bounds

Keys may hold `weakref.ref`s (a model): entries whose referent is gone are dropped on the next
miss, so a process that loads models one after another keeps the graphs of live ones only.

What torch.compile raises when it cannot build a graph is COMPILE_ERRORS. The decode steps
(decode/compiled_step.py, decode/batch_step.py) call through `run_or_fall_back`, which catches
it, says so once, and records the model in FAILED, so the decode-step picker
(decode/picker.py) passes the compiled steps over for it from then on; flex
(nn/attention/kernels/flex.py) falls back to another kernel — never silently.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
from torch._dynamo.utils import counters

# dynamo's and inductor's errors (inductor's reach the caller as BackendCompilerFailed, a
# TorchDynamoException) and the recompile limit's, which is a bare Exception
COMPILE_ERRORS: tuple[type[BaseException], ...] = (TorchDynamoException, FailOnRecompileLimitHit)
# models whose graph torch.compile could not build, with the reason (`run_or_fall_back`)
FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fresh_copy(fn: Callable) -> Callable:
    """`fn` as a new function object over a new code object: dynamo caches per code object,
    so a compile of the copy shares no graphs (and no recompile count) with `fn`'s."""
    copy = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
    return copy


def bucket(n: int) -> int:
    """The power of 2 at or above n (n >= 1): the shape buckets graphs are compiled for."""
    return 1 << (n - 1).bit_length()


def describe(err: BaseException) -> str:
    """A compile error in one line: its class and the first line of its message."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"


def compiled_graphs() -> int:
    """Graphs dynamo has built in this process (every holder, every caller)."""
    return counters["stats"]["unique_graphs"]


def _dead(key: Hashable) -> bool:
    parts = key if isinstance(key, tuple) else (key,)
    return any(isinstance(p, weakref.ref) and p() is None for p in parts)


class Graphs:
    """`fn` compiled once per key (`torch.compile(copy, **options)` per key), at most
    `capacity` keys held. Call as `graphs(key, *args, **kwargs)`."""

    def __init__(self, fn: Callable, *, capacity: int = 32, **options: Any) -> None:
        self.fn, self.capacity, self.options = fn, capacity, options
        self._held: OrderedDict[Hashable, tuple[int, Callable]] = OrderedDict()
        self._pinned: set[Hashable] = set()  # never dropped to make room (`pin`)
        self.compiles = 0  # graphs built through this holder
        self.renewed = 0  # copies replaced after hitting the recompile limit within their key

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held

    def _entry(self, key: Hashable, renew: bool = False) -> Callable:
        """The key's current copy (most recently used now); a new one when there is none, or
        with `renew` (the key's next generation: its old graphs dropped)."""
        held = self._held.get(key)
        if held is not None and not renew:
            self._held.move_to_end(key)
            return held[1]
        for old in [k for k in self._held if _dead(k)]:
            del self._held[old]
            self._pinned.discard(old)
        if held is None:  # a renewed key keeps its place; a new one may need room
            free = [k for k in self._held if k not in self._pinned]
            while len(self._held) >= self.capacity and free:
                del self._held[free.pop(0)]  # the least recently used unpinned key
        generation = held[0] + 1 if held is not None else 0
        compiled = torch.compile(fresh_copy(self.fn), **self.options)
        self._held[key] = (generation, compiled)
        return compiled

    def __call__(self, key: Hashable, *args: Any, **kwargs: Any) -> Any:
        before = compiled_graphs()
        try:
            try:
                return self._entry(key)(*args, **kwargs)
            except FailOnRecompileLimitHit:  # guards varied within the key: a new copy
                self.renewed += 1
                return self._entry(key, renew=True)(*args, **kwargs)
        finally:
            self.compiles += compiled_graphs() - before

    def run_or_fall_back(self, key: Hashable, args: tuple, *, owner: Any, what: str) -> Any:
        """`self(key, *args)`, or None where torch.compile cannot build the graph: the key
        dropped, `owner` (the model) recorded in FAILED with the reason, and one RuntimeWarning
        naming `what` and that it runs eagerly from now on (this process)."""
        try:
            return self(key, *args)
        except COMPILE_ERRORS as err:  # raised while compiling, before the graph ran
            self.drop(key)
            FAILED[owner] = why = describe(err)
            warnings.warn(
                f"{what} could not be built ({why}); it decodes eagerly from now on (this process)",
                RuntimeWarning,
                stacklevel=3,
            )
            return None

    def pin(self, key: Hashable) -> None:
        """Never drop `key` to make room (graphs compiled up front, as the engine's captured
        decode sizes, must outlive later ones); the table grows past `capacity` for them."""
        self._pinned.add(key)

    def generation(self, key: Hashable) -> int | None:
        """How often `key`'s copy was renewed (0: never), or None when it is not held."""
        held = self._held.get(key)
        return None if held is None else held[0]

    def drop(self, key: Hashable) -> None:
        """Forget `key`'s graphs (a model that could not be compiled, a freed cache)."""
        self._held.pop(key, None)
        self._pinned.discard(key)
