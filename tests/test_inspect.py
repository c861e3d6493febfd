"""`attnlab inspect`: the summary of a preset or an HF-format folder."""

import json

import pytest

import attnlab as al
from attnlab.cli import main
from attnlab.cli.inspect import kv_bytes_per_token, resolve


def test_kv_bytes_per_token_follow_the_kv_heads():
    # 2 (K and V) x layers x kv_heads x head_dim x bytes, from the model cards' sizes
    assert kv_bytes_per_token(al.presets.get("mistral-7b"), 2) == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(al.presets.get("llama2-7b"), 2) == 2 * 32 * 32 * 128 * 2
    assert kv_bytes_per_token(al.presets.get("falcon-7b"), 4) == 2 * 32 * 1 * 64 * 4
    assert kv_bytes_per_token(al.presets.get("t5-small"), 4) == 2 * 6 * 8 * 64 * 4  # decoder only


def test_inspect_preset_prints_count_and_cache(capsys):
    assert main(["inspect", "mistral-7b"]) == 0
    out = capsys.readouterr().out
    assert "7,241,732,096" in out and "131,072 B in bf16" in out and "sliding_window=4096" in out


def test_inspect_folder_reads_only_the_config(tmp_path, capsys):
    cfg = al.presets.tiny(al.presets.get("gpt2-small"))
    al.interop.save_pretrained(al.build_model(cfg), tmp_path, "gpt2")
    (tmp_path / "model.safetensors").unlink()  # weights are not needed for a summary
    label, back = resolve(str(tmp_path))
    assert "gpt2" in label and back.d_model == cfg.d_model and back.n_layers == cfg.n_layers
    assert main(["inspect", str(tmp_path)]) == 0
    assert f"{al.count_parameters(cfg):,}" in capsys.readouterr().out


def test_inspect_rejects_a_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve(str(tmp_path))


def test_inspect_unknown_preset_suggests_names():
    with pytest.raises(KeyError, match="llama2-7b"):
        resolve("llama2-7")


def test_inspect_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "xlnet"}))
    with pytest.raises(al.interop.ConversionError, match="supported"):
        resolve(str(tmp_path))
