"""Language model on one text: characters (nanoGPT's shakespeare_char), byte-level BPE tokens
trained on the training text (data.tokenizer "bpe", data.vocab_size) or, fine-tuning a
pretrained decoder (data.tokenizer "pretrained"), that model's own tokens. Loss on random
validation windows (nanoGPT's estimate_loss); samples from a window sliding over the last
`context` tokens (characters), or, for a pretrained decoder, KV-cached generation.
The recipe's data section is `LMData` (src/attnlab/train/specs.py).

nanoGPT trains on the first 90 % of the text and validates on the last 10 %. Here that held-out
tail is cut in two: validation (which picks the best checkpoint) reads its first half, and the
test loss reported at the end reads the second half, which nothing during training has seen."""

from __future__ import annotations

import torch

from ... import data as D
from ...decode.generate import generate, sliding_stream
from ..recipes import Recipe
from .base import TASKS, Task, mean_loss


@TASKS.register("lm")
def build(recipe: Recipe, data_dir, tok, train, rank, world_size) -> Task:  # a TaskBuilder
    d = recipe.data
    train_text, held_out = D.char_corpus(d.dataset, data_dir)
    val_text, test_text = held_out[: len(held_out) // 2], held_out[len(held_out) // 2 :]
    pretrained = d.tokenizer == "pretrained"
    if tok is None and pretrained:
        from ...interop import pretrained_tokenizer

        tok = pretrained_tokenizer(recipe.model.pretrained)
    elif tok is None and d.tokenizer == "bpe":
        tok = D.train_tokenizer("bpe", train_text.splitlines(), d.vocab_size, special_tokens=())
    elif tok is None:
        tok = D.train_tokenizer("char", [train_text], None, special_tokens=())
    vocab = tok.get_vocab()

    def to_ids(text: str) -> torch.Tensor:
        if pretrained or d.tokenizer == "bpe":  # no BOS: windows cut the text anywhere
            return torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)
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
    n_eval = recipe.eval.batches or 200
    val = D.LMBatcher(to_ids(val_text), d.context, recipe.batch.size, seed=0)
    vbatches = [val.batch(i) for i in range(n_eval)]
    task.validate = lambda model: {"val_loss": mean_loss(model, vbatches)}
    test = D.LMBatcher(to_ids(test_text), d.context, recipe.batch.size, seed=1)
    tbatches = [test.batch(i) for i in range(n_eval)]
    task.test = lambda model: {"test_loss": mean_loss(model, tbatches)}

    def show(model, prompts):
        # nanoGPT's sample loop: the window slides over the last `context` characters, so the
        # text may run past the learned position table
        dec = recipe.decoding
        device = next(model.parameters()).device
        outs = []
        for i, p in enumerate(prompts):
            ids = to_ids(p or "\n")[None].to(device)
            if pretrained:  # positions need not slide: KV-cached generation
                out = generate(model, ids, dec.sample_tokens, strategy="sample",
                               temperature=dec.temperature, top_k=dec.top_k, seed=recipe.seed + i,
                               eos_token_id=None)  # fmt: skip
                outs.append(D.decode(tok, out[0], until_eos=False))
                continue
            new = sliding_stream(
                model, ids, dec.sample_tokens, d.context, dec.temperature, dec.top_k,
                seed=recipe.seed + i,
            )  # fmt: skip
            text = torch.cat([ids[0], torch.stack([t[0] for t in new])])
            outs.append(D.decode(tok, text, until_eos=False))
        return outs

    task.show = show
    return task
