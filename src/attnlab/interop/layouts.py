"""Tensor names and fused layouts: the only renaming helpers the converters use.

`move` renames by tables of (source module, target module) pairs ("{i}" runs over the layers),
`rename_prefix` / `strip` / `add_prefix` handle a base-model prefix ("model.", "transformer.",
"bert.") and tied heads, `drop` discards tensors attnlab has no use for, and `split_qkv` /
`merge_qkv` (applied per layer by `unfuse` / `fuse`) translate fused q/k/v projections, and
`unstack_experts` / `stack_experts` a mixture of experts stored as stacked 3-D tensors.
`check_consumed` and `check_loaded` report the tensors that found no place.

`DecoderWeights` is the weights half of a decoder-only converter built from those tables; the
encoder families (src/attnlab/interop/bert.py, src/attnlab/interop/t5.py,
src/attnlab/interop/bart.py) call the helpers themselves.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

from ..config import ModelConfig
from ..errors import problem_list
from .converter import ConversionError, StateDict

Pairs = list[tuple[str, str]]  # (source module, target module); "{i}" = the layer index


def rename_prefix(sd: StateDict, old: str, new: str) -> StateDict:
    """Keys that start with `old` start with `new` instead; the others are kept as they are."""
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in sd.items()}


def strip(sd: StateDict, prefix: str, tied: bool = False) -> StateDict:
    """HF names without the base-model prefix; a tied model's lm_head copy is dropped."""
    sd = rename_prefix(sd, prefix, "")
    if tied:
        sd.pop("lm_head.weight", None)
    return sd


def add_prefix(out: StateDict, prefix: str) -> StateDict:
    """The inverse of `strip`: HF names of the model with its LM head."""
    return {(k if k.startswith("lm_head.") else prefix + k): v for k, v in out.items()}


def drop(
    sd: StateDict, suffixes: tuple[str, ...] = (), prefixes: tuple[str, ...] = ()
) -> StateDict:
    """Without the tensors attnlab has no use for: buffers old checkpoints carry (causal-mask
    tables, rotary inv_freq, position ids) and heads it does not model (BERT's NSP head)."""
    return {k: v for k, v in sd.items() if not (k.endswith(suffixes) or k.startswith(prefixes))}


def with_lm_head(pairs: Pairs, cfg: ModelConfig) -> Pairs:
    """`pairs` plus the output layer when the model has one of its own (untied embeddings)."""
    return pairs + ([] if cfg.tie_embeddings else [("lm_head", "lm_head")])


def move(sd: StateDict, pairs: Pairs, n_layers: int) -> StateDict:
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


def swap(pairs: Pairs) -> Pairs:
    return [(b, a) for a, b in pairs]


def check_consumed(sd: StateDict, what: str) -> None:
    """Raise if `sd` (what `move` and `unfuse` left) holds tensors no table names."""
    if sd:
        raise ConversionError(f"{what}: tensors with no attnlab counterpart: {sorted(sd)[:8]}")


def check_loaded(what: str, missing: list[str], unexpected: list[str]) -> None:
    """Raise, naming both lists, if a load_state_dict left tensors missing or unexpected."""
    problems = [f"missing tensors {missing[:8]}"] if missing else []
    problems += [f"unexpected tensors {unexpected[:8]}"] if unexpected else []
    if problems:
        raise ConversionError(problem_list(f"state dict for {what}", problems))


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


def unstack_experts(sd: StateDict, theirs: str, ours: str, n_experts: int, d_ff: int) -> StateDict:
    """transformers 5's stacked experts of one MoE layer, `theirs`.experts.gate_up_proj
    (E, 2·d_ff, d) = [gate; up] per expert and `theirs`.experts.down_proj (E, d, d_ff), popped
    from `sd`, as attnlab's per-expert `ours`.experts.{e}.gate_proj / up_proj / down_proj
    weights; empty when `sd` stores its experts one by one (the Hub's form, renamed by `move`).
    Mixtral and DeepSeek-V2 (src/attnlab/interop/mixtral.py, deepseek_v2.py)."""
    gate_up = sd.pop(f"{theirs}.experts.gate_up_proj", None)  # (E, 2·d_ff, d)
    down = sd.pop(f"{theirs}.experts.down_proj", None)  # (E, d, d_ff)
    out: StateDict = {}
    for e in range(n_experts if gate_up is not None else 0):
        out[f"{ours}.experts.{e}.gate_proj.weight"] = gate_up[e, :d_ff]
        out[f"{ours}.experts.{e}.up_proj.weight"] = gate_up[e, d_ff:]
        out[f"{ours}.experts.{e}.down_proj.weight"] = down[e]
    return out


