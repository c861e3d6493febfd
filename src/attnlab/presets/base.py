"""The preset registry: PRESETS, filled by the lineage modules of this package as they are
imported (presets/__init__.py imports them all), and the lookups over it."""

from __future__ import annotations

from collections.abc import Callable

from ..config import ModelConfig
from ..registry import Registry

PRESETS: Registry[Callable[[], ModelConfig]] = Registry("preset")


def get(name: str) -> ModelConfig:
    return PRESETS.get(name)()


def names() -> list[str]:
    return PRESETS.names()


def source(name: str) -> str:
    """The paper or model card a preset follows (first line of its docstring)."""
    return (PRESETS.get(name).__doc__ or "").strip().splitlines()[0]
