"""Positional schemes, one file each (and RoPE's scalings in scaling.py); importing this package
registers them all. Adding a scheme: its module here, its config class in src/attnlab/config/positional.py,
and its name in the import line below."""

from . import alibi, learned, relative, rope, sinusoidal, xl_relative  # noqa: F401  (registration)
from .base import POSITIONAL, PositionalScheme, Rotation
from .scaling import ROPE_SCALINGS

__all__ = ["POSITIONAL", "ROPE_SCALINGS", "PositionalScheme", "Rotation"]
