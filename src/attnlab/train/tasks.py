"""The three tasks of the recipes: data, model sizes from the data, evaluation.

    translation     joint-BPE encoder-decoder; validation loss during training, BLEU (sacreBLEU,
                    beam search) on the test split at the end
    lm              character LM; loss on random validation windows (nanoGPT's estimate_loss)
    classification  encoder-only classifier; accuracy on dev during training, on test at the end

`prepare(recipe, ...)` gives a `Task`: the training batch stream, the sizes the model takes from
the data (vocab_size, pad_token_id, num_labels), the tokenizer, and the evaluation functions.
Given a tokenizer (the one saved in a checkpoint), no tokenizer is trained and no training data
is read unless `train=True`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import data as D
from ..decode.generate import generate, sliding_stream
from .losses import smoothed_cross_entropy_sum
from .recipes import Recipe


@dataclass
class Task:
    recipe: Recipe
    tokenizer: Any  # tokenizers.Tokenizer
    model_sizes: dict[str, Any]  # vocab_size, pad_token_id, num_labels: merged into ModelConfig
    train: Any = None  # the batch stream (None when only evaluating)
    validate: Callable[[torch.nn.Module], dict[str, float]] | None = None
    test: Callable[[torch.nn.Module], dict[str, float]] | None = None
    best_metric: str = "val_loss"
    best_mode: str = "min"
    show: Callable[[torch.nn.Module, list[str]], list[str]] | None = None  # samples -> outputs
    info: dict[str, Any] = field(default_factory=dict)


class IndexBatches:
    """An endless stream of collated batches over a TokenBudgetBatcher's epochs (resumable)."""

    def __init__(self, batcher: D.TokenBudgetBatcher, collate: Callable[[list[int]], dict]):
        self.batcher, self.collate, self._it = batcher, collate, None

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            self._it = iter(self.batcher)
        try:
            idx = next(self._it)
        except StopIteration:  # epoch done: the batcher moved to the next one
            self._it = iter(self.batcher)
            idx = next(self._it)
        return self.collate(idx)

    def state_dict(self) -> dict[str, Any]:
        return self.batcher.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batcher.load_state_dict(state)
        self._it = None


