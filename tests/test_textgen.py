"""`attnlab generate` streams exactly the tokens `attnlab.generate` returns."""

import argparse

import pytest
import torch

import attnlab as al
from attnlab import textgen

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
