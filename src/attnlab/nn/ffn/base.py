"""The FFN contract and registry.

Every FFN maps (..., d_model) -> ((..., d_model), aux_loss) — aux_loss is None except for a
mixture of experts, whose load-balancing loss the block passes up — so any FFN can stand in for
any other. Entries take keyword arguments named after their config node's fields plus the shared
sizes (`d_model`, `d_ff`) and `dropout` (src/attnlab/build.py supplies them).
"""

from __future__ import annotations

from torch import nn

from ...registry import Registry

FFNS: Registry[type[nn.Module]] = Registry("FFN")
