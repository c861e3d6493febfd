"""Several Linear maps of one input held as one: the fused form a module may declare for its
projections (q/k/v in src/attnlab/nn/attention/heads.py, gate/up in src/attnlab/nn/ffn/glu.py).

    x ─ q_proj ─┐                          x ─ qkv_proj ─ split ─ q, k, v
    x ─ k_proj ─┼─ ...        is held as
    x ─ v_proj ─┘

The concatenated weight computes every output column with the same dot product as before (up to
the matmul's blocking order), so a decoding step launches one matmul instead of three, reads the
input once and pays one call's overhead (gpt-fast; vLLM's `QKVParallelLinear`).

The weights keep their meaning and their names: a module that holds fused maps says which
(`fused_layouts()`, child name -> `Layout`) and `keep_part_names` gives its `state_dict()` the
parts' names and order (q_proj.weight, k_proj.weight, ...), and makes `load_state_dict` accept
them, so checkpoints, converters and `save_pretrained` see the unfused model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import matvec


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matvec.linear(x, self.weight, self.bias)  # a decode step's rows: the matvec kernel

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


def _export_hook(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    for name, layout in module.fused_layouts().items():
        layout.export(state, f"{prefix}{name}.", prefix)


def _absorb_hook(module: nn.Module, state: dict, prefix: str, *_: Any) -> None:
    for name, layout in module.fused_layouts().items():
        fused = module.get_submodule(name)  # a FusedLinear, or its quantized copy (quantize.py)
        layout.absorb(state, f"{prefix}{name}.", prefix, fused.bias is not None)


def keep_part_names(module: nn.Module) -> None:
    """Make `module`'s state dict use its fused children's part names (module docstring); called
    once, from the constructor of a module that defines `fused_layouts()`."""
    module.register_state_dict_post_hook(_export_hook)
    module.register_load_state_dict_pre_hook(_absorb_hook)


def move_to_front(module: nn.Module, names: list[str]) -> None:
    """Move children `names` to the front of `module`'s children, so that parameters and state
    dicts come in the order of a module that was never fused (its projections first)."""
    rest = {k: v for k, v in module._modules.items() if k not in names}
    module._modules = {**{n: module._modules[n] for n in names}, **rest}