def _fixed_batches(batcher: D.TokenBudgetBatcher, collate, limit: int | None) -> list[dict]:
    out = [collate(idx) for idx in batcher.global_batches(0)]
    return out[:limit] if limit is not None else out


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches) -> float:
    """Mean cross-entropy per label (no smoothing) over batches."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        loss, n = smoothed_cross_entropy_sum(model(**batch).logits, labels)
        total, count = total + float(loss), count + n
    return total / max(count, 1)


def prepare(
    recipe: Recipe,
    data_dir: str | Path | None = None,
    tokenizer: Any = None,
    train: bool = True,
    rank: int = 0,
    world_size: int = 1,
) -> Task:
    kind = recipe.data.kind
    fn = {"translation": _translation, "lm": _lm, "classification": _classification}[kind]
    return fn(recipe, data_dir, tokenizer, train, rank, world_size)


# --- translation ----------------------------------------------------------------------------


def bleu(hyps: list[str], refs: list[str]) -> dict[str, float]:
    """sacreBLEU: cased on detokenized text (the WMT protocol), and lower-cased 13a-tokenized."""
    from sacrebleu.metrics import BLEU

    return {
        "bleu": BLEU().corpus_score(hyps, [refs]).score,
        "bleu_lc": BLEU(tokenize="13a", lowercase=True).corpus_score(hyps, [refs]).score,
    }


def translate(
    model, tok, sources: list[str], recipe: Recipe, batch_size: int = 64, beams: int | None = None
) -> list[str]:
    """Beam-search translations of `sources` (batched by length, returned in input order)."""
    ids = D.special_ids(tok)
    dec = recipe.decoding
    device = next(model.parameters()).device
    encoded = [D.encode(tok, s) for s in sources]
    order = sorted(range(len(sources)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(sources)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = D.collate_translation(
            [(encoded[i], []) for i in chunk], ids["pad"], ids["bos"], ids["eos"]
        )
        src = batch["input_ids"].to(device)
        mask = batch["attention_mask"].to(device)
        n_beams = beams if beams is not None else dec.num_beams
        gen = generate(
            model,
            src,
            max_new_tokens=int(dec.max_len_a * src.shape[1] + dec.max_len_b),
            strategy="beam" if n_beams > 1 else "greedy",
            attention_mask=mask,
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
            decoder_start_token_id=ids["bos"],
            **({"num_beams": n_beams, "length_penalty": dec.length_penalty} if n_beams > 1 else {}),
        )
        for i, row in zip(chunk, gen[:, 1:], strict=True):
            out[i] = D.decode(tok, row)
    return out


def _translation(recipe, data_dir, tok, train, rank, world_size) -> Task:
    d = recipe.data
    pairs = lambda split: D.translation_pairs(d.dataset, d.src, d.tgt, split, data_dir)  # noqa: E731
    lower = (lambda s: s.lower()) if d.lowercase else (lambda s: s)
    train_pairs = pairs("train") if (train or tok is None) else None
    if tok is None:
        texts = [lower(x) for p in train_pairs for x in p]
        tok = D.train_tokenizer(d.tokenizer, texts, d.vocab_size)
    ids = D.special_ids(tok)

    def examples(ps):
        src = D.encode_batch(tok, [lower(s) for s, _ in ps])
        tgt = D.encode_batch(tok, [lower(t) for _, t in ps])
        return list(zip(src, tgt, strict=True))

    def collate(exs):
        return lambda idx: D.collate_translation(
            [exs[i] for i in idx], ids["pad"], ids["bos"], ids["eos"]
        )

    task = Task(recipe, tok, {"vocab_size": tok.get_vocab_size(), "pad_token_id": ids["pad"]})
    if train:
        exs = [e for e in examples(train_pairs) if max(len(e[0]), len(e[1])) <= d.max_len]
        batcher = D.TokenBudgetBatcher(
            D.translation_lengths(exs), recipe.batch.max_tokens, recipe.seed,
            rank=rank, world_size=world_size,
        )  # fmt: skip
        task.train = IndexBatches(batcher, collate(exs))
        task.info["train_pairs"] = f"{len(exs)} of {len(train_pairs)} (<= {d.max_len} tokens)"
    valid_pairs = pairs(d.valid_split)
    vexs = examples(valid_pairs)
    vbatcher = D.TokenBudgetBatcher(
        D.translation_lengths(vexs), recipe.batch.max_tokens, 0, shuffle=False
    )
    vbatches = _fixed_batches(vbatcher, collate(vexs), recipe.eval.batches)

    def validate(model):
        metrics = {"val_loss": mean_loss(model, vbatches)}
        if recipe.eval.bleu_every_eval:
            hyps = translate(model, tok, [s for s, _ in valid_pairs], recipe, beams=1)
            metrics["val_bleu"] = bleu(hyps, [t for _, t in valid_pairs])["bleu"]
        return metrics

    def test(model):
        test_pairs = pairs(d.test_split)
        hyps = translate(model, tok, [lower(s) for s, _ in test_pairs], recipe)
        scores = bleu(hyps, [lower(t) for _, t in test_pairs])
        return {f"{d.test_split}_{k}": v for k, v in scores.items()}

    task.validate, task.test = validate, test
    if recipe.eval.bleu_every_eval:
        task.best_metric, task.best_mode = "val_bleu", "max"
    task.show = lambda model, sources: translate(model, tok, [lower(s) for s in sources], recipe)
    return task


# --- character language model ----------------------------------------------------------------


def _lm(recipe, data_dir, tok, train, rank, world_size) -> Task:
    d = recipe.data
    train_text, val_text = D.char_corpus(d.dataset, data_dir)
    if tok is None:
        tok = D.train_tokenizer("char", [train_text], None, special_tokens=())
    vocab = tok.get_vocab()

    def to_ids(text: str) -> torch.Tensor:
        unknown = sorted(set(text) - set(vocab))
        if unknown:
            raise ValueError(
                f"characters {''.join(unknown)!r} are not in the vocabulary (the {len(vocab)} "
                f"characters of the {d.dataset} training text): remove them from the input"
            )
        return torch.tensor([vocab[c] for c in text], dtype=torch.long)

    task = Task(recipe, tok, {"vocab_size": tok.get_vocab_size()})
    if train:
        task.train = D.LMBatcher(
            to_ids(train_text), d.context, recipe.batch.size, recipe.seed, rank, world_size
        )
    val = D.LMBatcher(to_ids(val_text), d.context, recipe.batch.size, seed=0)
    n_eval = recipe.eval.batches or 200
    vbatches = [val.batch(i) for i in range(n_eval)]
    task.validate = lambda model: {"val_loss": mean_loss(model, vbatches)}
    task.test = task.validate

    def show(model, prompts):
        # nanoGPT's sample loop: the window slides over the last `context` characters, so the
        # text may run past the learned position table
        dec = recipe.decoding
        device = next(model.parameters()).device
        outs = []
        for i, p in enumerate(prompts):
            ids = to_ids(p or "\n")[None].to(device)
            new = sliding_stream(
                model, ids, dec.sample_tokens, d.context, dec.temperature, dec.top_k,
                seed=recipe.seed + i,
            )  # fmt: skip
            text = torch.cat([ids[0], torch.stack([t[0] for t in new])])
            outs.append(D.decode(tok, text, until_eos=False))
        return outs

    task.show = show
    return task


# --- classification --------------------------------------------------------------------------


def _classification(recipe, data_dir, tok, train, rank, world_size) -> Task:
    d = recipe.data
    split = lambda s: D.classification(d.dataset, s, data_dir)  # noqa: E731
    trains_tok = tok is None and d.tokenizer != "pretrained"
    train_exs = split("train") if (train or trains_tok) else None
    if tok is None and d.tokenizer == "pretrained":
        from ..interop import pretrained_tokenizer

        tok = pretrained_tokenizer(recipe.model.pretrained)
    elif tok is None:
        tok = D.train_tokenizer(d.tokenizer, [t for t, _ in train_exs], d.vocab_size)
    ids = D.special_ids(tok)
    lacking = [role for role in ("pad", "bos", "eos") if role not in ids]
    if lacking:
        raise ValueError(
            f"the tokenizer has no special token for {', '.join(lacking)} (a classifier's input "
            f"is [bos] text [eos], padded): its special tokens are "
            f"{sorted(t.content for t in tok.get_added_tokens_decoder().values() if t.special)}; "
            f"known spellings: " + "; ".join(f"{r} {D.ROLE_NAMES[r]}" for r in lacking)
        )

    def examples(exs):
        return list(zip(D.encode_batch(tok, [t for t, _ in exs]), [y for _, y in exs], strict=True))

    def collate(exs):
        return lambda idx: D.collate_classification(
            [exs[i] for i in idx], ids["pad"], ids["bos"], ids["eos"], d.max_len
        )

    def lengths(exs):
        return D.classification_lengths(exs, bos=True, eos=True, max_len=d.max_len)

    task = Task(
        recipe, tok,
        {"vocab_size": tok.get_vocab_size(), "pad_token_id": ids["pad"],
         "num_labels": D.num_labels(d.dataset)},
        best_metric=f"{d.valid_split}_accuracy", best_mode="max",
    )  # fmt: skip
    if train:
        exs = examples(train_exs)
        batcher = D.TokenBudgetBatcher(
            lengths(exs), recipe.batch.max_tokens, recipe.seed, rank=rank, world_size=world_size
        )
        task.train = IndexBatches(batcher, collate(exs))

    def evaluator(name):
        exs = examples(split(name))
        batcher = D.TokenBudgetBatcher(lengths(exs), recipe.batch.max_tokens, 0, shuffle=False)
        batches = _fixed_batches(batcher, collate(exs), None)

        @torch.no_grad()
        def run(model):
            device = next(model.parameters()).device
            right = total = 0
            for b in batches:
                logits = model(b["input_ids"].to(device), b["attention_mask"].to(device)).logits
                right += int((logits.argmax(-1).cpu() == b["labels"]).sum())
                total += len(b["labels"])
            return {f"{name}_loss": mean_loss(model, batches), f"{name}_accuracy": right / total}

        return run

    task.validate, task.test = evaluator(d.valid_split), evaluator(d.test_split)

    @torch.no_grad()
    def show(model, texts):  # "positive (p 0.97)" for each sample text
        device = next(model.parameters()).device
        names = D.label_names(d.dataset)
        batch = D.collate_classification(
            [(seq, 0) for seq in D.encode_batch(tok, texts)], ids["pad"], ids["bos"], ids["eos"],
            d.max_len,
        )  # fmt: skip
        logits = model(batch["input_ids"].to(device), batch["attention_mask"].to(device)).logits
        probs = logits.float().softmax(-1)
        return [f"{names[int(p.argmax())]} (p {float(p.max()):.2f})" for p in probs]

    task.show = show
    return task
