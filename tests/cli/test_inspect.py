"""`attnlab inspect`: the summary of a preset or an HF-format folder."""

import json

import pytest

import attnlab as al
from attnlab.cli import main
from attnlab.cli.inspect import (
    KVLayers,
    active_parameters,
    kv_bytes_at,
    kv_bytes_per_token,
    kv_layers,
    resolve,
    sparse_layers,
)
from attnlab.config import MoEFFN


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


# --- KV cache by layer kind, hand-counted from the model cards' sizes ---------------------------


def test_sliding_layers_stop_growing_at_their_window():
    """Mistral 7B: 32 layers with a 4,096-token window, 8 K/V heads of 128: 2 · 8 · 128 · 2 B
    per layer per token, until each layer's ring of 4,096 slots is full."""
    cfg = al.presets.get("mistral-7b")
    per_layer = 2 * 8 * 128 * 2
    assert kv_layers(cfg, 2) == [KVLayers("sliding", 32, per_layer, 4096)]
    assert kv_bytes_at(cfg, 1000, 2) == 32 * per_layer * 1000
    assert kv_bytes_at(cfg, 4096, 2) == kv_bytes_at(cfg, 100_000, 2) == 32 * per_layer * 4096


def test_alternating_layers_split_the_cache():
    """Gemma 2 2B: 26 layers alternating a 4,096-token window (13) and global attention (13),
    4 K/V heads of 256: past the window only the 13 global layers keep growing."""
    cfg = al.presets.get("gemma2-2b")
    per_layer = 2 * 4 * 256 * 2
    assert kv_layers(cfg, 2) == [
        KVLayers("global", 13, per_layer),
        KVLayers("sliding", 13, per_layer, 4096),
    ]
    assert kv_bytes_per_token(cfg, 2) == 26 * per_layer
    n = 10_000
    assert kv_bytes_at(cfg, n, 2) == 13 * per_layer * n + 13 * per_layer * 4096


def test_gemma3_keeps_five_local_layers_in_six():
    """Gemma 3 1B: layers 5, 11, 17 and 23 global, the other 22 with a 512-token window; one K/V
    head of 256."""
    cfg = al.presets.get("gemma3-1b")
    per_layer = 2 * 1 * 256 * 2
    assert kv_layers(cfg, 2) == [
        KVLayers("global", 4, per_layer),
        KVLayers("sliding", 22, per_layer, 512),
    ]
    assert kv_bytes_at(cfg, 32768, 2) == 4 * per_layer * 32768 + 22 * per_layer * 512


def test_mla_caches_one_latent_per_layer():
    """DeepSeek-V2-Lite: 27 layers caching the 512-channel latent and the 64-channel shared
    rotary key, nothing per head (arXiv:2405.04434, section 2.1.3)."""
    cfg = al.presets.get("deepseek-v2-lite")
    assert kv_layers(cfg, 2) == [KVLayers("latent", 27, (512 + 64) * 2)]
    assert kv_bytes_per_token(cfg, 2) == 27 * 576 * 2
    assert kv_bytes_at(cfg, 5000, 4) == 27 * 576 * 4 * 5000


# --- active parameters ----------------------------------------------------------------------------


def test_mixtral_uses_12_9b_of_46_7b():
    """Mixtral 8x7B (arXiv:2401.04088, section 2.1: "13B active parameters"): 32 blocks, each
    token skips 6 of 8 SwiGLU experts of 3 · 4096 · 14336."""
    cfg = al.presets.get("mixtral-8x7b")
    total = al.count_parameters(cfg)
    assert total == 46_702_792_704
    active = active_parameters(cfg, total)
    assert active == total - 32 * 6 * 3 * 4096 * 14336 == 12_879_925_248


def test_deepseek_v2_lite_skips_only_its_sparse_blocks():
    """Block 0 is dense (first_k_dense_replace 1): 26 sparse blocks of 64 routed experts of
    3 · 2048 · 1408, 6 used; the 2 shared experts always run."""
    cfg = al.presets.get("deepseek-v2-lite")
    assert sparse_layers(cfg) == 26
    total = 15_706_484_224  # tests/test_presets.py: equal to transformers'
    assert active_parameters(cfg, total) == total - 26 * 58 * 3 * 2048 * 1408


def test_dense_models_are_all_active():
    cfg = al.presets.get("llama2-7b")
    assert active_parameters(cfg, 123) == 123 and sparse_layers(cfg) == 0


@pytest.mark.parametrize("name", ["gpt-oss-20b", "deepseek-v3", "qwen3-30b-a3b"])
def test_active_parameters_match_the_built_experts(name):
    """At test size, against the modules: total less (n_experts - top_k) experts' parameters in
    every block whose FFN has experts (GPT-OSS's experts have biases; DeepSeek-V3's first 3
    blocks are dense)."""
    cfg = al.presets.tiny(al.presets.get(name))
    model = al.build_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    idle = 0
    for block in model.decoder.blocks:
        experts = block.ffn.experts
        if len(experts):
            per = sum(p.numel() for p in experts[0].parameters())
            idle += (len(experts) - block.ffn.top_k) * per
    assert isinstance(cfg.ffn, MoEFFN) and idle > 0
    assert active_parameters(cfg, total) == total - idle


