"""olmo2 (Olmo2Model, conversion/olmo.py): the llama layout's names, post-sublayer norms and
qk-norm over the whole projection; no permutation."""

from __future__ import annotations

from .base import Arch, Keys, text_parameters
from .llama import no_head_dim


def _olmo2(k: Keys, meta, hf, tensors) -> dict:
    """Names only. Olmo2Model also writes OLMo 3 (a window on three layers of four,
    attention.sliding_window / _pattern), which transformers' olmo2 family does not have."""
    if k("attention.sliding_window", None) is not None:
        k.refuse(
            "attention.sliding_window",
            "an OLMo 3 file (sliding-window layers); attnlab reads OLMo 2 (no window) only",
        )
    return {}


OLMO2 = Arch("olmo2", "olmo2", "OLMO2", text_parameters, config=_olmo2, config_json=no_head_dim)
