"""Gated FFNs (Dauphin et al. 2017; Shazeer 2020, "GLU Variants Improve Transformer",
arXiv:2002.05202):

    FFN(x) = down_proj(act(gate_proj(x)) * up_proj(x))

SwiGLU (act = SiLU: Llama, Mistral, Qwen) and GeGLU (act = GELU: T5 v1.1, Gemma). GPT-OSS
(huggingface.co/openai/gpt-oss-20b, its reference `swiglu` in gpt_oss/torch/model.py) clamps
both halves and shifts up by one:

    FFN(x) = down_proj(act(min(gate, limit)) * (clamp(up, -limit, limit) + up_shift))

with act(g) = g·σ(1.702·g) ("gelu-sigmoid"), limit 7 and up_shift 1; the clamp bounds the
activations (the model card: for stable low-precision inference). Three matrices
instead of two, so the hidden size is usually 2/3 of the dense 4·d_model to keep the parameter
count (ModelConfig.ffn_dim in src/attnlab/config/model.py). Bias-free by default, as in the paper.

For inference the gate and up projections, two maps of one input, may be one matmul:
`GLUFFN.fused()` is the same FFN as `FusedGLUFFN`, whose `gate_up_proj` holds both
(src/attnlab/nn/fused_linear.py) and whose state dict keeps gate_proj / up_proj;
`FusedGLUFFN.unfused()` is the way back (`attnlab.fuse` / `unfuse` swap them, MoE experts
included).
"""

from __future__ import annotations

import torch
from torch import nn

from ..activations import ACTIVATIONS
from ..fused_linear import FusedLinear, Layout, keep_part_names
from .base import FFNS


def clamped_glu(glu: GLUFFN | FusedGLUFFN, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(min(gate, limit)) · (clamp(up, ±limit) + up_shift), GPT-OSS's form (docstring above)."""
    if glu.limit is not None:
        gate, up = gate.clamp(max=glu.limit), up.clamp(-glu.limit, glu.limit)
    return glu.act(gate) * (up + glu.up_shift)


@FFNS.register("glu")
class GLUFFN(nn.Module):
    def __init__(
        self,
        *,
        d_model: int,
        d_ff: int,
        activation: str = "silu",
        bias: bool = False,
        limit: float | None = None,
        up_shift: float = 0.0,
        dropout: float = 0.0,
    ) -> None:
        """Args:
        d_model: input and output width.
        d_ff: hidden width of the gate and of the up projection.
        activation: the gate's activation, a name in src/attnlab/nn/activations.py ("silu" is
            SwiGLU, "gelu" / "gelu-tanh" GeGLU, "gelu-sigmoid" GPT-OSS's).
        bias: biases on the three linear maps.
        limit: clamp the gate to <= limit and up to [-limit, limit] (GPT-OSS: 7); None: none.
        up_shift: added to up after the clamp (GPT-OSS: 1).
        dropout: on the gated hidden activation (training only).
        """
        super().__init__()
        if limit is not None and not limit > 0:
            raise ValueError(f"limit ({limit}) must be > 0, or None for no clamp")
        self.act = ACTIVATIONS.get(activation)
        self.limit, self.up_shift = limit, up_shift
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        if self.limit is not None or self.up_shift:  # GPT-OSS's clamped form
            return self.down_proj(
                self.dropout(clamped_glu(self, self.gate_proj(x), self.up_proj(x)))
            ), None
        return self.down_proj(self.dropout(self.act(self.gate_proj(x)) * self.up_proj(x))), None

    def fused(self) -> FusedGLUFFN:
        """This FFN with gate_proj and up_proj as one matmul (module docstring)."""
        return FusedGLUFFN(self)


class FusedGLUFFN(nn.Module):
    """GLUFFN with gate_proj and up_proj as one `gate_up_proj`: the same function, one matmul."""

    def __init__(self, glu: GLUFFN) -> None:
        super().__init__()
        self.act = glu.act  # children in GLUFFN's order, gate_up_proj where gate_proj stood
        self.limit, self.up_shift = glu.limit, glu.up_shift
        self.gate_up_proj = FusedLinear([("gate_proj", glu.gate_proj), ("up_proj", glu.up_proj)])
        self.down_proj, self.dropout = glu.down_proj, glu.dropout
        keep_part_names(self)

    def fused_layouts(self) -> dict[str, Layout]:
        return {"gate_up_proj": self.gate_up_proj.layout}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (..., 2·d_ff) -> 2 × (..., d_ff)
        if self.limit is not None or self.up_shift:
            return self.down_proj(self.dropout(clamped_glu(self, gate, up))), None
        return self.down_proj(self.dropout(self.act(gate) * up)), None

    def unfused(self) -> GLUFFN:
        parts = self.gate_up_proj.split()
        glu = GLUFFN(d_model=1, d_ff=1)  # shell; every submodule is replaced below
        glu.act, glu.dropout, glu.down_proj = self.act, self.dropout, self.down_proj
        glu.limit, glu.up_shift = self.limit, self.up_shift
        glu.gate_proj, glu.up_proj = parts["gate_proj"], parts["up_proj"]
        return glu
