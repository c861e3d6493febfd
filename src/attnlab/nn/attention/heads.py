"""What every multi-head attention kind shares: its head geometry, its projections and the q/k
hooks in their declared order (docs/architecture.md, "The seams", item 2).

    x ─ q_proj ─ (q_norm) ─ (rotation) ─ q   (B, H, T, D)
    x ─ k_proj ─ (k_norm) ─ (rotation) ─ k   (B, H_kv, S, D)      H a multiple of H_kv: each
    x ─ v_proj ──────────────────────────  v   (B, H_kv, S, D)    group of H / H_kv query heads
    (B, T, H·D) ─ o_proj ─ (B, T, d_model)                        shares a K/V head (GQA, MQA)

D defaults to d_model / H (Vaswani et al. 2017, section 3.2.2: d_k = d_v = d_model / h); some
models choose it apart (Gemma's H·D ≠ d_model). `HeadGeometry` checks the sizes once for every
kind; `HeadProjections` is the base of softmax attention (layer.py, and the kinds built on it)
and of linear attention (linear.py), which differ only after the hooks.

Two declared projection layouts (`projection_layout`): "separate" (q_proj, k_proj, v_proj) and,
for inference, "fused" (one `qkv_proj`, src/attnlab/nn/fused_linear.py), switched by
`fuse_projections` / `unfuse_projections` (`attnlab.fuse` calls them on every self-attention
layer whose class declares `fusable`). Either way the state dict has the separate names.

Constructor parameters are written once: a subclass whose `__init__` names only its own keyword
parameters and passes the rest on (`**kwargs`) gets, as its signature, its parent's parameters
with its own added or re-defaulted. That signature is what `Registry.build` matches config fields
and shared sizes by (src/attnlab/registry.py), so the builder still sees every name.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from ...cache.base import LayerKV
from ...errors import check_choice
from ..fused_linear import FusedLinear, Layout, keep_part_names, move_to_front
from .rotation import Rotation

QKV = ("q_proj", "k_proj", "v_proj")
# what a qk-norm normalises: each head over its D channels (Qwen3, Gemma 3), or the whole
# projection over H·D (H_kv·D for keys) before the heads split (OLMo 2, arXiv:2501.00656)
QK_NORM_SCOPES = ("head", "projection")  # = AttentionConfig.qk_norm_scope


@dataclass(frozen=True)
class HeadGeometry:
    """An attention layer's sizes; `of` derives the defaults and checks them."""

    d_model: int
    n_heads: int  # H
    n_kv_heads: int  # H_kv
    head_dim: int  # D

    @classmethod
    def of(
        cls, d_model: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None
    ) -> HeadGeometry:
        """The geometry of an attention kind's size arguments (None: H_kv = H, D = d_model / H),
        every problem reported at once with its fix."""
        n_kv = n_heads if n_kv_heads is None else n_kv_heads
        problems = []
        if n_heads < 1 or n_kv < 1:
            problems.append(f"n_heads ({n_heads}) and n_kv_heads ({n_kv}) must be >= 1")
        elif n_heads % n_kv:
            divisors = [d for d in range(1, n_heads + 1) if n_heads % d == 0]
            problems.append(
                f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv}): choose "
                f"n_kv_heads in {{{', '.join(map(str, divisors))}}}"
            )
        if head_dim is None and n_heads >= 1 and d_model % n_heads:
            problems.append(
                f"d_model ({d_model}) must be divisible by n_heads ({n_heads}) when head_dim is "
                f"not given: pass head_dim"
            )
        if head_dim is not None and head_dim < 1:
            problems.append(f"head_dim ({head_dim}) must be >= 1")
        if problems:
            raise ValueError("; ".join(problems))
        return cls(d_model, n_heads, n_kv, head_dim if head_dim is not None else d_model // n_heads)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(d_model, H, H_kv, D): what a layer keeps as its attributes of those names."""
        return self.d_model, self.n_heads, self.n_kv_heads, self.head_dim

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim  # H·D: the queries', and the merged heads' width

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim  # H_kv·D


def _passed_on(cls: type) -> inspect.Signature:
    """cls's constructor signature: its own keyword parameters, and, where its `__init__` passes
    the rest on (`**kwargs`), its parent's too, in the parent's order (module docstring)."""
    own = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    if not any(p.kind is p.VAR_KEYWORD for p in own):
        return inspect.Signature(own)
    named = {p.name: p for p in own if p.kind is p.KEYWORD_ONLY}
    inherited = inspect.signature(cls.__mro__[1]).parameters
    merged = [named.get(name, p) for name, p in inherited.items()]
    return inspect.Signature(merged + [p for n, p in named.items() if n not in inherited])


class HeadProjections(nn.Module):
    """The projections and q/k hooks of one multi-head attention layer (module docstring); a
    kind adds what follows them: the cache and a kernel (layer.py), or φ and a running state
    (linear.py)."""

    # whether the class has the "fused" layout: True only where every forward path reads q, k
    # and v through `project`; a kind with its own projection code keeps it False
    fusable: ClassVar[bool] = False
    # the current layout, switched by the methods below (a kind with its own projections, MLA,
    # never leaves "separate")
    projection_layout: Literal["separate", "fused"] = "separate"
    # options of the kind's default cache (model.new_cache); Transformer-XL's memory sizes
    cache_options: Mapping[str, Any] = MappingProxyType({})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__signature__ = _passed_on(cls)
        if "forward" in cls.__dict__ and "fusable" not in cls.__dict__:
            # a forward of its own may read q_proj, k_proj, v_proj, which fusing removes: a
            # subclass inherits `fusable` only with its parent's forward, or says so itself
            cls.fusable = False

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
        qk_norm_scope: str = "head",
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
        qk_norm_scope: "head" (the norms act on each head, width D) or "projection" (on all
            heads at once, width H·D and H_kv·D: OLMo 2's q_norm and k_norm).
        """
        super().__init__()
        g = HeadGeometry.of(d_model, n_heads, n_kv_heads, head_dim)
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = g.sizes
        self.q_proj = nn.Linear(d_model, g.q_width, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, g.kv_width, bias=qkv_bias and k_bias)
        self.v_proj = nn.Linear(d_model, g.kv_width, bias=qkv_bias)
        self.o_proj = nn.Linear(g.q_width, d_model, bias=o_bias)
        self.q_norm, self.k_norm = q_norm, k_norm
        check_choice("qk_norm_scope", qk_norm_scope, QK_NORM_SCOPES)
        self.qk_norm_scope = qk_norm_scope
        keep_part_names(self)

    def _heads(self, x: torch.Tensor, proj: nn.Module, n: int) -> torch.Tensor:
        """x (B, T, d_model) -> (B, n, T, D): project, split into n heads, heads first."""
        B, T, _ = x.shape
        # (B, T, n·D) -> view (B, T, n, D) -> transpose (B, n, T, D)
        return proj(x).view(B, T, n, self.head_dim).transpose(1, 2)

    def _hooks(
        self, t: torch.Tensor, norm: nn.Module | None, rotation: Rotation | None
    ) -> torch.Tensor:
        """The declared order on one side: qk-norm (per head over D, or over the whole
        projection), then the rotation. The norm returns t's dtype: under autocast an fp32
        norm weight times a bf16 projection is fp32, and q, k in fp32 beside a bf16 v reach
        a kernel that either refuses mixed dtypes or runs in fp32 (flex on torch 2.11)."""
        dtype = t.dtype
        if norm is not None and self.qk_norm_scope == "projection":
            B, n, T, D = t.shape
            # (B, n, T, D) -> transpose (B, T, n, D) -> reshape (B, T, n·D): the projection
            whole = norm(t.transpose(1, 2).reshape(B, T, n * D))
            t = whole.view(B, T, n, D).transpose(1, 2).to(dtype)  # back to (B, n, T, D)
        elif norm is not None:
            t = norm(t).to(dtype)
        return rotation(t) if rotation is not None else t

    def project(
        self,
        x: torch.Tensor,
        rotation: Rotation | None,
        memory: torch.Tensor | None = None,
        cache: LayerKV | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, D) of x, and k, v (B, H_kv, S, D) of x (self-attention: the T new ones;
        a cache is the caller's) or of `memory` (cross-attention: with a cache, computed on the
        first step and read from it on later ones), through the hooks in their declared order;
        `rotation` is the pass's (AttnContext.rotation, layer.py)."""
        cross = memory is not None and cache is not None
        k = v = None
        if self.projection_layout == "fused":  # one matmul for q, k and v
            if memory is not None:
                raise ValueError(
                    "fused q/k/v projections serve self-attention only (cross-attention reads "
                    "keys from another input): unfuse this layer (attnlab.unfuse)"
                )
            B, T, _ = x.shape
            # (B, T, (H + 2·H_kv)·D) -> view (B, T, H + 2·H_kv, D) -> transpose, split on heads
            qkv = self.qkv_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            q, k, v = qkv.split((self.n_heads, self.n_kv_heads, self.n_kv_heads), dim=1)
        else:
            q = self._heads(x, self.q_proj, self.n_heads)  # (B, H, T, D)
            if not (cross and cache.ready):
                source = x if memory is None else memory  # (B, S, d_model): S = T for self
                k = self._heads(source, self.k_proj, self.n_kv_heads)  # (B, H_kv, S, D)
                v = self._heads(source, self.v_proj, self.n_kv_heads)  # (B, H_kv, S, D)
        q = self._hooks(q, self.q_norm, rotation)  # (B, H, T, D)
        if k is None:  # cross-attention: the source's K/V, computed on the first step
            k, v = cache.read()
            return q, k, v
        k = self._hooks(k, self.k_norm, rotation)  # cross-attention carries no rotation
        if cross:
            k, v = cache.update(k, v)  # stored once, read on later steps
        return q, k, v

    def fused_layouts(self) -> dict[str, Layout]:
        """The fused children and what they concatenate (src/attnlab/nn/fused_linear.py)."""
        return {"qkv_proj": self.qkv_proj.layout} if self.projection_layout == "fused" else {}

    def fuse_projections(self) -> None:
        """Hold q_proj, k_proj and v_proj as one `qkv_proj`, in q_proj's place: the same outputs
        from one matmul. For self-attention layers only (`project` refuses a memory)."""
        if not self.fusable:
            raise ValueError(
                f"{type(self).__name__} has no fused layout (its class leaves `fusable` False: "
                "its own code reads q_proj, k_proj and v_proj, or attnlab.fuse leaves it "
                "alone): keep it unfused"
            )
        if self.projection_layout == "fused":
            return
        self.qkv_proj = FusedLinear([(n, self._modules.pop(n)) for n in QKV])
        move_to_front(self, ["qkv_proj"])
        self.projection_layout = "fused"

    def unfuse_projections(self) -> None:
        """Back to separate q_proj, k_proj, v_proj, with the fused weight's slices."""
        if self.projection_layout == "separate":
            return
        for name, lin in self._modules.pop("qkv_proj").split().items():
            setattr(self, name, lin)
        move_to_front(self, list(QKV))
        self.projection_layout = "separate"
