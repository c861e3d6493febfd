"""`attnlab generate` streams exactly the tokens `attnlab.decode.generate` returns."""

import argparse

import pytest
import torch

import attnlab as al
from attnlab.cli import generate as textgen

pytest.importorskip("tokenizers")


def _folder(tmp_path):
    from attnlab.data import train_tokenizer

    tok = train_tokenizer(
        "char", ["to be or not to be, that is the question"], 0, cache_dir=tmp_path / "c"
    )
    cfg = al.presets.tiny(al.presets.get("llama2-7b"), vocab_size=tok.get_vocab_size())
    torch.manual_seed(0)
    model = al.build_model(cfg.replace(init="xavier"))
    al.interop.save_pretrained(model, tmp_path / "m", "llama")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    return tmp_path / "m", model.eval(), tok


def test_generate_cli_prints_the_greedy_continuation(tmp_path, capsys):
    folder, model, tok = _folder(tmp_path)
    args = argparse.Namespace(
        target=str(folder),
        prompt="to be",
        max_new_tokens=12,
        temperature=0.0,
        top_k=None,
        top_p=None,
        seed=0,
    )
    assert textgen.run(args) == 0
    ids = torch.tensor([tok.encode("to be", add_special_tokens=False).ids])
    expected = al.generate(model, ids, 12, eos_token_id=tok.token_to_id("</s>"))[
        0, ids.shape[1] :
    ].tolist()
    eos = tok.token_to_id("</s>")
    expected = expected[: expected.index(eos)] if eos in expected else expected
    assert expected, "the continuation must not be empty for this test to mean anything"
    assert capsys.readouterr().out == "to be" + tok.decode(expected) + "\n"


def test_generate_cli_names_a_missing_tokenizer(tmp_path):
    folder, _, _ = _folder(tmp_path)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        textgen.load_model_and_tokenizer(str(folder))


def _learned_folder(tmp_path, table: int = 16):
    from attnlab.config import LearnedPositions
    from attnlab.data import train_tokenizer

    tok = train_tokenizer(
        "char", ["to be or not to be, that is the question"], 0, cache_dir=tmp_path / "c"
    )
    cfg = al.presets.tiny(al.presets.get("gpt2-small"), vocab_size=tok.get_vocab_size())
    torch.manual_seed(0)
    model = al.build_model(cfg.replace(positional=LearnedPositions(max_len=table)))
    al.interop.save_pretrained(model, tmp_path / "g", "gpt2")
    tok.save(str(tmp_path / "g" / "tokenizer.json"))
    return tmp_path / "g", model.eval(), tok


def test_generate_cli_slides_a_window_past_a_learned_position_table(tmp_path, capsys):
    """nanoGPT-style models: 5 + 30 tokens with a 16-position table. Each new token is the
    argmax over the logits of the last 16 tokens, recomputed from position 0 (reference loop)."""
    folder, model, tok = _learned_folder(tmp_path)
    args = argparse.Namespace(target=str(folder), prompt="to be", max_new_tokens=30,
                              temperature=0.0, top_k=None, top_p=None, seed=0)  # fmt: skip
    assert textgen.run(args) == 0
    ids = torch.tensor([tok.encode("to be", add_special_tokens=False).ids])
    with torch.no_grad():
        for _ in range(30):
            nxt = model(ids[:, -16:]).logits[:, -1].argmax(-1)
            ids = torch.cat((ids, nxt[:, None]), 1)
    eos = tok.token_to_id("</s>")
    new = ids[0, 5:].tolist()
    new = new[: new.index(eos)] if eos in new else new
    assert len(new) > 11, "the continuation must run past the table for this test to mean anything"
    captured = capsys.readouterr()
    assert captured.out == "to be" + tok.decode(new) + "\n"
    assert "learned positions hold 16 tokens" in captured.err


def test_sliding_stream_sees_only_its_window_and_equals_the_cache_within_it(tmp_path):
    from attnlab.decode.generate import sliding_stream

    _, model, _ = _learned_folder(tmp_path)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (2, 20), generator=g)
    other = prompt.clone()
    other[:, :4] = (other[:, :4] + 1) % model.config.vocab_size  # outside the last 16
    first = [next(iter(sliding_stream(model, p, 1, 16, temperature=0.0))) for p in (prompt, other)]
    assert torch.equal(first[0], first[1])
    # within the table it is ordinary (KV-cached) greedy decoding
    short = prompt[:, :6]
    got = torch.stack(list(sliding_stream(model, short, 10, 16, temperature=0.0)), 1)
    want = al.generate(model, short, 10)[:, 6:]
    assert torch.equal(got, want)
