"""Tensor names and fused layouts shared by the decoder-only converters.

`move` renames by tables of (source module, target module) pairs, `strip` / `add_prefix` handle
the base-model prefix ("model.", "transformer.", "gpt_neox.") and tied heads, and
`split_qkv` / `merge_qkv` translate fused q/k/v projections laid out per K/V head.
"""

from __future__ import annotations

import torch

from .base import ConversionError, StateDict


def strip(sd: StateDict, prefix: str, tied: bool) -> StateDict:
    """HF names without the base-model prefix; a tied model's lm_head copy is dropped."""
    sd = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in sd.items()}
    if tied:
        sd.pop("lm_head.weight", None)
    return sd


def add_prefix(out: StateDict, prefix: str) -> StateDict:
    """The inverse of `strip`: HF names of the model with its LM head."""
    return {(k if k.startswith("lm_head.") else prefix + k): v for k, v in out.items()}


def move(sd: StateDict, pairs: list[tuple[str, str]], n_layers: int) -> StateDict:
    """Move tensors named by (source module, target module) pairs out of `sd` (consumed): the
    .weight and .bias of each where present; "{i}" in a pair runs over the layers."""
    out: StateDict = {}
    for src, dst in pairs:
        for i in range(n_layers) if "{i}" in src else (0,):
            s, d = src.format(i=i), dst.format(i=i)
            for leaf in (".weight", ".bias"):
                if s + leaf in sd:
                    out[d + leaf] = sd.pop(s + leaf)
    return out


def swap(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(b, a) for a, b in pairs]


def check_consumed(sd: StateDict, what: str) -> None:
    if sd:
        raise ConversionError(f"{what}: tensors with no attnlab counterpart: {sorted(sd)[:8]}")


def split_qkv(w: torch.Tensor, n_kv: int, group: int, head_dim: int):
    """Rows laid out [kv head][q_1..q_group, k, v][head_dim] -> q, k, v rows. group = 1 is
    BLOOM's and GPT-NeoX's per-head [q, k, v]; Falcon's new architecture groups GQA heads."""
    rest = w.shape[1:]
    x = w.reshape(n_kv, group + 2, head_dim, *rest)
    q = x[:, :group].reshape(n_kv * group * head_dim, *rest)
    return (
        q,
        x[:, group].reshape(n_kv * head_dim, *rest),
        x[:, group + 1].reshape(n_kv * head_dim, *rest),
    )


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv: int, head_dim: int
) -> torch.Tensor:
    """The inverse of `split_qkv`."""
    rest = q.shape[1:]
    parts = [
        q.reshape(n_kv, -1, head_dim, *rest),
        k.reshape(n_kv, 1, head_dim, *rest),
        v.reshape(n_kv, 1, head_dim, *rest),
    ]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def unfuse(sd: StateDict, src: str, n_layers: int, split) -> StateDict:
    """Pop each layer's fused `src` weight/bias and split it into attnlab's q/k/v projections."""
    out: StateDict = {}
    for i in range(n_layers):
        for leaf in ("weight", "bias"):
            key = f"{src.format(i=i)}.{leaf}"
            if key in sd:
                for name, t in zip(("q_proj", "k_proj", "v_proj"), split(sd.pop(key)), strict=True):
                    out[f"decoder.blocks.{i}.self_attn.{name}.{leaf}"] = t
    return out


def fuse(sd: StateDict, dst: str, n_layers: int, merge) -> StateDict:
    """The inverse of `unfuse`: attnlab's q/k/v projections -> each layer's fused tensor."""
    out: StateDict = {}
    for i in range(n_layers):
        for leaf in ("weight", "bias"):
            keys = [
                f"decoder.blocks.{i}.self_attn.{n}.{leaf}" for n in ("q_proj", "k_proj", "v_proj")
            ]
            if keys[0] in sd:
                out[f"{dst.format(i=i)}.{leaf}"] = merge(*(sd.pop(k) for k in keys))
    return out


def drop(sd: StateDict, suffixes: tuple[str, ...]) -> StateDict:
    """Without buffers old checkpoints carry (causal-mask tables, rotary inv_freq)."""
    return {k: v for k, v in sd.items() if not k.endswith(suffixes)}
