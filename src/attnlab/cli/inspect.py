"""`attnlab inspect`: an architecture summary of a preset, a .gguf file, a run directory (or one of
its checkpoints) or an HF-format folder: what the other commands take, read without the weights.

Components, sizes, exact parameter count (built on the meta device) and, for a MoE, the
parameters one token uses (`active_parameters`: all but the routed experts it is not sent to;
Mixtral 8x7B: 12.9B of 46.7B, arXiv:2401.04088 section 2.1). Then the KV cache, the number
that decides how many tokens fit in memory when decoding, layer kind by layer kind
(`kv_layers`): a global layer stores 2·H_kv·D values per token for the whole sequence (GQA/MQA
shrink it by n_heads / n_kv_heads); a sliding-window layer the same per token up to its window
W, then W tokens' worth whatever the length (src/attnlab/cache/sliding.py, a ring of W slots);
MLA one latent of kv_lora_rank + qk_rope_head_dim values per token (src/attnlab/cache/latent.py).
So a model's bytes per token hold only while the sequence is shorter than every window; past
that `kv_bytes_at` gives the cache of one sequence at a length. Last, what MHA, GQA, MQA and MLA
would cache at the same size (DeepSeek-V2, arXiv:2405.04434, Table 1).
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .. import presets
from ..config import MLAConfig, ModelConfig, MoEFFN
from . import add_command
from .numbers import integer


def count_parameters(cfg: ModelConfig) -> int:
    """build.py's exact count (the model built on the meta device), with a mixture of experts
    built with as few routed experts as its routing allows and the rest added by hand: each
    expert more is one expert FFN and one router row (d_model weights, a bias with router_bias)
    in every sparse block. Building DeepSeek-V3's 14,848 experts, even on the meta device, took
    most of `attnlab presets`' 20 s; tests/cli/test_presets_cli.py checks the sum against the
    full build for every MoE preset."""
    from ..build import count_parameters as count  # imported on use: it needs torch

    f = cfg.ffn
    if not isinstance(f, MoEFFN) or not sparse_layers(cfg):
        return count(cfg)
    fewest = _fewest_experts(f)
    per_expert = _expert_parameters(cfg) + cfg.d_model + (1 if f.router_bias else 0)
    built = count(cfg.merged(ffn={"n_experts": fewest}))
    return built + sparse_layers(cfg) * (f.n_experts - fewest) * per_expert


def _fewest_experts(f: MoEFFN) -> int:
    """The fewest routed experts `f`'s groups and top-k allow (MoEFFN._groups): a multiple of
    n_groups whose groups hold top_k among top_k_groups of them, 2 a group for "top2-sum"."""
    per_group = max(-(-f.top_k // f.top_k_groups), 2 if f.group_score == "top2-sum" else 1)
    return min(f.n_experts, f.n_groups * per_group)


def kv_bytes(layers: int, kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    from ..cache.base import kv_bytes as per_token

    return per_token(layers, kv_heads, head_dim, bytes_per_value)


def resolve(target: str) -> tuple[str, ModelConfig]:
    """(label, config) of what the other commands take, and presets; no weights are read:

    a preset name      attnlab presets lists them
    a .gguf file       its metadata (also PACKAGE/FILE.gguf of an installed package)
    a run directory    its best (else last) checkpoint's config.json; a checkpoint folder too
    an HF folder       config.json, through the converter of its model_type
    """
    path = Path(target)
    if path.suffix == ".gguf":
        from ..interop.gguf import gguf_file_config
        from ..interop.pretrained import locate_gguf

        hf, cfg = gguf_file_config(locate_gguf(target))
        return f"{target} (GGUF, {hf['model_type']})", cfg
    if path.is_dir():
        return _folder(path)
    if path.exists():
        raise FileNotFoundError(f"{path} is neither a folder nor a .gguf file: {_TAKES}")
    if target not in presets.names() and ("/" in target or target.startswith(".")):
        raise FileNotFoundError(f"{target} does not exist: {_TAKES}")
    return target, presets.get(target)


_TAKES = (
    "pass a preset name (attnlab presets lists them), a .gguf file, a run directory of attnlab "
    "train (or one of its checkpoint folders) or an HF-format folder (config.json)"
)


def _folder(path: Path) -> tuple[str, ModelConfig]:
    """A run directory, a checkpoint folder (manifest.json beside attnlab's config.json) or an
    HF-format folder (transformers' config.json)."""
    from ..train import checkpoint as ckpt

    folder = ckpt.best_or_last(path) or (path if (path / ckpt.MANIFEST).is_file() else None)
    if folder is not None:
        return f"{folder} (attnlab checkpoint)", ckpt.load_config(folder)
    if (path / "config.json").is_file():
        from ..interop.pretrained import _read_config

        conv, cfg = _read_config(path)
        return f"{path} ({conv.model_type})", cfg
    runs = sorted(p.name for p in path.iterdir() if ckpt.ckpt_folder(p))
    if runs:  # a lab folder holds runs: name one of them
        more = " ..." if len(runs) > 4 else ""
        raise FileNotFoundError(
            f"{path} holds the runs {', '.join(runs[:4])}{more}, not one model: inspect one of "
            f"them, e.g. attnlab inspect {path / runs[0]}"
        )
    raise FileNotFoundError(
        f"{path} holds no checkpoint (best/ or last/ with manifest.json) and no config.json: "
        f"{_TAKES}"
    )


def _cached_layers(cfg: ModelConfig) -> int:
    return cfg.decoder_layers if cfg.arch == "encoder-decoder" else cfg.n_layers


@dataclass(frozen=True)
class KVLayers:
    """The cached self-attention layers of one kind: `layers` of them, each storing `per_token`
    bytes per token of one sequence; `window` caps how many tokens a layer keeps (None: all)."""

    kind: str  # "global", "sliding" or "latent" (MLA)
    layers: int
    per_token: int
    window: int | None = None

    def bytes_at(self, length: int) -> int:
        """These layers' cache for one sequence of `length` tokens."""
        kept = length if self.window is None else min(length, self.window)
        return self.layers * self.per_token * kept


def kv_layers(cfg: ModelConfig, bytes_per_value: int) -> list[KVLayers]:
    """The decoder's cached layers by kind: global ones, sliding ones per window (from
    `attention.sliding_window`, or each layer's `layer_pattern` entry), MLA's latent ones."""
    n, a = _cached_layers(cfg), cfg.attention
    if isinstance(a, MLAConfig):
        return [KVLayers("latent", n, (a.kv_lora_rank + a.qk_rope_head_dim) * bytes_per_value)]
    per = kv_bytes(1, cfg.kv_heads, cfg.attn_head_dim, bytes_per_value)
    pattern = cfg.layer_pattern
    if pattern is None:
        windows = Counter({a.sliding_window: n})
    else:
        windows = Counter(pattern[i % len(pattern)].sliding_window for i in range(n))
    out = [KVLayers("global", windows.pop(None), per)] if None in windows else []
    for w, count in sorted(windows.items()):
        out.append(KVLayers("sliding", count, per, w))
    return out


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_value: int) -> int:
    """K and V of every self-attention layer that caches them, for one token of one sequence
    while the sequence is shorter than every window; for MLA its latent cache's entry,
    L · (kv_lora_rank + qk_rope_head_dim) values."""
    return sum(k.layers * k.per_token for k in kv_layers(cfg, bytes_per_value))


def kv_bytes_at(cfg: ModelConfig, length: int, bytes_per_value: int) -> int:
    """The KV cache of one sequence of `length` tokens: sliding layers hold at most their
    window, global and latent layers every token."""
    return sum(k.bytes_at(length) for k in kv_layers(cfg, bytes_per_value))


def _expert_parameters(cfg: ModelConfig) -> int:
    """One routed expert's parameters: GLU gate, up and down (3·d·d_ff; biases 2·d_ff + d),
    dense in and out (2·d·d_ff; biases d_ff + d), as src/attnlab/nn/ffn/glu.py and dense.py
    build them."""
    e, d, f = cfg.ffn.expert, cfg.d_model, cfg.ffn_dim
    if e.kind == "glu":
        return 3 * d * f + (2 * f + d if e.bias else 0)
    return 2 * d * f + (f + d if e.bias else 0)


def sparse_layers(cfg: ModelConfig) -> int:
    """Blocks holding routed experts, over every stack (DeepSeek's first dense blocks and
    Qwen-MoE's mlp_only_layers hold one dense FFN instead); 0 without MoE."""
    f = cfg.ffn
    if not isinstance(f, MoEFFN):
        return 0
    stacks = [cfg.n_layers] + ([cfg.decoder_layers] if cfg.arch == "encoder-decoder" else [])
    return sum(not f.is_dense(i) for n in stacks for i in range(n))


def active_parameters(cfg: ModelConfig, total: int | None = None) -> int:
    """Parameters one token's forward pass uses: `total` (count_parameters) less, in every
    sparse block, the n_experts - top_k routed experts it is not sent to (shared experts,
    routers, attention, embeddings and the output head all count, as Mixtral's 12.9B; GPT-OSS's
    3.6B and DeepSeek-V3's 37B leave the input embedding table out, a lookup of one row, which
    the summary also shows). Equal to total without MoE."""
    total = count_parameters(cfg) if total is None else total
    f = cfg.ffn
    if not isinstance(f, MoEFFN):
        return total
    return total - sparse_layers(cfg) * (f.n_experts - f.top_k) * _expert_parameters(cfg)


def kv_bytes_compared(cfg: ModelConfig, bytes_per_value: int) -> dict[str, int]:
    """Bytes per token of the same layers, heads and head width d_h under each attention kind:
    MHA (2·H·d_h per layer), GQA with 8 K/V heads (Llama-2-70B's; the model's own count when it
    is GQA), MQA (2·d_h) and MLA (d_c + d_R: the model's own, else DeepSeek-V2's proportions
    d_c = 4·d_h, d_R = d_h / 2, section 2.1.4). d_h is head_dim, or MLA's qk_nope_head_dim (the
    paper's d_h, Table 1)."""
    L, H, a = _cached_layers(cfg), cfg.n_heads, cfg.attention
    mla = isinstance(a, MLAConfig)
    d_h = a.qk_nope_head_dim if mla else cfg.attn_head_dim
    groups = cfg.kv_heads if 1 < cfg.kv_heads < H else min(8, H)
    latent = a.kv_lora_rank + a.qk_rope_head_dim if mla else 4 * d_h + d_h // 2
    return {
        "MHA": kv_bytes(L, H, d_h, bytes_per_value),
        f"GQA ({groups} K/V heads)": kv_bytes(L, groups, d_h, bytes_per_value),
        "MQA": kv_bytes(L, 1, d_h, bytes_per_value),
        "MLA": L * latent * bytes_per_value,
    }


def summarize(cfg: ModelConfig) -> list[tuple[str, str]]:
    f = cfg.ffn
    ffn = (
        f"{f.kind} ({f.activation})"
        if not isinstance(f, MoEFFN)
        else (
            f"MoE: {f.n_experts} x {f.expert.kind} ({f.expert.activation}), top-{f.top_k}, {f.routing}"
            + (f", {f.n_shared_experts} shared" if f.n_shared_experts else "")
            + (f", weights x {f.routed_scale:g}" if f.routed_scale != 1 else "")
            + (f", top-{f.top_k_groups} of {f.n_groups} groups" if f.n_groups > 1 else "")
            + (
                f", first {f.dense_layers} dense (d_ff {f.dense_d_ff or cfg.ffn_dim})"
                if f.dense_layers
                else ""
            )
            + f", {f.balance_loss} balance loss"
        )
    )
    pos = cfg.positional
    total = count_parameters(cfg)
    rows = [
        ("architecture", cfg.arch),
        (
            "layers",
            str(cfg.n_layers)
            + (f" + {cfg.decoder_layers} decoder" if cfg.arch == "encoder-decoder" else ""),
        ),
        ("d_model / d_ff", f"{cfg.d_model} / {cfg.ffn_dim}"),
        ("heads (q / kv) x head_dim", _heads(cfg)),
        ("vocabulary", f"{cfg.vocab_size:,}"),
        (
            "positional",
            pos.kind + "".join(f", {k}={v}" for k, v in pos.to_dict().items() if k != "kind"),
        ),
        (
            "attention",
            ", ".join(  # what this model sets: its kind, then each field off its default
                f"{k}={v}"
                for k, v in {
                    "kind": cfg.attention.kind,
                    **cfg.attention.model_dump(mode="json", exclude_defaults=True),
                }.items()
            ),
        ),
        ("norm", f"{cfg.norm.kind} (eps {cfg.norm.eps}), {cfg.norm_placement}-norm"),
        ("FFN", ffn),
        ("residual", cfg.residual),
        ("output head", _head(cfg)),
        ("parameters", f"{total:,}"),
    ]
    if cfg.frontend is not None:  # what the inputs are, before the vocabulary row
        rows.insert(4, ("frontend", f"{cfg.frontend.kind}: {cfg.frontend.summary}"))
    if isinstance(f, MoEFFN):
        active = active_parameters(cfg, total)
        words = (
            f"{active:,} of {total:,} ({active / total:.1%}): top-{f.top_k} of "
            f"{f.n_experts} routed experts in {sparse_layers(cfg)} blocks"
        )
        if not cfg.tie_embeddings and cfg.vocab_size:  # as several cards count it
            words += f"; {active - cfg.vocab_size * cfg.d_model:,} without the input embeddings"
        rows.append(("active per token", words))
    if cfg.arch != "encoder":
        rows += _kv_rows(cfg)
    return rows


# the lengths the cache of one sequence is shown at
LENGTHS = (4096, 32768, 131072)


def _kv_rows(cfg: ModelConfig) -> list[tuple[str, str]]:
    """Bytes per token (and how long they hold), the cache by layer kind, at a few lengths."""
    kinds = kv_layers(cfg, 2)
    windows = [k.window for k in kinds if k.window is not None]
    per_token = (
        f"{kv_bytes_per_token(cfg, 2):,} B in bf16/fp16, {kv_bytes_per_token(cfg, 4):,} B in fp32"
    )
    if windows:  # the rate holds up to the shortest window
        after = sum(k.layers * k.per_token for k in kinds if k.window is None)
        tail = "constant" if not after else f"{after:,} B/token in bf16 (the global layers)"
        per_token += f", up to {min(windows):,} tokens (the window); then {tail}"
    rows = [("KV cache per token", per_token)]
    rows.append(("KV cache by layer, bf16", "; ".join(_kind_words(k) for k in kinds)))
    at = ", ".join(f"{n:,} tokens {_mib(kv_bytes_at(cfg, n, 2))}" for n in LENGTHS)
    rows.append(("KV cache at length", f"{at} (bf16, one sequence)"))
    same = kv_bytes_compared(cfg, 2)
    rows.append(("KV per token, same size", ", ".join(f"{k} {v:,} B" for k, v in same.items())))
    return rows


def _kind_words(k: KVLayers) -> str:
    """ "32 sliding (window 4,096): 4,096 B/token each, at most 16,777,216 B each" (bf16)."""
    if k.kind == "sliding":
        return (
            f"{k.layers} sliding (window {k.window:,}): {k.per_token:,} B/token each up to the "
            f"window, then constant at {k.per_token * k.window:,} B each"
        )
    what = "latent (MLA)" if k.kind == "latent" else "global"
    return f"{k.layers} {what}: {k.per_token:,} B/token each"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _heads(cfg: ModelConfig) -> str:
    a = cfg.attention
    if not isinstance(a, MLAConfig):
        return f"{cfg.n_heads} / {cfg.kv_heads} x {cfg.attn_head_dim}"
    q = "q_proj" if a.q_lora_rank is None else f"q latent {a.q_lora_rank}"
    return (
        f"{cfg.n_heads} x (q/k {a.qk_nope_head_dim} + {a.qk_rope_head_dim} rope, "
        f"v {a.v_head_dim}); MLA: KV latent {a.kv_lora_rank} + shared rope key, {q}"
    )


def _head(cfg: ModelConfig) -> str:
    if cfg.arch != "encoder":
        return "tied to embeddings" if cfg.tie_embeddings else "separate"
    if cfg.num_labels:
        pooler = "dense + tanh pooler, " if cfg.classifier_pooler else ""
        return f"classifier ({pooler}{cfg.num_labels} labels, first token)"
    return "MLM, tied to embeddings" if cfg.mlm_head else "none (hidden states)"


def format_summary(label: str, cfg: ModelConfig) -> str:
    rows = summarize(cfg)
    width = max(len(k) for k, _ in rows)
    return "\n".join([label] + [f"  {k:<{width}}  {v}" for k, v in rows])


def run(args: argparse.Namespace) -> int:
    label, cfg = resolve(args.target)
    print(format_summary(label, cfg))
    if args.kernels:
        from .inspect_kernels import kernel_report

        report = kernel_report(cfg, args.tokens, args.device, args.train, args.padded, args.dtype)
        print("\n".join(report))
    return 0


def register(sub) -> None:
    p = add_command(
        sub, "inspect", "architecture summary of a preset, a .gguf file, a run or an HF folder",
        "Exact parameter count, active parameters per token (mixtures of experts), KV-cache bytes "
        "per token by layer kind (sliding layers capped at their window); no weights are read.",
        examples=(
            "attnlab inspect llama3.1-8b                          # a preset (attnlab presets)",
            "attnlab inspect runs/shakespeare-char                # a run of attnlab train",
            "attnlab inspect SmolLM2-135M-Instruct.Q4_1.gguf      # a llama.cpp file's metadata",
            "attnlab inspect mistral-7b --kernels --tokens 128    # each layer's attention kernel",
        ),
    )  # fmt: skip
    p.add_argument(
        "target",
        metavar="MODEL",
        help="a preset name (attnlab presets), a .gguf file, a run directory or checkpoint "
        "folder of attnlab train, or an HF-format folder (config.json)",
    )
    k = p.add_argument_group("kernels: which attention kernel each layer gets, and why")
    k.add_argument("--kernels", action="store_true", help="run a batch and report the choices")
    k.add_argument("--tokens", type=integer(1), default=64, help="tokens per row (default 64)")
    k.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    k.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the weights' and activations' dtype (default float32)",
    )
    k.add_argument("--train", action="store_true", help="with gradients (training's choices)")
    k.add_argument("--padded", action="store_true", help="the second row left-padded")
    p.set_defaults(func=run)
