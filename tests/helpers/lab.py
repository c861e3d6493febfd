"""The tiny lab experiments (tests/lab/): the stand-in corpus they run on is
tests/lab/conftest.py's `data_dir`."""

from __future__ import annotations


def tiny_lab(**changes) -> dict:
    """A two-variant experiment (RoPE vs ALiBi, 2 seeds, 4 steps of a tiny model) on
    shakespeare-char, with `changes` to its top-level keys."""
    data = {
        "name": "tiny",
        "recipe": "shakespeare-char",
        "overrides": {
            "steps": 4, "batch": {"size": 2}, "eval": {"every": 2, "batches": 2, "samples": []},
            "model": {"overrides": {"d_model": 16, "n_layers": 1, "n_heads": 2}},
        },
        "variants": {"rope": {"model": {"overrides": {"positional": {"kind": "rope"}}}},
                     "alibi": {"model": {"overrides": {"positional": {"kind": "alibi"}}}}},
        "seeds": [1, 2],
        "evaluate": [{"kind": "val_loss", "max_windows": 3}],
        "gate": {"metric": "val_loss", "max": 2.0},
        "claims": [
            {"id": "c", "text": "t", "literature": "l", "citation": "x", "a": "rope.val_loss",
             "b": "alibi.val_loss", "expect": "lower", "control": True},
        ],
    }  # fmt: skip
    data.update(changes)
    return data


WIKI = {"data": {"dataset": "wikitext-2", "tokenizer": "bpe", "vocab_size": 300}}


def two_corpus_lab(**changes) -> dict:
    """tiny_lab's experiment with a second corpus (gate 9.0: a few steps pass it)."""
    corpora = {"wikitext-2": {"description": "BPE", "overrides": WIKI, "gate": 9.0}}
    return tiny_lab(**({"corpora": corpora} | changes))
