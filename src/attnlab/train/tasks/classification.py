"""Sequence classification (SST-2): an encoder-only classifier, trained from scratch or
fine-tuned from a pretrained checkpoint with its own tokenizer; loss and accuracy on the dev
split during training, on the test split at the end. The recipe's data section is
`ClassificationData` (src/attnlab/train/specs.py)."""

from __future__ import annotations

import torch

from ... import data as D
from ..recipes import Recipe
from .base import TASKS, IndexBatches, Task, fixed_batches, mean_loss


@TASKS.register("classification")
def build(recipe: Recipe, data_dir, tok, train, rank, world_size) -> Task:  # a TaskBuilder
    d = recipe.data
    split = lambda s: D.classification(d.dataset, s, data_dir)  # noqa: E731
    trains_tok = tok is None and d.tokenizer != "pretrained"
    train_exs = split("train") if (train or trains_tok) else None
    if tok is None and d.tokenizer == "pretrained":
        from ...interop import pretrained_tokenizer

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
        batches = fixed_batches(batcher, collate(exs), None)

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
