"""Scaled dot-product multi-head attention (Vaswani et al. 2017, section 3.2), one class for
MHA, GQA (Ainslie et al. 2023, arXiv:2305.13245) and MQA (Shazeer 2019, arXiv:1911.02150):
`n_kv_heads` = n_heads, a divisor of it, or 1.

The hooks, in their declared order:

    x ─ q_proj ─ (q_norm) ─ (rotation) ─┐
    x ─ k_proj ─ (k_norm) ─ (rotation) ─┼─ (cache) ─ kernel(q, k, v, mask, bias, scale) ─ o_proj
    x ─ v_proj ─────────────────────────┘

The projections and the hooks before the cache are every attention kind's (heads.py: sizes,
q_proj / k_proj / v_proj or their fused form, qk-norm, rotation); this layer adds the cache and
the kernel. qk-norm (Dehghani et al. 2023, arXiv:2302.05442; OLMo-2, Qwen3) normalises each
head before the rotation. The layer never knows the positional scheme: it applies whatever rotation, mask
and score bias the `AttnContext` carries. Cross-attention is the same class fed the encoder's
output as `memory`; its K/V are computed once per source and kept in the cache.

Two score transforms, applied by the kernel (kernels/base.py): `softcap` c, Gemma 2's
c · tanh(s / c) on the scaled scores (arXiv:2408.00118, section 2.2), and `sinks`, GPT-OSS's
learned logit per head (a parameter named `sinks`, (H,), as transformers' GptOssAttention) in
every softmax denominator. A kernel that does not declare one in its caps (sdpa cannot soft-cap
inside torch's fused kernel) is replaced for this layer's call by SUBSTITUTE (`kernel_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from ...cache.base import LayerKV
from ...registry import Registry
from .bias import ScoreBias
from .heads import HeadProjections
from .kernels import KERNELS, Kernel
from .masks import MaskDescription
from .paged_decode import attend_paged
from .rotation import Rotation


@dataclass(frozen=True)
class AttnContext:
    """What one stack's attention layers share in a forward pass."""

    mask: MaskDescription | None = None  # masks.py: a MaskSpec, or BigBird's BlockSparseMask
    bias: ScoreBias | torch.Tensor | None = None  # a description (bias.py), or (B, H, T, S)
    rotation: Rotation | None = None


# attention kind (config `attention.kind`) -> layer class; softmax here, linear in linear.py
ATTENTIONS: Registry[type[nn.Module]] = Registry("attention kind")

# the kernel a layer runs when its own lacks a transform it needs: exact, any mask and bias,
# linear memory, both transforms (kernels/chunked.py)
SUBSTITUTE = "chunked"


@ATTENTIONS.register("softmax")
class Attention(HeadProjections):
    cache_kind = "static"  # what model.new_cache hands out by default
    fusable = True  # q/k/v as one matmul (fuse_projections, heads.py) in inference

    def __init__(
        self,
        *,
        scale: float | None = None,
        dropout: float = 0.0,
        softcap: float | None = None,
        sinks: bool = False,
        kernel: str = "sdpa",
        **heads: Any,
    ) -> None:
        """Args: those of `HeadProjections` (heads.py: d_model, n_heads, n_kv_heads, head_dim,
        qkv_bias, k_bias, o_bias, q_norm, k_norm), and
        scale: multiplies q·k (None: 1/sqrt(head_dim); T5 uses 1.0).
        dropout: on the attention weights (training only).
        softcap: c of c · tanh(s / c) on the scaled scores, before any bias or mask (Gemma 2's
            attn_logit_softcapping); None: no capping.
        sinks: a learned logit per head in every softmax denominator, the parameter `sinks`
            (H,), zero at first: one extra unit of weight that no value receives (GPT-OSS).
        kernel: a name in KERNELS (kernels/); a runtime choice, see `set_kernel`.
        """
        KERNELS.get(kernel)  # a typo fails here, with the known names
        super().__init__(**heads)
        self.scale = scale if scale is not None else self.head_dim**-0.5
        self.dropout = dropout
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if sinks else None
        self.kernel = kernel

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
        # q (B, H, T, D); k, v (B, H_kv, S, D), normed and rotated (heads.py)
        q, k, v = self.project(x, ctx.rotation, memory, cache)
        if memory is None and cache is not None:
            # the engine's decode step: the paged pool read in place (paged_decode.py)
            out = attend_paged(self, q, k, v, ctx, cache, need_weights)
            if out is not None:
                return self.o_proj(out), None
            # store the T new keys/values and get back all this step attends to,
            # (B, H_kv, S, D): S is the slots the cache kind returns (src/attnlab/cache/)
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
        if self.softcap is not None or self.sinks is not None:
            kernel = self.transformed()  # the score transforms bound to a kernel that has them
        p = self.dropout_p(ctx)
        # out (B, H, T, D); weights (B, H, T, S) with need_weights, else None
        out, weights = kernel.fn(q, k, v, ctx.mask, bias, self.scale, p, need_weights)
        # (B, H, T, D) -> transpose (B, T, H, D) -> reshape (B, T, H·D)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(out), weights  # (B, T, d_model)

    def transformed(self) -> Kernel:
        """`kernel_for()`'s kernel with this layer's softcap and sinks bound as its keywords
        (only those set, so a kernel without the keywords still runs plain layers)."""
        kernel = KERNELS.get(self.kernel_for())
        transforms: dict[str, Any] = {}
        if self.softcap is not None:
            transforms["softcap"] = self.softcap
        if self.sinks is not None:
            transforms["sinks"] = self.sinks
        return replace(kernel, fn=partial(kernel.fn, **transforms))

    def kernel_for(self) -> str:
        """The kernel this layer runs: its own, unless that one does not declare a transform
        the layer applies (soft-capping on sdpa), then SUBSTITUTE."""
        caps = KERNELS.get(self.kernel).caps
        if (self.softcap is not None and not caps.softcap) or (
            self.sinks is not None and not caps.sinks
        ):
            return SUBSTITUTE
        return self.kernel


def set_kernel(model: nn.Module, name: str) -> nn.Module:
    """Switch every attention layer of `model` to kernel `name` ("naive", "sdpa", ...)."""
    KERNELS.get(name)  # fail early, with the known names, on a typo
    for module in model.modules():
        if isinstance(module, Attention):
            module.kernel = name
    return model
