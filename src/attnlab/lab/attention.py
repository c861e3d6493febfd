"""`attnlab lab attention RUN_DIR "sentence"`: attention weights of a trained run as heatmaps.

A translation run translates the sentence (greedy) and draws the decoder's cross-attention
(target × source: the soft alignment of Bahdanau et al. 2015, Figure 3) and its
self-attention; a language model draws the self-attention over the sentence. One PNG per kind,
one panel per head of the chosen layer (default: the last).

The weights come from the naive kernel, the only one that forms them
(src/attnlab/nn/attention/kernels/naive.py): `capture` switches the model to it and wraps each
attention layer's forward from outside, asking for the weights — the model itself is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ..nn.attention import set_kernel
from ..nn.attention.layer import Attention


@contextmanager
def capture(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block every softmax attention layer records its (B, H, T, S) weights under its
    module name; the model's kernels and forwards are restored afterwards."""
    weights: dict[str, torch.Tensor] = {}
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Attention)]
    kernels = {n: m.kernel for n, m in layers}
    set_kernel(model, "naive")

    def wrap(name: str, layer: Attention):
        inner = layer.forward

        def forward(x, ctx, memory=None, cache=None, need_weights=False):
            out, w = inner(x, ctx, memory, cache, need_weights=True)
            weights[name] = w.detach().float().cpu()
            return out, (w if need_weights else None)

        return forward

    for name, layer in layers:
        layer.forward = wrap(name, layer)
    try:
        yield weights
    finally:
        for name, layer in layers:
            del layer.forward  # back to the class's forward
            layer.kernel = kernels[name]


def _labels(tok, ids: list[int]) -> list[str]:
    """Each token as text (byte-level pieces decoded), specials by name; spaces shown as ·."""
    out = []
    for i in ids:
        text = tok.decode([i], skip_special_tokens=False) or tok.id_to_token(i) or "?"
        out.append(text.replace(" ", "·").replace("\n", "⏎"))
    return out


def _draw(w: torch.Tensor, rows: list[str], cols: list[str], title: str, heads: list[int], path: Path) -> Path:  # fmt: skip
    """w (H, T, S): one heatmap per head in `heads`."""
    from .plots import _plt

    plt = _plt()
    n = len(heads)
    ncol = min(n, 4)
    nrow = (n + ncol - 1) // ncol
    size = max(3.0, 0.22 * max(len(rows), len(cols)))
    fig, axes = plt.subplots(nrow, ncol, figsize=(size * ncol, size * nrow), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, h in zip(axes.flat, heads, strict=False):
        ax.imshow(w[h].numpy(), cmap="viridis", vmin=0.0, aspect="auto")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _pick(weights: dict[str, torch.Tensor], stack: str, kind: str, layer: int | None) -> tuple[int, torch.Tensor]:  # fmt: skip
    names = [n for n in weights if n.startswith(f"{stack}.blocks.") and n.endswith(kind)]
    if not names:
        raise ValueError(f"the model has no {stack} {kind} layers with weights to draw")
    n_layers = len(names)
    i = n_layers - 1 if layer is None else layer
    if not 0 <= i < n_layers:
        raise ValueError(f"--layer {layer}: the {stack} has layers 0..{n_layers - 1}")
    return i, weights[f"{stack}.blocks.{i}.{kind}"][0]  # (H, T, S)


@torch.no_grad()
def attention_maps(
    run_dir: str | Path,
    sentence: str,
    layer: int | None = None,
    head: int | None = None,
    out: str | Path | None = None,
    data_dir=None,
) -> list[Path]:
    """Draw the attention of `run_dir`'s best checkpoint on `sentence`; returns the PNG paths."""
    from .. import data as D
    from ..decode.generate import generate
    from ..train import checkpoint as ckpt
    from ..train.run import load_tokenizer

    folder = ckpt.find(run_dir, "best")
    model, cfg = ckpt.load(folder)
    model.eval()
    tok = load_tokenizer(folder)
    out = Path(out) if out is not None else Path(run_dir) / "attention"
    out.mkdir(parents=True, exist_ok=True)
    if head is not None and not 0 <= head < cfg.n_heads:
        raise ValueError(f"--head {head}: the model has heads 0..{cfg.n_heads - 1}")
    heads = list(range(cfg.n_heads)) if head is None else [head]
    paths = []
    if cfg.arch == "encoder-decoder":
        ids = D.special_ids(tok)
        batch = D.collate_translation([(D.encode(tok, sentence), [])], ids["pad"], ids["bos"], ids["eos"])  # fmt: skip
        src = batch["input_ids"]
        gen = generate(model, src, max_new_tokens=2 * src.shape[1] + 10, strategy="greedy",
                       eos_token_id=ids["eos"], pad_token_id=ids["pad"],
                       decoder_start_token_id=ids["bos"])  # fmt: skip
        with capture(model) as weights:
            model(src, gen[:, :-1])
        src_l, tgt_l = _labels(tok, src[0].tolist()), _labels(tok, gen[0, 1:].tolist())
        i, w = _pick(weights, "decoder", "cross_attn", layer)
        paths.append(_draw(w, tgt_l, src_l, f"cross-attention, decoder layer {i} (rows: output, columns: source)", heads, out / f"cross-attention-layer{i}.png"))  # fmt: skip
        i, w = _pick(weights, "decoder", "self_attn", layer)
        paths.append(_draw(w, tgt_l, _labels(tok, gen[0, :-1].tolist()), f"decoder self-attention, layer {i}", heads, out / f"decoder-self-attention-layer{i}.png"))  # fmt: skip
        i, w = _pick(weights, "encoder", "self_attn", layer)
        paths.append(_draw(w, src_l, src_l, f"encoder self-attention, layer {i}", heads, out / f"encoder-self-attention-layer{i}.png"))  # fmt: skip
        return paths
    vocab = tok.get_vocab()
    unknown = sorted({c for c in D.encode(tok, sentence) if c is None})
    ids = torch.tensor([D.encode(tok, sentence)])
    if ids.numel() == 0 or unknown:
        raise ValueError(f"the sentence has no tokens this run's tokenizer ({len(vocab)} entries) knows")  # fmt: skip
    with capture(model) as weights:
        model(ids)
    stack = "decoder" if cfg.arch == "decoder" else "encoder"
    i, w = _pick(weights, stack, "self_attn", layer)
    labels = _labels(tok, ids[0].tolist())
    paths.append(_draw(w, labels, labels, f"self-attention, layer {i}", heads, out / f"self-attention-layer{i}.png"))  # fmt: skip
    return paths
