"""Registry: a name -> entry table for kinds that grow (positional schemes, RoPE scalings,
activations, norms, FFNs, attention kernels, cache kinds, init schemes, presets, converters,
training tasks). Entries register by explicit import; an unknown name raises with every known name
and the close matches.

`build(name, *sources, **overrides)` instantiates an entry with keyword arguments taken by name:
each parameter of the entry's signature is looked up in `overrides`, then in each source mapping
in order (build.py passes a config node's fields and the shared dims record). So a component
declares what it needs just by naming its parameters, and build.py needs no per-kind code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Generic, TypeVar

from .errors import did_you_mean

T = TypeVar("T")


class UnknownNameError(ValueError, KeyError):
    """A name that is not in a registry; the message lists known names and close matches.
    A ValueError (a bad argument value) and, for lookups, a KeyError."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.what} {name!r} is already registered")
            self._entries[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        """Entry `name`, or the one entry whose name it is up to case (`Llama2-7B`)."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable "name"
            folded = [
                k for k in self._entries if isinstance(name, str) and k.lower() == name.lower()
            ]
            if len(folded) == 1:
                return self._entries[folded[0]]
            raise UnknownNameError(
                f"unknown {self.what} {name!r}.{did_you_mean(name, self._entries)} "
                f"Known: {', '.join(sorted(self._entries))}"
            ) from None

    def build(
        self,
        name: str,
        /,
        *sources: Mapping[str, Any],
        strict: Collection[str] | None = None,
        **overrides: Any,
    ) -> Any:
        """Call entry `name` with the keyword arguments its signature names, each taken from
        `overrides` first, then from the first source that has it; parameters with a default
        may be absent. A required parameter found nowhere raises a ValueError naming it.

        `strict`: the first source is a hand-written mapping (an expert spec, a RoPE scaling),
        so a key no parameter names is a typo and raises, with a did-you-mean — except the keys
        listed in `strict` (e.g. "kind")."""
        entry = self.get(name)
        params = inspect.signature(entry).parameters.values()
        if strict is not None and sources:
            names = [p.name for p in params]
            unknown = [key for key in sources[0] if key not in names and key not in strict]
            if unknown:
                raise ValueError(
                    f"{self.what} {name!r} takes no {', '.join(map(repr, unknown))}."
                    f"{did_you_mean(unknown[0], names)} It takes: {', '.join(names)}"
                )
        kwargs: dict[str, Any] = {}
        missing = []
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            for source in (overrides, *sources):
                if p.name in source:
                    kwargs[p.name] = source[p.name]
                    break
            else:
                if p.default is p.empty:
                    missing.append(p.name)
        if missing:
            offered = sorted({k for s in (overrides, *sources) for k in s})
            raise ValueError(
                f"{self.what} {name!r} needs {', '.join(map(repr, missing))}, which neither its "
                f"config node nor the shared dims provide (offered: {', '.join(offered)}): add a "
                f"field with that name to its config class, or name the parameter after one of "
                f"the offered values"
            )
        return entry(**kwargs)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
