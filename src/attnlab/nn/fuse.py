"""Fused projections for inference: one matmul where the model holds several over the same input.

    x ─ q_proj ─┐                          x ─ qkv_proj ─ split ─ q, k, v
    x ─ k_proj ─┼─ ...        becomes
    x ─ v_proj ─┘
    x ─ gate_proj ─┐                       x ─ gate_up_proj ─ chunk ─ act(g) · u ─ down_proj
    x ─ up_proj ───┴─ act(g) · u ─ ...

The same trick as gpt-fast's and vLLM's `QKVParallelLinear`: the concatenated weight computes
every output column with the same dot product as before, so the outputs are unchanged (up to the
matmul's blocking order) while a decoding step launches one matmul instead of three (two), reads
the input once and pays one call's overhead. It is a module swap done from outside (STYLE.md,
item 2): `fuse(model)` rewrites self-attention layers (`src/attnlab/nn/attention/layer.py` takes
its fused branch when `qkv_proj` is present) and replaces every gated FFN
(`src/attnlab/nn/ffn/glu.py`, MoE experts included) by `FusedGLUFFN`; `unfuse` undoes both.

The weights keep their meaning and their names: a fused module's `state_dict()` splits the fused
weight back into q_proj / k_proj / v_proj (gate_proj / up_proj), and `load_state_dict` accepts
those names, so checkpoints, `interop.to_hf` and `save_pretrained` see the unfused model.
Cross-attention is left alone (its K/V read a different input than its queries), and so are
attention subclasses with their own forward (Longformer, block-sparse, MLA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .attention.layer import Attention
from .ffn.glu import GLUFFN


@dataclass(frozen=True)
class Layout:
    """What a fused Linear concatenates: `parts` names the maps, `sizes` their output widths,
    `biased` which of them had a bias (a missing one is a zero slice of the fused bias)."""

    parts: tuple[str, ...]
    sizes: tuple[int, ...]
    biased: tuple[bool, ...]

    def export(self, state: dict[str, Any], own: str, parent: str) -> None:
        """Replace `own`weight / bias in a state dict by each part's, `parent`part.weight ...,
        where the fused entries stood (so the order is the unfused model's)."""
        w, b = state[own + "weight"], state.get(own + "bias")
        parts = {}
        for i, (name, wp) in enumerate(zip(self.parts, w.split(self.sizes), strict=True)):
            parts[f"{parent}{name}.weight"] = wp
            if self.biased[i]:
                parts[f"{parent}{name}.bias"] = b.split(self.sizes)[i]
        items = list(state.items())
        state.clear()
        for key, value in items:
            if key == own + "weight":
                state.update(parts)
            elif key != own + "bias":
                state[key] = value

    def absorb(self, state: dict[str, Any], own: str, parent: str, bias: bool) -> None:
        """The inverse of `export`: the parts' tensors in `state` become `own`weight / bias."""
        keys = [f"{parent}{name}.weight" for name in self.parts]
        if not all(k in state for k in keys):
            return  # fused names already, or missing: load_state_dict reports what is missing
        w = [state.pop(k) for k in keys]
        state[own + "weight"] = torch.cat(w)
        if bias:
            bs = []
            for name, wp, biased in zip(self.parts, w, self.biased, strict=True):
                b = state.pop(f"{parent}{name}.bias", None) if biased else None
                bs.append(b if b is not None else wp.new_zeros(wp.shape[0]))
            state[own + "bias"] = torch.cat(bs)


class FusedLinear(nn.Linear):
    """Several Linear maps of one input as one, concatenated along the output (`layout`)."""

    def __init__(self, parts: list[tuple[str, nn.Linear]]) -> None:
        first = parts[0][1]
        any_bias = any(p.bias is not None for _, p in parts)
        out = sum(p.out_features for _, p in parts)
        w = first.weight
        super().__init__(first.in_features, out, bias=any_bias, device=w.device, dtype=w.dtype)
        self.layout = Layout(
            tuple(name for name, _ in parts),
            tuple(p.out_features for _, p in parts),
            tuple(p.bias is not None for _, p in parts),
        )
        with torch.no_grad():
            self.weight.copy_(torch.cat([p.weight for _, p in parts]))  # (Σ out, in)
            if any_bias:
                self.bias.copy_(
                    torch.cat(
                        [
                            p.bias if p.bias is not None else w.new_zeros(p.out_features)
                            for _, p in parts
                        ]
                    )
                )
        self.weight.requires_grad_(first.weight.requires_grad)

    def split(self) -> dict[str, nn.Linear]:
        """The unfused Linear maps, as new modules with copies of the weights."""
        out, lay = {}, self.layout
        ws = self.weight.detach().split(lay.sizes)
        bs = self.bias.detach().split(lay.sizes) if self.bias is not None else [None] * len(ws)
        for name, w, b, biased in zip(lay.parts, ws, bs, lay.biased, strict=True):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=biased, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
                if biased:
                    lin.bias.copy_(b)
            out[name] = lin
        return out


def _fused_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children holding a fused weight: FusedLinear, or a quantized copy of one (which keeps its
    `layout`: src/attnlab/nn/quantize.py)."""
    return [
        (n, m) for n, m in module.named_children() if isinstance(getattr(m, "layout", None), Layout)
    ]


def _export_hook(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    for name, fused in _fused_children(module):
        fused.layout.export(state, f"{prefix}{name}.", prefix)


def _absorb_hook(module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
    for name, fused in _fused_children(module):
        fused.layout.absorb(state, f"{prefix}{name}.", prefix, fused.bias is not None)


def _keep_names(module: nn.Module) -> None:
    """Make `module`'s state dict use the unfused names (once per module)."""
    if not getattr(module, "_fuse_hooks", False):
        module.register_state_dict_post_hook(_export_hook)
        module.register_load_state_dict_pre_hook(_absorb_hook)
        module._fuse_hooks = True


class FusedGLUFFN(nn.Module):
    """GLUFFN (src/attnlab/nn/ffn/glu.py) with gate_proj and up_proj as one `gate_up_proj`."""

    def __init__(self, glu: GLUFFN) -> None:
        super().__init__()
        self.act = glu.act  # children in GLUFFN's order, gate_up_proj where gate_proj stood
        self.gate_up_proj = FusedLinear([("gate_proj", glu.gate_proj), ("up_proj", glu.up_proj)])
        self.down_proj, self.dropout = glu.down_proj, glu.dropout
        _keep_names(self)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (..., 2·d_ff) -> 2 × (..., d_ff)
        return self.down_proj(self.dropout(self.act(gate) * up)), None

    def unfused(self) -> GLUFFN:
        parts = self.gate_up_proj.split()
        glu = GLUFFN(d_model=1, d_ff=1)  # shell; every submodule is replaced below
        glu.act, glu.dropout, glu.down_proj = self.act, self.dropout, self.down_proj
        glu.gate_proj, glu.up_proj = parts["gate_proj"], parts["up_proj"]
        return glu


QKV = ("q_proj", "k_proj", "v_proj")


def _first(module: nn.Module, names: list[str]) -> None:
    """Move children `names` to the front of `module`'s children (Attention creates q/k/v first),
    so parameters and state dicts come in the order of a model that was never fused."""
    rest = {k: v for k, v in module._modules.items() if k not in names}
    module._modules = {**{n: module._modules[n] for n in names}, **rest}


def _fusable(attn: nn.Module) -> bool:
    """A self-attention layer whose forward is Attention's own (so it has the fused branch)."""
    return (
        isinstance(attn, Attention)
        and type(attn).forward is Attention.forward
        and isinstance(getattr(attn, "q_proj", None), nn.Linear)
    )


def _self_attention_layers(model: nn.Module) -> list[nn.Module]:
    """Attention modules used as self-attention: a block's `self_attn`; cross_attn is never."""
    return [
        m.self_attn
        for m in model.modules()
        if isinstance(getattr(m, "self_attn", None), nn.Module) and _fusable(m.self_attn)
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


def fuse(model: nn.Module) -> nn.Module:
    """Fuse `model`'s Q/K/V and gate/up projections in place (see the module docstring); returns
    it. Outputs equal the unfused model's; the state dict keeps the unfused names."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse expects a torch.nn.Module, got {type(model).__name__}")
    if any(type(m).__name__ in ("Int8Linear", "Bf16Linear") for m in model.modules()):
        raise ValueError("fuse the model before quantizing it: al.quantize(al.fuse(model), ...)")
    for attn in _self_attention_layers(model):
        parts = [(n, getattr(attn, n)) for n in QKV]
        attn.qkv_proj = FusedLinear(parts)
        for n, _ in parts:
            delattr(attn, n)
        _first(attn, ["qkv_proj"])  # where q_proj stood: state dicts keep their order
        _keep_names(attn)
    _replace(model, GLUFFN, FusedGLUFFN)
    return model


def unfuse(model: nn.Module) -> nn.Module:
    """Undo `fuse` in place: separate q_proj / k_proj / v_proj and gate_proj / up_proj again."""
    if any(type(m).__name__ in ("Int8Linear", "Bf16Linear") for m in model.modules()):
        raise ValueError("unfuse works on float weights; this model is quantized")
    for m in model.modules():
        qkv = getattr(m, "qkv_proj", None)
        if isinstance(m, Attention) and isinstance(qkv, FusedLinear):
            for name, lin in qkv.split().items():
                setattr(m, name, lin)
            del m.qkv_proj
            _first(m, list(QKV))
    _replace(model, FusedGLUFFN, FusedGLUFFN.unfused)
    return model


def is_fused(model: nn.Module) -> bool:
    return any(isinstance(m, FusedLinear) for m in model.modules())
