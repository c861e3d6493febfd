"""attnlab.data against the real data sets (located at run time, ../shared/data in CI) and
hand-made references: corpus sizes from the data README, tokenizer round trips, cache, batching
invariants (budget, coverage, determinism, resume, rank sharding), collate layouts."""

from __future__ import annotations

import gzip
import itertools
import json

import pytest
import torch

from attnlab.data import (
    IGNORE_INDEX,
    DataNotFoundError,
    LMBatcher,
    TokenBudgetBatcher,
    char_corpus,
    classification,
    classification_lengths,
    collate_classification,
    collate_translation,
    decode,
    encode,
    encode_batch,
    locate,
    special_ids,
    train_tokenizer,
    translation_lengths,
    translation_pairs,
)
from attnlab.data import tokenizers as toks


def need(name: str):
    """The data set's folder, or a clean skip naming where it was looked for."""
    try:
        return locate(name)
    except DataNotFoundError as e:
        pytest.skip(f"data set {name!r} is not available here: {e}")


@pytest.fixture(scope="module")
def multi30k():
    need("multi30k")
    return translation_pairs("multi30k", "de", "en", "train")


@pytest.fixture(scope="module")
def bpe(multi30k, tmp_path_factory):
    pytest.importorskip("tokenizers")
    texts = [s for s, _ in multi30k] + [t for _, t in multi30k]  # joint source + target
    return train_tokenizer("bpe", texts, 8000, cache_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def multi30k_ids(multi30k, bpe):
    return list(
        zip(
            encode_batch(bpe, [s for s, _ in multi30k]),
            encode_batch(bpe, [t for _, t in multi30k]),
            strict=True,
        )
    )


# ---------------------------------------------------------------- data sets (sizes: data README)


def test_multi30k_split_sizes_and_alignment(multi30k):
    assert len(multi30k) == 29_000
    assert len(translation_pairs(split="val")) == 1_014
    test = translation_pairs(split="test_2016_flickr")
    assert len(test) == 1_000
    # Line 1 of train.de / train.en (github.com/multi30k/dataset, data/task1/raw): the pair lines up.
    assert multi30k[0] == (
        "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
        "Two young, White males are outside near many bushes.",
    )
    assert all(s and t and s == s.strip() and t == t.strip() for s, t in multi30k)
    assert (
        translation_pairs(src="en", tgt="de", split="val")[7][::-1]
        == translation_pairs(split="val")[7]
    )


def test_multi30k_rejects_unknown_names_with_the_choices():
    with pytest.raises(ValueError, match="test_2016_flickr"):
        translation_pairs(split="test")
    with pytest.raises(ValueError, match="de, en, fr"):
        translation_pairs(src="cs", split="test_2017_flickr")


def test_tinyshakespeare_is_split_90_10_like_nanogpt():
    folder = need("tinyshakespeare")
    text = gzip.decompress((folder / "input.txt.gz").read_bytes()).decode("utf-8")
    train, val = char_corpus("tinyshakespeare")
    assert len(train) + len(val) == 1_115_394 and train + val == text
    assert len(train) == int(0.9 * len(text))  # nanoGPT prepare.py: data[:int(n*0.9)]
    assert len(set(text)) == 65


def test_sentence_classification_sizes_labels_and_encodings():
    need("sentence-classification")
    sizes = {s: len(classification("sst2", s)) for s in ("train", "dev", "test")}
    assert sizes == {"train": 6_920, "dev": 872, "test": 1_821}
    train = classification("sst2", "train")
    assert {y for _, y in train} == {0, 1}
    assert any("naiveté" in x for x, _ in train)  # UTF-8 text decoded as UTF-8, not mojibake
    # TREC holds Latin-1 bytes (data README): read without error, 5,452 / 500 lines, 6 classes.
    trec = classification("trec", "train")
    assert len(trec) == 5_452 and len(classification("trec", "test")) == 500
    assert {y for _, y in trec} == set(range(6))
    # MR and Subj hold byte 0x85, Latin-1 for U+0085 (NEL), a line break to str.splitlines():
    # lines must be split on "\n" only to get the README's counts.
    assert (
        len(classification("mr", "all")) == 10_662 and len(classification("subj", "all")) == 10_000
    )
    with pytest.raises(ValueError, match="train, dev, test"):
        classification("sst2", "validation")


# ---------------------------------------------------------------- tokenizers


def test_char_tokenizer_round_trips_and_matches_nanogpt_ids(tmp_path):
    pytest.importorskip("tokenizers")
    need("tinyshakespeare")
    train, val = char_corpus()
    tok = train_tokenizer("char", [train], None, special_tokens=(), cache_dir=tmp_path)
    stoi = {c: i for i, c in enumerate(sorted(set(train)))}  # nanoGPT shakespeare_char/prepare.py
    ids = encode(tok, train)
    assert ids == [stoi[c] for c in train]
    assert decode(tok, ids) == train
    assert decode(tok, encode(tok, val)) == val
    assert special_ids(tok) == {}
    with_specials = train_tokenizer("char", [train], None, cache_dir=tmp_path)
    assert special_ids(with_specials) == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
    assert encode(with_specials, "First") == [stoi[c] + 4 for c in "First"]


def test_bpe_round_trips_multi30k_train_and_unseen_test(multi30k, bpe):
    sentences = [x for pair in multi30k for x in pair]
    sentences += [x for pair in translation_pairs(split="test_2016_flickr") for x in pair]
    ids = encode_batch(bpe, sentences)
    bad = [s for s, i in zip(sentences, ids, strict=True) if decode(bpe, i) != s]
    assert bad == []
    assert bpe.get_vocab_size() == 8000
    assert all(bpe.id_to_token(i) is not None for i in range(8000))


def test_decode_drops_specials_cuts_at_eos_and_ignores_label_padding(bpe):
    sp = special_ids(bpe)
    assert sp == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}  # order of DEFAULT_SPECIALS
    text = "Ein Mann fährt Fahrrad."
    ids = encode(bpe, text)
    assert not set(ids) & set(sp.values())
    generated = [sp["bos"], *ids, sp["eos"], *encode(bpe, "garbage"), sp["pad"]]
    assert decode(bpe, torch.tensor(generated)) == text
    assert decode(bpe, [*ids, IGNORE_INDEX, IGNORE_INDEX]) == text
    assert decode(bpe, generated, until_eos=False) == text + " garbage"


