"""A stack: positions, embedding norm, blocks, final norm — one encoder or decoder.

The stack owns the positional scheme and calls its three hooks once per forward pass (embedding,
rotation, score bias), so every block shares one rotation table and one bias tensor (T5 shares
its relative-bias table across layers this way). It also builds the mask description from
explicit positions: the same code serves training, padded batches and cached decoding.

Layers of one stack may attend differently (`LayerVariant`): the blocks cycle through the stack's
variants, each with its own window and, optionally, its own positional scheme (rotation or score
bias; the stack's scheme still adds the embeddings). ModernBERT (arXiv:2412.13663, section 2.1.1)
alternates one global layer with two local ones (a 128-token window, RoPE base 10,000 instead of
160,000); Gemma 2 and 3 alternate windows the same way. Each variant's context is built once per
forward pass, like the stack's own.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..cache.base import ForwardCache
from .attention.layer import AttnContext
from .attention.masks import MaskSpec
from .positional.base import PositionalScheme


def default_positions(
    attention_mask: torch.Tensor | None, shape: tuple[int, int], start: torch.Tensor | None, device
) -> torch.Tensor:
    """(B, T) positions: 0, 1, ... after `start`, counting only real tokens when a mask is given,
    so a left-padded row starts at 0 on its first real token."""
    B, T = shape
    if attention_mask is None:
        pos = torch.arange(T, device=device).expand(B, T)  # (T,) -> (B, T), a broadcast view
    else:
        pos = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T)
    return pos if start is None else pos + start[:, None]  # start (B,) -> (B, 1)


class LayerVariant(nn.Module):
    """How some blocks of a stack attend instead of the stack's own way."""

    def __init__(self, *, window: int | None, positional: PositionalScheme | None = None) -> None:
        """window: these blocks' sliding window (None: full attention), replacing the stack's.
        positional: their own scheme (its rotation and score bias); None keeps the stack's."""
        super().__init__()
        self.window, self.positional = window, positional


class Stack(nn.Module):
    def __init__(
        self,
        *,
        positional: PositionalScheme,
        blocks: list[nn.Module],
        causal: bool,
        final_norm: nn.Module | None = None,
        embedding_norm: nn.Module | None = None,
        window: int | None = None,
        dropout: float = 0.0,
        variants: list[LayerVariant] | None = None,
    ) -> None:
        """Args:
        positional: the scheme (src/attnlab/nn/positional/) whose hooks this stack calls.
        blocks: the residual blocks, applied in order.
        causal: each query sees only keys at its position or before (decoders).
        final_norm: after the last block (pre-norm stacks), or None.
        embedding_norm: right after the embeddings (BERT, BLOOM, BART), or None.
        window: sliding-window attention: keys within window-1 positions (Mistral, Longformer).
        dropout: on the embeddings (training only).
        variants: block i attends as variants[i % len(variants)] (window, positional scheme);
            None: every block as the stack.
        """
        super().__init__()
        self.positional = positional
        self.embedding_norm = embedding_norm
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm
        self.causal, self.window = causal, window
        self.dropout = nn.Dropout(dropout)
        self.variants = nn.ModuleList(variants) if variants else None

    def _contexts(self, ctx: AttnContext, decode_step: bool) -> list[AttnContext]:
        """The stack's context, or one per variant: the variant's window on the same positions
        and padding, its own rotation and score bias where it has a scheme. A decode step that
        may see every stored key (the usual case) gets no mask at all, so the kernels take their
        unmasked path instead of each layer building an additive one."""
        out = []
        for v in self.variants if self.variants is not None else [None]:
            m, bias, rotation = ctx.mask, ctx.bias, ctx.rotation
            if v is not None and v.window != m.window:
                m = replace(m, window=v.window)
            if v is not None and v.positional is not None:
                bias = v.positional.score_bias(m.q_positions, m.k_positions)
                rotation = v.positional.rotation(m.q_positions)
            if decode_step and not m.is_empty and bool(m.dense().all()):
                m = MaskSpec(m.q_positions, m.k_positions)
            out.append(AttnContext(m, bias, rotation))
        return out

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        key_padding: torch.Tensor | None = None,
        aligned: bool = False,
        cache: ForwardCache | None = None,
        memory: torch.Tensor | None = None,
        memory_padding: torch.Tensor | None = None,
        global_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d_model) token embeddings; positions (B, T); key_padding (B, T) bool, True =
        real token; global_tokens (B, T) bool, True = a global token (Longformer: it sees every
        token and every token sees it; masks.py). Returns the final hidden states (B, T, d_model)
        and the MoE aux loss averaged over layers (or None)."""
        pe = self.positional.embed(positions)  # (B, T, d_model), or None
        if pe is not None:
            x = x + pe.to(x.dtype)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        x = self.dropout(x)
        k_positions, k_padding = positions, key_padding
        if cache is not None:
            valid = (
                key_padding
                if key_padding is not None
                else torch.ones_like(positions, dtype=torch.bool)
            )
            k_positions, k_padding = cache.append(positions, valid)  # (B, S) each, S >= T
            aligned = False
        fixed = cache is not None and cache.fixed_shape  # a graph's view: no host reads
        if k_padding is not None and not fixed and bool(k_padding.all()):
            k_padding = None  # nothing to mask: keeps the kernels' fast paths open
        if global_tokens is not None:
            if cache is not None:
                raise ValueError(
                    "global tokens need the whole sequence at once: drop the cache or "
                    "global_attention_mask"
                )
            if key_padding is not None:  # a padding token is never global (transformers alike)
                global_tokens = global_tokens & key_padding
            if not bool(global_tokens.any()):
                global_tokens = None  # nothing global: the plain window's fast paths stay open
        mask = MaskSpec(
            positions,
            k_positions,
            self.causal,
            self.window,
            k_padding,
            aligned,
            q_global=global_tokens,
            k_global=global_tokens,  # self-attention without a cache: the keys are the queries
        )
        ctx = AttnContext(
            mask,
            self.positional.score_bias(positions, k_positions),  # (B, H, T, S), or None
            self.positional.rotation(positions),  # cos/sin (B, T, R/2) for q and k, or None
        )
        contexts = self._contexts(ctx, cache is not None and not fixed and positions.shape[1] == 1)
        memory_ctx = None
        if memory is not None:  # cross-attention: no positions, only the source's padding
            # (S,) -> (B, S): they only size the mask, which is neither causal nor windowed here
            m_pos = torch.arange(memory.shape[1], device=memory.device).expand(memory.shape[0], -1)
            memory_ctx = AttnContext(MaskSpec(positions, m_pos, key_padding=memory_padding))
        aux_total = None
        for i, block in enumerate(self.blocks):
            layer_cache = cache.layers[i] if cache is not None else None
            cross_cache = cache.cross[i] if cache is not None and cache.cross is not None else None
            c = contexts[i % len(contexts)]
            x, aux = block(x, c, layer_cache, memory, memory_ctx, cross_cache)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        if self.final_norm is not None:
            x = self.final_norm(x)
        n = len(self.blocks)
        return x, (aux_total / n if aux_total is not None else None)