def stack_experts(sd: StateDict, ours: str, theirs: str, n_experts: int) -> StateDict:
    """The inverse of `unstack_experts`: attnlab's per-expert weights, popped from `sd`, as the
    stacked `theirs`.experts.gate_up_proj and `theirs`.experts.down_proj."""
    ex = [f"{ours}.experts.{e}" for e in range(n_experts)]
    gate_up = [
        torch.cat([sd.pop(f"{x}.gate_proj.weight"), sd.pop(f"{x}.up_proj.weight")]) for x in ex
    ]
    return {
        f"{theirs}.experts.gate_up_proj": torch.stack(gate_up),  # (E, 2·d_ff, d)
        f"{theirs}.experts.down_proj": torch.stack([sd.pop(f"{x}.down_proj.weight") for x in ex]),
    }


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


class DecoderWeights:
    """`weights_from_hf` / `weights_to_hf` of a decoder-only converter, from its tables:

    prefix   the base model's ("transformer.", "model."), absent from the bare model's names
    pairs    (attnlab module, HF module under prefix); lm_head is added when untied
    qkv      the fused q/k/v module ("h.{i}.self_attention.query_key_value"), "" if separate
    qkv_rows "per-kv-head" ([kv head][q_1..q_group, k, v], BLOOM, GPT-NeoX, Falcon) or
             "stacked" ([q; k; v], MPT, GPT-2)
    buffers  suffixes of tensors old checkpoints carry and attnlab recomputes (masks, inv_freq)

    A family whose names depend on the config overrides `_pairs`; tensors that are not renamed
    one to one (Mixtral's stacked experts) go through `_more_from_hf` / `_more_to_hf`.
    """

    model_type: str
    prefix: str
    pairs: ClassVar[Pairs]
    qkv: str = ""
    qkv_rows: Literal["per-kv-head", "stacked"] = "per-kv-head"
    buffers: tuple[str, ...] = ()

    def _pairs(self, cfg: ModelConfig) -> Pairs:
        return with_lm_head(self.pairs, cfg)

    def _split(self, w: torch.Tensor, cfg: ModelConfig):
        if self.qkv_rows == "stacked":
            return w.chunk(3, dim=0)
        kv = cfg.kv_heads
        return split_qkv(w, kv, cfg.n_heads // kv, cfg.attn_head_dim)

    def _merge(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig):
        if self.qkv_rows == "stacked":
            return torch.cat([q, k, v])
        return merge_qkv(q, k, v, cfg.kv_heads, cfg.attn_head_dim)

    def _more_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        return {}

    def _more_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        return {}

    def weights_from_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = drop(strip(sd, self.prefix, cfg.tie_embeddings), self.buffers)
        out = move(sd, swap(self._pairs(cfg)), cfg.n_layers)
        if self.qkv:
            out.update(unfuse(sd, self.qkv, cfg.n_layers, lambda w: self._split(w, cfg)))
        out.update(self._more_from_hf(sd, cfg))
        check_consumed(sd, self.model_type)
        return out

    def weights_to_hf(self, sd: StateDict, cfg: ModelConfig) -> StateDict:
        sd = dict(sd)
        out = move(sd, self._pairs(cfg), cfg.n_layers)
        if self.qkv:
            out.update(fuse(sd, self.qkv, cfg.n_layers, lambda *qkv: self._merge(*qkv, cfg)))
        out.update(self._more_to_hf(sd, cfg))
        check_consumed(sd, f"{self.model_type} (attnlab side)")
        return add_prefix(out, self.prefix)


def check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise ConversionError naming the tensors holding NaN or ±inf (floating-point ones):
    weights like that load without a word and then decode garbage."""
    bad = [
        name
        for name, t in tensors.items()
        if t.is_floating_point() and t.device.type != "meta" and not torch.isfinite(t).all()
    ]
    if bad:
        raise ConversionError(
            f"{where}: {len(bad)} tensor(s) hold NaN or infinite values ({', '.join(bad[:3])}"
            f"{' ...' if len(bad) > 3 else ''}): the weights are unusable (a damaged file or a "
            f"diverged model); pass allow_nonfinite=True to load them anyway, for debugging"
        )
