"""Feed-forward networks: dense, gated (GLU) and mixture of experts; importing this package
registers them all in FFNS (base.py)."""

from . import dense, glu, moe  # noqa: F401  (registration)
from .base import FFNS
from .dense import DenseFFN
from .glu import GLUFFN
from .moe import MoEFFN

__all__ = ["FFNS", "GLUFFN", "DenseFFN", "MoEFFN"]