# --- the summary ------------------------------------------------------------------------------------


def test_inspect_shows_the_window_cap(capsys):
    assert main(["inspect", "mistral-7b"]) == 0
    out = capsys.readouterr().out
    assert "131,072 B in bf16/fp16, 262,144 B in fp32, up to 4,096 tokens (the window)" in out
    assert f"{4096 * 131072 / 2**20:,.1f} MiB" in out  # 512.0 MiB at every length past it


def test_inspect_shows_global_and_sliding_layers(capsys):
    assert main(["inspect", "gpt-oss-20b"]) == 0
    out = capsys.readouterr().out
    per_layer = 2 * 8 * 64 * 2  # 8 K/V heads of 64 in bf16
    assert f"12 global: {per_layer:,} B/token each" in out
    assert f"12 sliding (window 128): {per_layer:,} B/token each" in out
    assert f"then {12 * per_layer:,} B/token in bf16 (the global layers)" in out


def test_inspect_shows_active_parameters(capsys):
    assert main(["inspect", "mixtral-8x7b"]) == 0
    out = capsys.readouterr().out
    assert "12,879,925,248 of 46,702,792,704 (27.6%): top-2 of 8 routed experts" in out
    assert "without the input embeddings" in out  # untied: the card conventions differ
    assert main(["inspect", "llama2-7b"]) == 0
    assert "active per token" not in capsys.readouterr().out


# --- what the other commands take: a run, a checkpoint folder, a .gguf file (issue 49, item 5) ---


def test_inspect_takes_a_run_and_its_checkpoint_folders(tmp_path, capsys):
    """A run directory of `attnlab train` (its best, else last checkpoint) and a checkpoint
    folder itself: the summary of the config the checkpoint holds, its count the built model's
    (before: "has no config.json", and "model_type '<missing model_type>'" for the folder)."""
    from attnlab.train import checkpoint as ckpt

    cfg = al.presets.tiny(al.presets.get("llama3.2-1b"))
    model = al.build_model(cfg)
    ckpt.save(tmp_path / "run", "last", model, cfg, {}, {"step": 3})
    built = f"{sum(p.numel() for p in model.parameters()):,}"
    for target in (tmp_path / "run", tmp_path / "run" / "last"):
        assert main(["inspect", str(target)]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"{tmp_path / 'run' / 'last'} (attnlab checkpoint)"), out
        rows = dict(line.strip().split("  ", 1) for line in out.splitlines()[1:])
        assert rows["parameters"].strip() == built
        assert rows["layers"].strip() == str(cfg.n_layers)
        assert rows["d_model / d_ff"].strip() == f"{cfg.d_model} / {cfg.ffn_dim}"


@pytest.mark.parametrize("family", ["llama3", "qwen3moe"])
def test_inspect_takes_a_gguf_file(family, tmp_path, capsys):
    """A llama.cpp file (its metadata only): the parameter count transformers' own model has, the
    model the file was written from (a MoE's through the count by hand of its experts)."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from helpers.gguf_families import tiny
    from helpers.gguf_writing import write_gguf

    hf = tiny(family)
    arch = "qwen3moe" if family == "qwen3moe" else "llama"
    path = write_gguf(tmp_path / "m.gguf", hf, arch)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path} (GGUF, {hf.config.model_type})"), out
    rows = dict(line.strip().split("  ", 1) for line in out.splitlines()[1:])
    assert rows["parameters"].strip() == f"{sum(p.numel() for p in hf.parameters()):,}"
    assert rows["layers"].strip() == str(hf.config.num_hidden_layers)


def test_inspect_says_what_it_takes(tmp_path, capsys):
    """A folder that is none of them, a file that is not .gguf, a lab folder of runs: one error
    line naming what inspect takes (or the runs inside)."""
    from attnlab.train import checkpoint as ckpt

    (tmp_path / "notes.txt").write_text("hi")
    assert main(["inspect", str(tmp_path / "notes.txt")]) == 2
    assert "neither a folder nor a .gguf file" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "a .gguf file, a run directory of attnlab train" in err and "config.json" in err
    cfg = al.presets.tiny(al.presets.get("gpt2-small"))
    ckpt.save(tmp_path / "lab" / "rope-s1", "last", al.build_model(cfg), cfg, {}, {"step": 1})
    assert main(["inspect", str(tmp_path / "lab")]) == 2
    assert f"attnlab inspect {tmp_path / 'lab' / 'rope-s1'}" in capsys.readouterr().err