def test_tokenizer_cache_hit_and_key(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    texts = ["a small text", "another small text", "and a third one"]
    tok = train_tokenizer("bpe", texts, 300, cache_dir=tmp_path)
    path = toks.cache_path("bpe", texts, 300, cache_dir=tmp_path)
    assert path.name == "tokenizer.json" and path.is_file()
    before = (path.stat().st_mtime_ns, path.read_bytes())

    def no_training(*args):
        raise AssertionError("trained again although the tokenizer is cached")

    monkeypatch.setitem(toks._BUILDERS, "bpe", no_training)
    again = train_tokenizer("bpe", iter(texts), 300, cache_dir=tmp_path)  # any iterable
    assert again.to_str() == tok.to_str()
    assert (path.stat().st_mtime_ns, path.read_bytes()) == before
    assert list(tmp_path.rglob("*.json")) == [path]
    # Anything that changes the result changes the key.
    keys = {
        toks.cache_key("bpe", texts, 300, toks.DEFAULT_SPECIALS),
        toks.cache_key("bpe", texts, 301, toks.DEFAULT_SPECIALS),
        toks.cache_key("wordpiece", texts, 300, toks.DEFAULT_SPECIALS),
        toks.cache_key("bpe", texts[:2], 300, toks.DEFAULT_SPECIALS),
        toks.cache_key(
            "bpe", ["a small texta", "nother small text", texts[2]], 300, toks.DEFAULT_SPECIALS
        ),
        toks.cache_key("bpe", texts, 300, ("<pad>", "<s>", "</s>")),
    }
    assert len(keys) == 6


def test_bpe_training_is_deterministic(multi30k, tmp_path):
    pytest.importorskip("tokenizers")
    texts = [t for _, t in multi30k[:3000]]
    a = train_tokenizer("bpe", texts, 1000, cache_dir=tmp_path / "a")
    b = train_tokenizer("bpe", texts, 1000, cache_dir=tmp_path / "b")
    assert a.to_str() == b.to_str()


def test_wordpiece_splits_words_losslessly_and_reads_bert_specials(tmp_path):
    pytest.importorskip("tokenizers")
    need("sentence-classification")
    texts = [x for x, _ in classification("sst2", "train")]
    bert = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")
    tok = train_tokenizer("wordpiece", texts, 4000, special_tokens=bert, cache_dir=tmp_path)
    assert special_ids(tok) == {"pad": 0, "bos": 1, "eos": 2, "unk": 3, "mask": 4}
    # Reference: the words of BERT's own normaliser + pre-tokenizer; the pieces must spell them.
    for text in texts[:500]:
        words = [
            w for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text))
        ]
        pieces = tok.encode(text).tokens
        assert "".join(pieces).replace("##", "") == "".join(words)
        assert sum(not p.startswith("##") for p in pieces) == len(words)


