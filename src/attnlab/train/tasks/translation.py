"""Translation: a joint-BPE encoder-decoder; validation loss during training (and BLEU with
greedy decoding when `eval.bleu_every_eval`), sacreBLEU with beam search on the test split at the
end. The recipe's data section is `TranslationData` (src/attnlab/train/specs.py)."""

from __future__ import annotations

from typing import Any

import torch

from ... import data as D
from ...decode.generate import generate
from ..recipes import Recipe
from .base import TASKS, IndexBatches, Task, fixed_batches, mean_loss


def bleu(hyps: list[str], refs: list[str]) -> dict[str, float]:
    """sacreBLEU: cased on detokenized text (the WMT protocol), and lower-cased 13a-tokenized."""
    from sacrebleu.metrics import BLEU

    return {
        "bleu": BLEU().corpus_score(hyps, [refs]).score,
        "bleu_lc": BLEU(tokenize="13a", lowercase=True).corpus_score(hyps, [refs]).score,
    }


def translate(
    model: torch.nn.Module,
    tok: Any,
    sources: list[str],
    recipe: Recipe,
    batch_size: int = 64,
    beams: int | None = None,
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


@TASKS.register("translation")
def build(recipe: Recipe, data_dir, tok, train, rank, world_size) -> Task:  # a TaskBuilder
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
    vbatches = fixed_batches(vbatcher, collate(vexs), recipe.eval.batches)

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
