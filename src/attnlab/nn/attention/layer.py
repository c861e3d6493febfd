"""Scaled dot-product multi-head attention (Vaswani et al. 2017, section 3.2), one class for
MHA, GQA (Ainslie et al. 2023, arXiv:2305.13245) and MQA (Shazeer 2019, arXiv:1911.02150):
`n_kv_heads` = n_heads, a divisor of it, or 1.

The hooks, in their declared order:

    x ─ q_proj ─ (q_norm) ─ (rotation) ─┐
    x ─ k_proj ─ (k_norm) ─ (rotation) ─┼─ (cache) ─ kernel(q, k, v, mask, bias, scale) ─ o_proj
    x ─ v_proj ─────────────────────────┘

qk-norm (Dehghani et al. 2023, arXiv:2302.05442; OLMo-2, Qwen3) normalises each head before
the rotation. The layer never knows the positional scheme: it applies whatever rotation, mask
and score bias the `AttnContext` carries. Cross-attention is the same class fed the encoder's
output as `memory`; its K/V are computed once per source and kept in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...cache.base import LayerKV
from ...registry import Registry
from .bias import ScoreBias
from .kernels import KERNELS
from .masks import MaskDescription
from .rotation import Rotation


@dataclass(frozen=True)
class AttnContext:
    """What one stack's attention layers share in a forward pass."""

    mask: MaskDescription | None = None  # masks.py: a MaskSpec, or BigBird's BlockSparseMask
    bias: ScoreBias | torch.Tensor | None = None  # a description (bias.py), or (B, H, T, S)
    rotation: Rotation | None = None


# attention kind (config `attention.kind`) -> layer class; softmax here, linear in linear.py
ATTENTIONS: Registry[type[nn.Module]] = Registry("attention kind")


@ATTENTIONS.register("softmax")
class Attention(nn.Module):
    cache_kind = "static"  # what model.new_cache hands out by default

    def __init__(
        self,
        *,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        k_bias: bool = True,
        o_bias: bool = False,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        scale: float | None = None,
        dropout: float = 0.0,
        kernel: str = "sdpa",
    ) -> None:
        """Args:
        d_model: input and output width.
        n_heads: query heads H.
        n_kv_heads: key/value heads H_kv, a divisor of n_heads (None: n_heads, MHA; 1: MQA).
        head_dim: D (None: d_model // n_heads).
        qkv_bias, o_bias: biases on the q/k/v projections and on the output projection.
        k_bias: with qkv_bias, False leaves the key projection without one (Whisper; softmax
            cancels it: q·b_k is the same for every key).
        q_norm, k_norm: modules applied to each query / key head before the rotation (qk-norm).
        scale: multiplies q·k (None: 1/sqrt(head_dim); T5 uses 1.0).
        dropout: on the attention weights (training only).
        kernel: a name in KERNELS (kernels/); a runtime choice, see `set_kernel`.
        """
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads < 1 or n_kv_heads < 1:
            raise ValueError(f"n_heads ({n_heads}) and n_kv_heads ({n_kv_heads}) must be >= 1")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(
                    f"d_model ({d_model}) must be divisible by n_heads ({n_heads}) when "
                    f"head_dim is not given: pass head_dim"
                )
            head_dim = d_model // n_heads
        KERNELS.get(kernel)  # a typo fails here, with the known names
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias and k_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, d_model, bias=o_bias)
        self.q_norm, self.k_norm = q_norm, k_norm
        self.kernel = kernel

    def _heads(self, x: torch.Tensor, proj: nn.Linear, n: int) -> torch.Tensor:
        """x (B, T, d_model) -> (B, n, T, D): project, split into n heads, heads first."""
        B, T, _ = x.shape
        # (B, T, n·D) -> view (B, T, n, D) -> transpose (B, n, T, D)
        return proj(x).view(B, T, n, self.head_dim).transpose(1, 2)

    def dropout_p(self, ctx: AttnContext) -> float:
        """The attention-weight dropout of this pass: `dropout` in training, else 0 (a subclass
        may drop less, e.g. on one path: block_sparse.py)."""
        return self.dropout if self.training else 0.0

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttnContext,
        memory: torch.Tensor | None = None,
        cache: LayerKV | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d_model); memory (B, S, d_model) for cross-attention. Returns (B, T, d_model)
        and, with need_weights, the (B, H, T, S) attention weights."""
        B, T, _ = x.shape
        fused = memory is None and getattr(self, "qkv_proj", None) is not None
        if fused:  # one matmul for q, k and v (inference weights: src/attnlab/nn/fuse.py)
            # (B, T, (H + 2·H_kv)·D) -> view (B, T, H + 2·H_kv, D) -> transpose, split on heads
            qkv = self.qkv_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            q, k_new, v_new = qkv.split((self.n_heads, self.n_kv_heads, self.n_kv_heads), dim=1)
        else:
            q = self._heads(x, self.q_proj, self.n_heads)  # (B, H, T, D)
        if self.q_norm is not None:
            q = self.q_norm(q)  # per head, over D: (B, H, T, D)
        if ctx.rotation is not None:
            q = ctx.rotation(q)  # (B, H, T, D)
        if memory is not None and cache is not None and cache.ready:
            # cross-attention: the source's K/V, computed on the first step, (B, H_kv, S, D)
            k, v = cache.read()
        else:
            source = x if memory is None else memory  # (B, S, d_model): S = T for self-attention
            if fused:
                k, v = k_new, v_new  # (B, H_kv, S, D), from the fused matmul above
            else:
                k = self._heads(source, self.k_proj, self.n_kv_heads)  # (B, H_kv, S, D)
                v = self._heads(source, self.v_proj, self.n_kv_heads)  # (B, H_kv, S, D)
            if self.k_norm is not None:
                k = self.k_norm(k)  # (B, H_kv, S, D)
            if ctx.rotation is not None:
                k = ctx.rotation(k)  # (B, H_kv, S, D); cross-attention carries no rotation
            if cache is not None:
                # store the T new keys/values and get back all this step attends to,
                # (B, H_kv, S, D): for self-attention S is the slots the cache kind returns
                # (src/attnlab/cache/), for cross-attention the source length
                k, v = cache.update(k, v)
        return self.attend(q, k, v, ctx, ctx.bias, need_weights)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: AttnContext,
        bias: ScoreBias | torch.Tensor | None,
        need_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kernel over q (B, H, T, D), k, v (B, H_kv, S, D) under ctx's mask and `bias`, the
        heads merged and projected: (B, T, d_model) and the (B, H, T, S) weights or None."""
        B, _, T, _ = q.shape
        kernel = KERNELS.get(self.kernel)
        p = self.dropout_p(ctx)
        # out (B, H, T, D); weights (B, H, T, S) with need_weights, else None
        out, weights = kernel.fn(q, k, v, ctx.mask, bias, self.scale, p, need_weights)
        # (B, H, T, D) -> transpose (B, T, H, D) -> reshape (B, T, H·D)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(out), weights  # (B, T, d_model)


def set_kernel(model: nn.Module, name: str) -> nn.Module:
    """Switch every attention layer of `model` to kernel `name` ("naive", "sdpa", ...)."""
    KERNELS.get(name)  # fail early, with the known names, on a typo
    for module in model.modules():
        if isinstance(module, Attention):
            module.kernel = name
    return model
