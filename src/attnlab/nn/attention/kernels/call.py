"""One kernel call as a record: what a kernel needs beyond q, k and v.

Every kernel is `fn(q, k, v, call) -> (out, weights)`: q (B, H, T, D), k and v (B, H_kv, S, D),
`call` an `AttnCall`. A new input (a score transform, a KV layout) is one field here and one
capability in `KernelCaps` (base.py), not one more positional argument through every kernel.

The mask and the bias are descriptions (masks.py, bias.py), never (T, S) tensors; a dense bias
tensor given by hand is wrapped as a `DenseBias` here, once. `layout` says how K/V reach the
kernel: "dense" (B, H_kv, S, D) tensors, or "paged": the engine's block pool read in place
(`pages`, a `PagedKV`: cache/base.py), where k and v are this step's new keys and values only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ....cache.base import PagedKV
from ..bias import ScoreBias, as_bias
from ..masks import MaskDescription

Layout = Literal["dense", "paged"]


@dataclass(frozen=True, kw_only=True)
class AttnCall:
    """softmax([cap(q kᵀ · scale) + bias, masked ; sink_h]) v, with dropout on the weights
    (kernels/base.py has the formula and the conventions)."""

    scale: float
    mask: MaskDescription | None = None
    bias: ScoreBias | None = None  # a description; a (B|1, H, T, S) tensor is wrapped
    dropout_p: float = 0.0
    need_weights: bool = False  # return the (B, H, T, S) weights too (the naive kernel)
    softcap: float | None = None  # c of c · tanh(s / c) on the scaled scores (Gemma 2)
    sinks: torch.Tensor | None = None  # (H,) a logit per head in every denominator (GPT-OSS)
    layout: Layout = "dense"
    pages: PagedKV | None = None  # with layout "paged"

    def __post_init__(self) -> None:
        if isinstance(self.bias, torch.Tensor):
            object.__setattr__(self, "bias", as_bias(self.bias))
        if (self.layout == "paged") != (self.pages is not None):
            raise ValueError("layout 'paged' comes with `pages` (a PagedKV), and only it")

    def needs_grad(self, *tensors: torch.Tensor) -> bool:
        """Whether autograd records this call: gradients on and some input requires them (q, k,
        v as given, the sinks, or a bias's parameters: probed on its first entry)."""
        if not torch.is_grad_enabled():
            return False
        if any(t.requires_grad for t in tensors):
            return True
        if self.sinks is not None and self.sinks.requires_grad:
            return True
        return self.bias is not None and _bias_learns(self.bias)


def _bias_learns(bias: ScoreBias) -> bool:
    one = slice(0, 1)
    try:
        return bias.block(one, one).requires_grad
    except (ValueError, IndexError):  # a description bound elsewhere (XL's positions)
        return False
