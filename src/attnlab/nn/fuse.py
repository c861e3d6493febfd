"""Fused projections for inference: one matmul where the model holds several over the same input.

    x ─ q_proj ─┐                          x ─ qkv_proj ─ split ─ q, k, v
    x ─ k_proj ─┼─ ...        becomes
    x ─ v_proj ─┘
    x ─ gate_proj ─┐                       x ─ gate_up_proj ─ chunk ─ act(g) · u ─ down_proj
    x ─ up_proj ───┴─ act(g) · u ─ ...

The same trick as gpt-fast's and vLLM's `QKVParallelLinear` (src/attnlab/nn/fused_linear.py):
the outputs are unchanged (up to the matmul's blocking order) while a decoding step launches one
matmul instead of three (two). The fused forms are the modules' own, declared where they are
computed: an attention layer switches its projection layout (`fuse_projections`,
src/attnlab/nn/attention/heads.py) and a gated FFN has a fused twin (`GLUFFN.fused()`,
`FusedGLUFFN`, src/attnlab/nn/ffn/glu.py). `fuse(model)` asks for them, from outside, as any
inference-time swap is done (gpt-fast `quantize.py`); `unfuse` undoes both.

State dicts keep the unfused names and order, and `load_state_dict` accepts them, so
checkpoints, `interop.to_hf` and `save_pretrained` see the unfused model. Cross-attention is left
alone (its K/V read a different input than its queries), and so are the attention kinds whose
class leaves `fusable` False (Longformer, block-sparse, MLA, Transformer-XL and Swin's windows,
which have their own forward; linear attention).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .attention.heads import QKV, HeadProjections
from .block import Block
from .ffn.glu import GLUFFN, FusedGLUFFN
from .fused_linear import FusedLinear, Layout
from .matvec import KernelLinear
from .quantize import is_quantized

__all__ = ["FusedGLUFFN", "FusedLinear", "Layout", "fuse", "is_fused", "unfuse"]


def _self_attention_layers(model: nn.Module) -> list[HeadProjections]:
    """Attention modules used as self-attention whose class has the fused layout: a block's
    `self_attn` (src/attnlab/nn/block.py; its cross_attn never is)."""
    return [
        m.self_attn
        for m in model.modules()
        if isinstance(m, Block) and isinstance(m.self_attn, HeadProjections) and m.self_attn.fusable
    ]


def _replace(model: nn.Module, old: type, make) -> int:
    """Replace every submodule of type `old` by make(module); returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is old:
                setattr(parent, name, make(child))
                n += 1
    return n


def fuse(model: nn.Module, alike: Callable[[list[torch.Tensor]], bool] | None = None) -> nn.Module:
    """Fuse `model`'s Q/K/V and gate/up projections in place (see the module docstring); returns
    it. Outputs equal the unfused model's; the state dict keeps the unfused names. `alike`: given
    a group's weights ([q, k, v] or [gate, up]), whether to fuse that group (load_gguf(packed=
    True) keeps apart the maps a file stores in different block kinds, Q4_K q/k beside a Q6_K v:
    fused, no one kind would hold them)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse expects a torch.nn.Module, got {type(model).__name__}")
    if is_quantized(model):
        raise ValueError("fuse the model before quantizing it: al.quantize(al.fuse(model), ...)")

    def wanted(*parts: nn.Module) -> bool:
        return alike is None or alike([p.weight.detach() for p in parts])

    for attn in _self_attention_layers(model):
        if attn.projection_layout == "fused" or wanted(*(getattr(attn, n) for n in QKV)):
            attn.fuse_projections()
    _replace(model, GLUFFN, lambda m: m.fused() if wanted(m.gate_proj, m.up_proj) else m)
    for m in model.modules():  # the rest: the same Linear, its decode rows through the kernel
        if type(m) is nn.Linear:
            m.__class__ = KernelLinear
    return model


def unfuse(model: nn.Module) -> nn.Module:
    """Undo `fuse` in place: separate q_proj / k_proj / v_proj and gate_proj / up_proj again."""
    if is_quantized(model):
        raise ValueError("unfuse works on float weights; this model is quantized")
    for m in model.modules():
        if isinstance(m, HeadProjections) and m.fusable:
            m.unfuse_projections()
    _replace(model, FusedGLUFFN, FusedGLUFFN.unfused)
    for m in model.modules():
        if type(m) is KernelLinear:
            m.__class__ = nn.Linear
    return model


def is_fused(model: nn.Module) -> bool:
    return any(isinstance(m, FusedLinear) for m in model.modules())
