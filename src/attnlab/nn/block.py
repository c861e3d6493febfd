"""The residual block: where norm placement and residual topology are decided, in one place.

    post-norm (Vaswani 2017, BERT)       pre-norm (GPT-2, Llama; Xiong et al. 2020,
                                          arXiv:2002.04745)
    x ──┬── attn ──(+)── norm ──┬──      x ──┬── norm ── attn ──(+)──┬──
        └───────────┘            ...          └─────────────────┘     ...
    then the same around the FFN          then the same around the FFN
    (and around cross-attention)          (and around cross-attention)

    parallel (GPT-J, GPT-NeoX, PaLM)     parallel-shared-norm (GPT-J, Falcon-7B, PaLM):
    x ──┬── norm1 ── attn ──┐            x ──┬── norm ──┬── attn ──┐
        ├── norm2 ── ffn  ──(+)──            │          └── ffn  ──(+)──
        └───────────────────┘                └─────────────────────┘

Post-norm keeps the residual stream normalised after every sublayer, which makes deep stacks
hard to train without warm-up; pre-norm leaves an identity path from input to output and needs a
final norm. Dropout sits on each sublayer's output before the residual add (2017, section 5.4).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..cache.base import LayerKV
from ..errors import check_choice
from .attention.layer import Attention, AttnContext

Sublayer = Callable[[torch.Tensor], torch.Tensor]
PLACEMENTS = ("pre", "post")  # = ModelConfig.norm_placement
RESIDUALS = ("sequential", "parallel", "parallel-shared-norm")  # = ModelConfig.residual


class Block(nn.Module):
    def __init__(
        self,
        *,
        self_attn: Attention,
        ffn: nn.Module,
        make_norm: Callable[[], nn.Module],
        placement: str = "pre",
        residual: str = "sequential",
        cross_attn: Attention | None = None,
        dropout: float = 0.0,
        attn_norm: bool = True,
    ) -> None:
        """Args:
        self_attn: the self-attention layer.
        ffn: any FFN (src/attnlab/nn/ffn/base.py): returns (output, aux_loss or None).
        make_norm: builds one norm; called once per sublayer that needs its own.
        placement: "pre" or "post" (the diagrams above).
        residual: "sequential", "parallel" or "parallel-shared-norm".
        cross_attn: attention over the encoder output (encoder-decoder decoders), or None.
        dropout: on each sublayer's output before the residual add (training only).
        attn_norm: False leaves out the norm before the attention (pre-norm, sequential only):
            ModernBERT's first block, whose input the embedding norm has just normalised.
        """
        super().__init__()
        check_choice("placement", placement, PLACEMENTS)
        check_choice("residual", residual, RESIDUALS)
        if residual != "sequential" and placement == "post":
            raise ValueError(f"residual {residual!r} needs placement 'pre' (no post-norm form)")
        if residual != "sequential" and cross_attn is not None:
            raise ValueError(f"residual {residual!r} is not defined with cross-attention")
        if not attn_norm and (placement, residual) != ("pre", "sequential"):
            raise ValueError(
                f"attn_norm False needs placement 'pre' and residual 'sequential' (got "
                f"{placement!r}, {residual!r}): only a pre-norm block can skip its first norm"
            )
        self.placement, self.residual = placement, residual
        self.self_attn, self.cross_attn, self.ffn = self_attn, cross_attn, ffn
        self.attn_norm = make_norm() if attn_norm else nn.Identity()
        self.cross_norm = make_norm() if cross_attn is not None else None
        self.ffn_norm = make_norm() if residual != "parallel-shared-norm" else None
        self.dropout = nn.Dropout(dropout)

    def _sub(self, x: torch.Tensor, norm: nn.Module, f: Sublayer) -> torch.Tensor:
        if self.placement == "pre":
            return x + self.dropout(f(norm(x)))
        return norm(x + self.dropout(f(x)))

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        cache: LayerKV | None = None,
        memory: torch.Tensor | None = None,
        memory_ctx: AttnContext | None = None,
        cross_cache: LayerKV | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d_model) -> (B, T, d_model), aux loss of a mixture-of-experts FFN or None."""
        aux = []

        def attn(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, ctx, cache=cache)[0]

        def ffn(h: torch.Tensor) -> torch.Tensor:
            y, a = self.ffn(h)
            aux.append(a)
            return y

        if self.residual == "sequential":
            x = self._sub(x, self.attn_norm, attn)
            if self.cross_attn is not None:
                cross = self.cross_attn
                x = self._sub(
                    x, self.cross_norm, lambda h: cross(h, memory_ctx, memory, cross_cache)[0]
                )
            x = self._sub(x, self.ffn_norm, ffn)
        else:
            h1 = self.attn_norm(x)
            h2 = h1 if self.ffn_norm is None else self.ffn_norm(x)
            x = x + self.dropout(attn(h1)) + self.dropout(ffn(h2))
        return x, aux[0]
