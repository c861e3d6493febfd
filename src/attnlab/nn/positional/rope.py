"""Rotary position embedding, RoPE (Su et al. 2021, arXiv:2104.09864, section 3.4).

Each pair of channels of q and k is rotated by the angle position · θ_i, θ_i = base^(-2i/R) for
i < R/2 (R = rotated channels). Because rotations compose, q_m · k_n depends only on m - n: the
relative property a test checks. Context-extension scalings (linear, NTK, dynamic NTK, YaRN,
Llama 3's, LongRoPE, p-RoPE) change θ; they are in scaling.py, one registered class each. A
`dynamic` one (dynamic NTK, LongRoPE) may pick other frequencies for a forward pass by its highest
position (`at_length`), once per pass, as transformers' `dynamic_rope_update` does.

cos/sin are computed in fp32 (angles reach 1e5 rad; bf16 would be useless), then cast to q's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...errors import check_choice
from .base import LAYOUTS, POSITIONAL, PositionalScheme, Rotation
from .scaling import ROPE_SCALINGS, RopeScaling


@POSITIONAL.register("rope")
class RotaryEmbedding(PositionalScheme):
    def __init__(
        self,
        *,
        rotary_dim: int,
        base: float = 10000.0,
        layout: str = "half",
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        """Args:
        rotary_dim: R, the channels of each head that rotate (even; the rest pass through).
        base: the wavelength base of θ_i = base^(-2i/R).
        layout: "half" pairs channel i with i + R/2 (GPT-NeoX, Llama in HF); "interleaved"
            pairs 2i with 2i + 1 (the paper, Meta's Llama code).
        scaling: a context-extension scaling as plain data, e.g. {"kind": "yarn", "factor": 4.0,
            "original_max_len": 2048} (kinds in scaling.py), or None.
        """
        super().__init__()
        check_choice("layout", layout, LAYOUTS)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rotary_dim ({rotary_dim}) must be an even number >= 2")
        self.rot_dim, self.base, self.layout = rotary_dim, base, layout
        self.scaling: RopeScaling = (
            ROPE_SCALINGS.build(scaling.get("kind"), scaling, strict=("kind",))
            if scaling
            else RopeScaling()
        )
        inv = self.scaling.inv_freq(rotary_dim, base)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    @property
    def attention_factor(self) -> float:
        """Multiplies cos and sin (YaRN's attention temperature; 1 otherwise)."""
        return self.scaling.attention_factor

    @property
    def reprefill_after(self) -> int | None:
        """A cache filled while the sequence held at most this many tokens is stale once it
        holds more, and a decoding loop reruns the sequence then (LongRoPE: its original length,
        as transformers' Phi-3 generate; scaling.py); None: caches never go stale."""
        return self.scaling.reprefill_after

    def rotation(self, positions: torch.Tensor) -> Rotation:
        inv = self.inv_freq
        if self.scaling.dynamic and positions.device.type != "meta" and positions.numel():
            length = int(positions.max()) + 1
            grown = self.scaling.at_length(length, self.rot_dim, self.base)
            if grown is not None:  # past the original length (dynamic NTK, LongRoPE's long set)
                inv = grown.float().to(inv.device)
        angle = positions[..., None].float() * inv  # (B, T, R/2)
        f = self.attention_factor
        return Rotation(angle.cos() * f, angle.sin() * f, self.layout)
