"""Scaled dot-product multi-head attention (Vaswani et al. 2017, section 3.2), one class for
MHA, GQA (Ainslie et al. 2023, arXiv:2305.13245) and MQA (Shazeer 2019, arXiv:1911.02150):
`n_kv_heads` = n_heads, a divisor of it, or 1.

The hooks, in their declared order:

    x ─ q_proj ─ (q_norm) ─ (rotation) ─┐
    x ─ k_proj ─ (k_norm) ─ (rotation) ─┼─ (cache) ─ kernel(q, k, v, mask, bias, scale) ─ o_proj
    x ─ v_proj ─────────────────────────┘

The kernel is chosen per call (kernels/select.py): "auto", the default, takes the first kernel of
the device's preference list that serves the call (`AttnCall`: mask, bias, softcap, sinks,
dropout, weights, layout); a kernel given by name runs where it serves and raises elsewhere.

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
inside torch's fused kernel) is passed over by the selector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...cache.base import LayerKV, PagedKV
from ...registry import Registry
from .bias import ScoreBias
from .heads import HeadProjections
from .kernels.call import AttnCall
from .kernels.select import AUTO, Choice, check_name, choose, first
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
        kernel: str = AUTO,
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
        kernel: "auto" (the selector, kernels/select.py) or a name in KERNELS (kernels/); a
            runtime choice, see `set_kernel`.
        """
        check_name(kernel)  # a typo fails here, with the known names
        super().__init__(**heads)
        self.scale = scale if scale is not None else self.head_dim**-0.5
        self.dropout = dropout
        self.softcap = softcap
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if sinks else None
        self.kernel = kernel
        self.choices: list[Choice] | None = None  # what each call got, when recorded

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
            # store the T new keys/values and get back all this step attends to,
            # (B, H_kv, S, D): S is the slots the cache kind returns (src/attnlab/cache/)
            kv = cache.update(k, v)  # a KVView (src/attnlab/cache/base.py)
            if kv.pages is not None:  # the engine's one-token step: the pool itself
                call = self.call(ctx, ctx.bias, need_weights, pages=kv.pages)
                choice = first(self.kernel, q, k, v, call)
                if choice is not None:  # else no kernel reads the pool: the dense layout
                    return self.finish(q, choice, k, v, call)
            k, v = kv  # a KVView gathers its pair only here
        return self.attend(q, k, v, ctx, ctx.bias, need_weights)

    def call(
        self,
        ctx: AttnContext,
        bias: ScoreBias | torch.Tensor | None,
        need_weights: bool,
        pages: PagedKV | None = None,
    ) -> AttnCall:
        """This layer's kernel call under ctx's mask and `bias` (kernels/call.py)."""
        return AttnCall(
            scale=self.scale,
            mask=ctx.mask,
            bias=bias,
            dropout_p=self.dropout_p(ctx),
            need_weights=need_weights,
            softcap=self.softcap,
            sinks=self.sinks,
            layout="paged" if pages is not None else "dense",
            pages=pages,
        )

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
        call = self.call(ctx, bias, need_weights)
        return self.finish(q, choose(self.kernel, q, k, v, call), k, v, call)

    def finish(
        self, q: torch.Tensor, choice: Choice, k: torch.Tensor, v: torch.Tensor, call: AttnCall
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the chosen kernel, merge the heads, project: (B, T, d_model), weights or None."""
        if self.choices is not None:
            self.choices.append(choice)
        B, _, T, _ = q.shape
        # out (B, H, T, D); weights (B, H, T, S) with need_weights, else None
        out, weights = choice.kernel.fn(q, k, v, call)
        # (B, H, T, D) -> transpose (B, T, H, D) -> reshape (B, T, H·D)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(out), weights  # (B, T, d_model)


def set_kernel(model: nn.Module, name: str) -> nn.Module:
    """Switch every attention layer of `model` to kernel `name`: "auto" (the selector's choice
    per call, the default: kernels/select.py) or a name in KERNELS ("naive", "sdpa", "flex",
    ...), which then runs wherever it serves the call and raises with its reason elsewhere."""
    check_name(name)  # fail early, with the known names, on a typo
    for module in model.modules():
        if isinstance(module, Attention):
            module.kernel = name
    return model


def record_choices(model: nn.Module, on: bool = True) -> list[tuple[str, list[Choice]]]:
    """Start (or stop) recording, per attention layer, the kernel each call got and why the
    ones before it did not (`attnlab inspect --kernels`): [(layer name, its list of Choice)],
    filled by the forward passes that follow."""
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            module.choices = [] if on else None
            layers.append((name, module.choices))
    return layers
