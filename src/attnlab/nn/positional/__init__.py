"""Positional schemes, one file each; importing this package registers them all."""

from . import alibi, learned, relative, rope, sinusoidal  # noqa: F401  (registration)
from .base import POSITIONAL, PositionalScheme, Rotation

__all__ = ["POSITIONAL", "PositionalScheme", "Rotation"]
