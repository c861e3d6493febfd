"""The reference points of the lab's quality gates: the loss of a unigram and of a bigram model
of each corpus's training text, on its validation text, in the units the lab's models report
(nats per character for tinyshakespeare, nats per BPE token for WikiText-2), and WikiText-2's
characters per token (the `scale` of configs/labs/*.yaml's `corpora`).

    python benchmarks/lab_baselines.py --out benchmarks/results/lab_baselines.json

A gate says "the model learned": its maximum is the bigram model's loss less 0.3 nats on both
corpora (configs/labs/*.yaml; norm-placement's deep Post-LN models get more). The bigram model
is add-k smoothed (k = 0.1, the lower of the two k tried) over the training text's tokens; the
unigram model add-one smoothed. No training, seconds.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
from pathlib import Path

CORPORA = {"tinyshakespeare": "char", "wikitext-2": "bpe"}  # the lab's recipe data, corpora


def ids(name: str, kind: str, vocab_size: int = 1024) -> tuple[list[int], list[int], int, float]:
    """(train ids, validation ids, vocabulary size, characters per token of the train text),
    tokenized as the lab's LM task does (src/attnlab/train/tasks/lm.py)."""
    from attnlab import data as D

    train, held_out = D.char_corpus(name)
    if kind == "bpe":
        tok = D.train_tokenizer("bpe", train.splitlines(), vocab_size, special_tokens=())
        a = tok.encode(train, add_special_tokens=False).ids
        b = tok.encode(held_out, add_special_tokens=False).ids
        return a, b, tok.get_vocab_size(), len(train) / len(a)
    vocab = {c: i for i, c in enumerate(sorted(set(train)))}
    return [vocab[c] for c in train], [vocab[c] for c in held_out if c in vocab], len(vocab), 1.0


def losses(a: list[int], b: list[int], v: int, k: float = 0.1) -> dict[str, float]:
    """Validation cross-entropy (nats per token) of a unigram and a bigram model of `a`."""
    uni = collections.Counter(a)
    big = collections.Counter(itertools.pairwise(a))
    unigram = -sum(math.log((uni[y] + 1) / (len(a) + v)) for y in b) / len(b)
    pairs = list(itertools.pairwise(b))
    bigram = -sum(math.log((big[(x, y)] + k) / (uni[x] + k * v)) for x, y in pairs) / len(pairs)
    return {"unigram": unigram, "bigram": bigram}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rows = {}
    for name, kind in CORPORA.items():
        a, b, v, cpt = ids(name, kind)
        row = {"tokens": kind, "vocab": v, "train_tokens": len(a), "val_tokens": len(b),
               "chars_per_token": round(cpt, 4)} | {f"{m}_loss": round(x, 4) for m, x in losses(a, b, v).items()}  # fmt: skip
        row["gate"] = round(row["bigram_loss"] - 0.3, 2)
        rows[name] = row
        print(name, json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
