"""The residual block: where norm placement and residual topology are decided, in one place.

    post-norm (Vaswani 2017, BERT)       pre-norm (GPT-2, Llama; Xiong et al. 2020,
                                          arXiv:2002.04745)
    x ──┬── attn ──(+)── norm ──┬──      x ──┬── norm ── attn ──(+)──┬──
        └───────────┘            ...          └─────────────────┘     ...

    sandwich (Gemma 2, arXiv:2408.00118,  post-sublayer (OLMo 2, arXiv:2501.00656,
    section 2; Gemma 3)                   section 3.2.1: "reordered norm")
    x ──┬── norm ── attn ── norm ──(+)──  x ──┬── attn ── norm ──(+)──┬──
        └──────────────────────────┘          └──────────────────┘     ...
    then the same around the FFN (and around cross-attention), each sublayer with its own norms

    parallel (GPT-J, GPT-NeoX, PaLM)     parallel-shared-norm (GPT-J, Falcon-7B, PaLM):
    x ──┬── norm1 ── attn ──┐            x ──┬── norm ──┬── attn ──┐
        ├── norm2 ── ffn  ──(+)──            │          └── ffn  ──(+)──
        └───────────────────┘                └─────────────────────┘

Post-norm keeps the residual stream normalised after every sublayer, which makes deep stacks
hard to train without warm-up; pre-norm leaves an identity path from input to output and needs a
final norm. The two newer placements keep pre-norm's identity path and normalise what each
sublayer adds: sandwich normalises its input and its output (`attn_post_norm`, `ffn_post_norm`,
`cross_post_norm` beside pre-norm's `attn_norm`, `ffn_norm`, `cross_norm`); post-sublayer its
output only (`attn_norm`, `ffn_norm` moved behind the sublayer), so the stream is never
normalised inside the stack and both need the stack's final norm, as Gemma 2 and OLMo 2 have. The
parallel residuals are defined for pre-norm only: one norm feeds the branches, none follows them.

Dropout sits on each sublayer's output before the residual add (2017, section 5.4), after a
sublayer's own output norm. `residual_multiplier` m scales what each sublayer adds, x + m·f(x)
(Granite 3: transformers' GraniteConfig.residual_multiplier, a μP-style width multiplier, Yang
et al. 2022, arXiv:2203.03466; 1.0: the plain sum).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..cache.base import LayerKV
from ..errors import check_choice
from .attention.layer import Attention, AttnContext

Sublayer = Callable[[torch.Tensor], torch.Tensor]
PLACEMENTS = ("pre", "post", "sandwich", "post-sublayer")  # = ModelConfig.norm_placement
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
        residual_multiplier: float = 1.0,
    ) -> None:
        """Args:
        self_attn: the self-attention layer.
        ffn: any FFN (src/attnlab/nn/ffn/base.py): returns (output, aux_loss or None).
        make_norm: builds one norm; called once per norm the placement needs.
        placement: "pre", "post", "sandwich" or "post-sublayer" (the diagrams above).
        residual: "sequential", "parallel" or "parallel-shared-norm" (the last two: "pre" only).
        cross_attn: attention over the encoder output (encoder-decoder decoders), or None.
        dropout: on each sublayer's output before the residual add (training only).
        attn_norm: False leaves out the norm before the attention (pre-norm, sequential only):
            ModernBERT's first block, whose input the embedding norm has just normalised.
        residual_multiplier: m in x + m·f(x) for every sublayer (Granite); 1.0 adds f(x).
        """
        super().__init__()
        check_choice("placement", placement, PLACEMENTS)
        check_choice("residual", residual, RESIDUALS)
        if residual != "sequential" and placement != "pre":
            raise ValueError(
                f"residual {residual!r} needs placement 'pre' (got {placement!r}): the parallel "
                f"branches share one pre-norm input and have no post-norm form"
            )
        if residual != "sequential" and cross_attn is not None:
            raise ValueError(f"residual {residual!r} is not defined with cross-attention")
        if not attn_norm and (placement, residual) != ("pre", "sequential"):
            raise ValueError(
                f"attn_norm False needs placement 'pre' and residual 'sequential' (got "
                f"{placement!r}, {residual!r}): only a pre-norm block can skip its first norm"
            )
        self.placement, self.residual = placement, residual
        self.residual_multiplier = residual_multiplier
        self.self_attn, self.cross_attn, self.ffn = self_attn, cross_attn, ffn
        self.attn_norm = make_norm() if attn_norm else nn.Identity()
        self.cross_norm = make_norm() if cross_attn is not None else None
        self.ffn_norm = make_norm() if residual != "parallel-shared-norm" else None
        if placement == "sandwich":  # a second norm on each sublayer's output (Gemma 2)
            self.attn_post_norm = make_norm()
            self.cross_post_norm = make_norm() if cross_attn is not None else None
            self.ffn_post_norm = make_norm()
        self.dropout = nn.Dropout(dropout)

    def _add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + m·dropout(y): a sublayer's output y onto the stream (m 1.0: no multiply)."""
        y = self.dropout(y)
        return x + (y if self.residual_multiplier == 1.0 else y * self.residual_multiplier)

    def _sub(
        self, x: torch.Tensor, norm: nn.Module, f: Sublayer, post: nn.Module | None = None
    ) -> torch.Tensor:
        """One sequential sublayer f with its norm (and sandwich's output norm `post`)."""
        if self.placement == "pre":
            return self._add(x, f(norm(x)))
        if self.placement == "post":
            return norm(self._add(x, f(x)))
        if self.placement == "sandwich":
            return self._add(x, post(f(norm(x))))
        return self._add(x, norm(f(x)))  # post-sublayer: the stream itself is never normalised

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
            sandwich = self.placement == "sandwich"
            x = self._sub(x, self.attn_norm, attn, self.attn_post_norm if sandwich else None)
            if self.cross_attn is not None:
                cross = self.cross_attn
                x = self._sub(
                    x,
                    self.cross_norm,
                    lambda h: cross(h, memory_ctx, memory, cross_cache)[0],
                    self.cross_post_norm if sandwich else None,
                )
            x = self._sub(x, self.ffn_norm, ffn, self.ffn_post_norm if sandwich else None)
        else:
            h1 = self.attn_norm(x)
            h2 = h1 if self.ffn_norm is None else self.ffn_norm(x)
            x = self._add(self._add(x, attn(h1)), ffn(h2))
        return x, aux[0]
