"""Feed-forward networks: dense, gated (GLU) and mixture of experts."""

from .dense import ACTIVATIONS, FFNS, DenseFFN
from .glu import GLUFFN
from .moe import MoEFFN

__all__ = ["ACTIVATIONS", "FFNS", "GLUFFN", "DenseFFN", "MoEFFN"]