def test_tokenizer_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="char, bpe, wordpiece"):
        train_tokenizer("sentencepiece", ["x"], 100, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer("bpe", ["x"], 4, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown token"):
        train_tokenizer("wordpiece", ["x"], 100, special_tokens=("<pad>",), cache_dir=tmp_path)


# ---------------------------------------------------------------- token-budget batching


def greedy_reference(lengths, max_tokens):
    """(batch size, max length) of each batch when sorted lengths are cut greedily: the fairseq
    rule written as plainly as possible."""
    lengths, out, start = sorted(lengths), [], 0
    while start < len(lengths):
        end = start + 1
        while end < len(lengths) and (end + 1 - start) * lengths[end] <= max_tokens:
            end += 1
        out.append((end - start, lengths[end - 1]))
        start = end
    return sorted(out)


def test_budget_is_respected_with_padding_and_batches_are_greedy(multi30k_ids):
    lengths = translation_lengths(multi30k_ids)
    batcher = TokenBudgetBatcher(lengths, max_tokens=2000, seed=0)
    batches = list(batcher)
    for batch in batches:
        out = collate_translation([multi30k_ids[i] for i in batch], 0, 1, 2)
        width = max(out["input_ids"].shape[1], out["labels"].shape[1])
        assert width == max(lengths[i] for i in batch)  # translation_lengths = collated widths
        assert len(batch) * width <= 2000
    got = sorted((len(b), max(lengths[i] for i in b)) for b in batches)
    assert got == greedy_reference(lengths, 2000)


def test_each_epoch_covers_every_example_once_in_length_buckets(multi30k_ids):
    lengths = translation_lengths(multi30k_ids)
    batcher = TokenBudgetBatcher(lengths, max_tokens=3000, seed=1)
    epochs = [list(batcher) for _ in range(3)]
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(lengths)))
        spans = sorted((min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in batches)
        # bucket_width=1: batches cut from the length-sorted order, so their ranges do not overlap
        assert all(hi <= lo_next for (_, hi), (lo_next, _) in itertools.pairwise(spans))
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    assert batcher.epoch == 3


def test_batches_are_a_function_of_seed_and_epoch(multi30k_ids):
    lengths = translation_lengths(multi30k_ids)
    a = TokenBudgetBatcher(lengths, 2500, seed=7)
    b = TokenBudgetBatcher(lengths, 2500, seed=7)
    assert [list(a) for _ in range(2)] == [list(b) for _ in range(2)]
    c = TokenBudgetBatcher(lengths, 2500, seed=8)
    assert list(c) != a.global_batches(0)
    d = TokenBudgetBatcher(lengths, 2500, seed=7)
    d.set_epoch(1)
    assert list(d) == a.global_batches(1)
    fixed = [list(TokenBudgetBatcher(lengths, 2500, seed=s, shuffle=False)) for s in (1, 2)]
    assert fixed[0] == fixed[1]
    maxes = [max(lengths[i] for i in b) for b in fixed[0]]
    assert maxes == sorted(maxes)


@pytest.mark.parametrize("stop", [0, 1, 37, "end"])
def test_resume_mid_epoch_gives_the_remaining_batches(multi30k_ids, stop):
    lengths = translation_lengths(multi30k_ids)
    reference = TokenBudgetBatcher(lengths, 2500, seed=3)
    expected = [b for _ in range(3) for b in reference]  # epochs 0, 1, 2 uninterrupted

    run = TokenBudgetBatcher(lengths, 2500, seed=3)
    seen = list(run)  # epoch 0
    it = iter(run)
    n = len(run) if stop == "end" else stop
    seen += [next(it) for _ in range(n)]  # killed after n batches of epoch 1
    state = json.loads(json.dumps(run.state_dict()))  # goes into a checkpoint

    resumed = TokenBudgetBatcher(lengths, 2500, seed=3)
    resumed.load_state_dict(state)
    seen += list(resumed)
    if stop != "end":
        seen += list(resumed)
    assert seen == expected


def test_state_from_other_settings_is_refused(multi30k_ids):
    lengths = translation_lengths(multi30k_ids)
    state = TokenBudgetBatcher(lengths, 2500, seed=3).state_dict()
    with pytest.raises(ValueError, match="seed: saved 3, now 4"):
        TokenBudgetBatcher(lengths, 2500, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="lengths_sha256"):
        TokenBudgetBatcher(lengths[:-1], 2500, seed=3).load_state_dict(state)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_take_disjoint_interleaved_shares_of_one_global_order(multi30k_ids, world_size):
    lengths = translation_lengths(multi30k_ids)[:5000]
    ranks = [
        TokenBudgetBatcher(lengths, 1500, seed=5, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    single = TokenBudgetBatcher(lengths, 1500, seed=5, multiple_of=world_size)
    for _ in range(2):
        shares = [list(r) for r in ranks]
        order = list(single)
        assert len({len(s) for s in shares}) == 1  # same number of steps on every rank
        assert [shares[k % world_size][k // world_size] for k in range(len(order))] == order
        flat = [i for s in shares for b in s for i in b]
        assert sorted(flat) == list(range(len(lengths)))  # disjoint and complete
        assert all(len(b) * max(lengths[i] for i in b) <= 1500 for b in order)


def test_batch_count_is_made_divisible_by_halving_batches():
    lengths = [10] * 9  # budget 30: three batches of three
    assert len(TokenBudgetBatcher(lengths, 30, seed=0).global_batches(0)) == 3
    batches = TokenBudgetBatcher(lengths, 30, seed=0, multiple_of=2).global_batches(0)
    assert sorted(len(b) for b in batches) == [1, 2, 3, 3]
    assert sorted(i for b in batches for i in b) == list(range(9))
    with pytest.raises(ValueError, match="single-example batches"):
        TokenBudgetBatcher([10] * 5, 10, seed=0, world_size=2).global_batches(0)


def test_batcher_arguments_are_checked():
    with pytest.raises(ValueError, match="1 example\\(s\\) are longer than max_tokens \\(50\\)"):
        TokenBudgetBatcher([10, 60, 20], 50)
    with pytest.raises(ValueError, match="max_batch_size"):
        TokenBudgetBatcher([10], 50, max_batch_size=0)
    with pytest.raises(ValueError, match="rank"):
        TokenBudgetBatcher([10, 10], 50, rank=2, world_size=2)
    capped = TokenBudgetBatcher([1] * 10, 1000, shuffle=False, max_batch_size=4)
    assert [len(b) for b in capped] == [4, 4, 2]


# ---------------------------------------------------------------- character-LM batching


def test_lm_batches_are_windows_shifted_by_one_deterministic_and_resumable():
    data = torch.arange(1000) * 7 % 65  # any 1-D ids; distinct neighbours reveal misalignment
    lm = LMBatcher(data, context=64, batch_size=12, seed=0)
    steps = [next(lm) for _ in range(5)]
    for s, batch in enumerate(steps):
        starts = lm.starts(s)
        assert batch["input_ids"].shape == (12, 64) and batch["labels"].shape == (12, 64)
        assert ((starts >= 0) & (starts < 1000 - 64)).all()
        for b, i in enumerate(starts.tolist()):
            assert torch.equal(batch["input_ids"][b], data[i : i + 64])
            assert torch.equal(batch["labels"][b], data[i + 1 : i + 65])
    assert not torch.equal(steps[0]["input_ids"], steps[1]["input_ids"])

    again = LMBatcher(data, 64, 12, seed=0)
    assert all(torch.equal(next(again)["input_ids"], s["input_ids"]) for s in steps[:2])
    state = again.state_dict()
    resumed = LMBatcher(data, 64, 12, seed=0)
    resumed.load_state_dict(state)
    assert all(torch.equal(next(resumed)["labels"], s["labels"]) for s in steps[2:])
    with pytest.raises(ValueError, match="seed"):
        LMBatcher(data, 64, 12, seed=1).load_state_dict(state)
    other = LMBatcher(data, 64, 12, seed=1)
    assert not torch.equal(next(other)["input_ids"], steps[0]["input_ids"])


def test_lm_ranks_take_slices_of_the_global_batch():
    data = torch.arange(500)
    whole = LMBatcher(data, 16, 12, seed=2)
    parts = [LMBatcher(data, 16, 12, seed=2, rank=r, world_size=3) for r in range(3)]
    for _ in range(3):
        glob = next(whole)
        mine = [next(p) for p in parts]
        for key in ("input_ids", "labels"):
            assert torch.equal(torch.cat([m[key] for m in mine]), glob[key])
    with pytest.raises(ValueError, match="multiple of world_size"):
        LMBatcher(data, 16, 10, world_size=3)


# ---------------------------------------------------------------- collate


def test_collate_translation_layout():
    pad, bos, eos = 0, 1, 2
    out = collate_translation([([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])], pad, bos, eos)
    expected = {
        "input_ids": [[5, 6, 7, 2], [5, 2, 0, 0]],
        "attention_mask": [[1, 1, 1, 1], [1, 1, 0, 0]],
        "decoder_input_ids": [[1, 8, 9, 0, 0], [1, 8, 9, 10, 11]],
        "decoder_attention_mask": [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]],
        "labels": [[8, 9, 2, -100, -100], [8, 9, 10, 11, 2]],
    }
    assert {k: v.tolist() for k, v in out.items()} == expected
    assert all(v.dtype == torch.long for v in out.values())
    assert translation_lengths([([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])]) == [4, 5]
    # labels are the decoder inputs shifted left: teacher forcing predicts the next token
    real = out["decoder_attention_mask"].bool()
    assert torch.equal(
        out["labels"][:, :-1][real[:, 1:]], out["decoder_input_ids"][:, 1:][real[:, 1:]]
    )


def test_collate_classification_layout_and_truncation():
    out = collate_classification([([5, 6, 7], 1), ([8], 0)], pad_id=0, bos_id=1, eos_id=2)
    assert out["input_ids"].tolist() == [[1, 5, 6, 7, 2], [1, 8, 2, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert out["labels"].tolist() == [1, 0]
    cut = collate_classification([([5, 6, 7, 8, 9], 1)], pad_id=0, bos_id=1, eos_id=2, max_len=4)
    assert cut["input_ids"].tolist() == [[1, 5, 6, 2]]
    assert classification_lengths([([5, 6, 7, 8, 9], 1)], eos=True, max_len=4) == [4]
    bare = collate_classification([([5, 6], 1), ([7], 0)], pad_id=0)
    assert bare["input_ids"].tolist() == [[5, 6], [7, 0]]
