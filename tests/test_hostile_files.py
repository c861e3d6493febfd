"""Broken and hostile files end in a clear attnlab error, never another exception or a hang.

A corpus of mutations of real files (a checkpoint folder of `attnlab train`'s format, an HF-format
folder written by save_pretrained): truncation at every section boundary of a safetensors file
(inside the header length, the JSON header, the data) and at random offsets, random bytes, JSON
that is not a config, sizes of zero, manifests that are empty, partial or name files outside their
folder, shard indexes that point elsewhere, NaN weights. Each case must raise an exception class
of attnlab's own (its message names the file and the fix) within a few seconds; the manifest's
integrity check cannot be bypassed.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import attnlab as al
from attnlab.cli import main as cli
from attnlab.train import checkpoint as ckpt

SECONDS = 10  # a case that takes longer counts as a hang


def _ours(err: BaseException) -> bool:
    return type(err).__module__.startswith("attnlab")


def _expect_clean_error(load, what: str) -> str:
    t0 = time.perf_counter()
    with pytest.raises(Exception) as info:
        load()
    took = time.perf_counter() - t0
    assert _ours(info.value), (
        f"{what}: {type(info.value).__module__}.{type(info.value).__name__}: {info.value}"
    )
    assert took < SECONDS, f"{what}: {took:.1f} s"
    return str(info.value)


def _tiny_model():
    cfg = al.presets.tiny(al.presets.get("llama2-7b"))
    torch.manual_seed(0)
    return al.build_model(cfg), cfg


def _safetensors_cuts(path: Path) -> list[int]:
    """Offsets at every section boundary (and inside each) plus random ones."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    edges = [0, 1, 4, 7, 8, 9, 8 + header_len // 2, 8 + header_len - 1, 8 + header_len]
    edges += [8 + header_len + 1, (8 + header_len + len(data)) // 2, len(data) - 1]
    rng = random.Random(0)
    edges += [rng.randrange(len(data)) for _ in range(6)]
    return sorted({e for e in edges if 0 <= e < len(data)})


# --- checkpoint folders --------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    model, cfg = _tiny_model()
    return ckpt.save(tmp_path / "run", "last", model, cfg, {"name": "t"}, {"step": 3})


def _rewrite_manifest(folder: Path) -> None:
    """Make the manifest match the (mutated) files, as a careless or hostile writer would: the
    integrity check passes, so the file parsers themselves must fail cleanly."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": ckpt._sha256(p)}
        for p in sorted(folder.iterdir())
        if p.name != ckpt.MANIFEST
    }
    (folder / ckpt.MANIFEST).write_text(json.dumps({"format": 1, "step": 3, "files": files}))


def test_checkpoint_with_every_safetensors_truncation(checkpoint: Path, tmp_path: Path):
    weights = checkpoint / "model.safetensors"
    original = weights.read_bytes()
    for cut in _safetensors_cuts(weights):
        weights.write_bytes(original[:cut])
        _rewrite_manifest(checkpoint)
        msg = _expect_clean_error(lambda: ckpt.load(checkpoint), f"cut at {cut}")
        assert "model.safetensors" in msg
    weights.write_bytes(random.Random(1).randbytes(len(original)))
    _rewrite_manifest(checkpoint)
    _expect_clean_error(lambda: ckpt.load(checkpoint), "random bytes")


@pytest.mark.parametrize(
    ("name", "content"),
    [("config.json", b"{not json"), ("config.json", b"[1, 2]"), ("config.json", b'{"arch": 1}'),
     ("recipe.json", b"\xff\xfe"), ("state.pt", b"PK\x03\x04 not a zip")],
)  # fmt: skip
def test_checkpoint_with_a_corrupt_file_behind_a_matching_manifest(checkpoint, name, content):
    (checkpoint / name).write_bytes(content)
    _rewrite_manifest(checkpoint)
    read = {"config.json": ckpt.load_config, "recipe.json": ckpt.load_recipe}.get(
        name, ckpt.load_state
    )
    assert name in _expect_clean_error(lambda: read(checkpoint), name)


def _manifest(folder: Path) -> dict:
    return json.loads((folder / ckpt.MANIFEST).read_text())


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda m: m.update(files={}), "does not list"),
        (lambda m: m["files"].pop("model.safetensors"), "does not list model.safetensors"),
        (lambda m: m["files"]["config.json"].pop("bytes"), "needs 'bytes'"),
        (
            lambda m: m["files"].update({"../../etc/passwd": m["files"]["config.json"]}),
            "plain name",
        ),
        (lambda m: m.update(files=[1, 2]), "no 'files' table"),
        (lambda m: m.clear(), "no 'files' table"),
    ],
)
def test_manifests_that_would_verify_nothing_are_refused(checkpoint: Path, change, says):
    m = _manifest(checkpoint)
    change(m)
    (checkpoint / ckpt.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ckpt.CheckpointError, match=says):
        ckpt.verify(checkpoint)


def test_truncated_weights_are_caught_by_the_manifest(checkpoint: Path):
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(ckpt.CheckpointError, match="truncated or altered"):
        ckpt.load(checkpoint)


def test_nan_weights_are_reported_at_load(checkpoint: Path, tmp_path: Path):
    model, cfg = _tiny_model()
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    folder = ckpt.save(tmp_path / "nan", "last", model, cfg, {"name": "t"}, {"step": 1})
    with pytest.raises(ckpt.CheckpointError, match="NaN or infinite"):
        ckpt.load(folder)
    fresh = al.build_model(cfg)
    ckpt.load_weights(folder, fresh, allow_nonfinite=True)  # for debugging: loads as it is
    assert torch.isnan(next(fresh.parameters())[0, 0])


def test_serve_on_a_corrupt_checkpoint_is_one_error_line(checkpoint: Path, capsys):
    pytest.importorskip("uvicorn")
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, another digest
    weights.write_bytes(bytes(data))
    assert cli(["serve", str(checkpoint), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "SHA-256" in err and "Traceback" not in err


# --- HF-format folders ---------------------------------------------------------------------------


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    model, _ = _tiny_model()
    model.hf_model_type = "llama"
    return al.interop.save_pretrained(model, tmp_path / "hf")


def test_hf_folder_with_every_safetensors_truncation(hf_folder: Path):
    weights = hf_folder / "model.safetensors"
    original = weights.read_bytes()
    for cut in _safetensors_cuts(weights):
        weights.write_bytes(original[:cut])
        msg = _expect_clean_error(lambda: al.interop.load_pretrained(hf_folder), f"cut at {cut}")
        assert "model.safetensors" in msg
    weights.write_bytes(b"\x00" * 8 + random.Random(2).randbytes(200))
    _expect_clean_error(lambda: al.interop.load_pretrained(hf_folder), "random bytes")


@pytest.mark.parametrize(
    "change",
    [
        lambda c: "{not json",
        lambda c: "[]",
        lambda c: json.dumps({**c, "num_attention_heads": 0}),
        lambda c: json.dumps({**c, "num_key_value_heads": 0}),
        lambda c: json.dumps({**c, "hidden_size": -4}),
        lambda c: json.dumps({**c, "hidden_size": "big"}),
        lambda c: json.dumps({k: v for k, v in c.items() if k != "hidden_size"}),
        lambda c: json.dumps({**c, "model_type": "no-such-family"}),
        lambda c: json.dumps({**c, "rope_parameters": {"rope_type": "warp", "rope_theta": 1e4}}),
    ],
)
def test_hf_config_json_that_is_broken(hf_folder: Path, change):
    path = hf_folder / "config.json"
    path.write_text(change(json.loads(path.read_text())))
    _expect_clean_error(lambda: al.interop.load_pretrained(hf_folder), path.read_text()[:60])


def test_a_shard_index_pointing_outside_its_folder_is_refused(hf_folder: Path, tmp_path: Path):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(hf_folder / "model.safetensors", outside)
    names = list(json.loads((hf_folder / "config.json").read_text()))  # any keys will do
    (hf_folder / "model.safetensors").unlink()
    index = {"weight_map": {names[0]: "../outside.safetensors"}}
    (hf_folder / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = _expect_clean_error(lambda: al.interop.load_pretrained(hf_folder), "index")
    assert "not a file name inside" in msg


def test_nan_weights_in_an_hf_folder_are_reported(hf_folder: Path):
    from safetensors.torch import load_file

    sd = load_file(hf_folder / "model.safetensors")
    name = next(iter(sd))
    sd[name] = sd[name].clone()
    sd[name].view(-1)[0] = float("inf")
    save_file(sd, hf_folder / "model.safetensors")
    msg = _expect_clean_error(lambda: al.interop.load_pretrained(hf_folder), "inf")
    assert "NaN or infinite" in msg and name in msg
    al.interop.load_pretrained(hf_folder, allow_nonfinite=True)


# --- YAML ----------------------------------------------------------------------------------------


def _alias_bomb(levels: int = 9) -> str:
    """'Billion laughs': each anchor lists the previous one ten times (10^levels strings)."""
    lines = ["l0: &l0 [" + ", ".join(["lol"] * 10) + "]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path: Path):
    from attnlab.config import ConfigError, ModelConfig
    from attnlab.train import recipes

    bomb = _alias_bomb()
    assert len(bomb) < 1500
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"aliases .* expand to more than") as info:
        ModelConfig.from_yaml(bomb + "arch: decoder\nvocab_size: *l8\n")
    assert len(str(info.value)) < 500  # the message quotes a bounded excerpt, not the input
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb + "steps: *l8\n")
    with pytest.raises(ConfigError, match="expand to more than"):
        recipes.load(path)
    with pytest.raises(ConfigError, match="refers to itself"):
        ModelConfig.from_yaml("a: &a [*a]\n")
    assert time.perf_counter() - t0 < 5


def test_config_errors_quote_a_bounded_excerpt():
    from attnlab.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict({"arch": "decoder", "vocab_size": list(range(1_000_000)),
                               "d_model": 8, "n_layers": 1, "n_heads": 1})  # fmt: skip
    assert len(str(info.value)) < 600


# --- sizes and GGUF files ------------------------------------------------------------------------


@pytest.mark.parametrize("change", [dict(d_model=100_000, n_heads=100), dict(n_layers=1_000_000)])
def test_sizes_beyond_the_memory_are_refused_before_allocating(change):
    from attnlab.build import ModelTooLargeError

    cfg = al.presets.get("gpt2-small").replace(**change)
    t0 = time.perf_counter()
    with pytest.raises(ModelTooLargeError, match=r"GiB of memory available: make it smaller"):
        al.build_model(cfg)
    assert time.perf_counter() - t0 < 5
    assert al.count_parameters(al.presets.get("gpt2-small")) > 0  # counting is untouched


def test_train_with_a_huge_override_is_one_error_line(capsys, tmp_path):
    argv = ["train", "shakespeare-char", "--run-dir", str(tmp_path / "r"),
            "--set", "model.overrides.d_model=100000", "--set", "model.overrides.n_heads=100"]  # fmt: skip
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this config has about") and "Traceback" not in err


def _tiny_hf_llama():
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from helpers.gguf_writing import tiny_hf_llama

    return tiny_hf_llama()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    from helpers.gguf_writing import write_gguf

    return write_gguf(tmp_path_factory.mktemp("gguf") / "m.gguf", _tiny_hf_llama(), "llama")


def test_gguf_with_every_truncation(gguf_file: Path, tmp_path: Path):
    data = gguf_file.read_bytes()
    rng = random.Random(3)
    cuts = sorted(
        {0, 3, 4, 8, 16, 24, 40, 100, 500, 2000, *(rng.randrange(len(data)) for _ in range(8))}
    )
    for cut in [c for c in cuts if c < len(data)]:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        _expect_clean_error(lambda p=path: al.interop.load_gguf(p), f"cut at {cut}")
    path = tmp_path / "random.gguf"
    path.write_bytes(data[:4] + rng.randbytes(4000))
    _expect_clean_error(lambda: al.interop.load_gguf(path), "random bytes")


@pytest.mark.parametrize(
    ("key", "value"),
    [("llama.attention.head_count", 0), ("llama.block_count", 1_000_000),
     ("llama.embedding_length", 0), ("llama.attention.head_count_kv", 3)],
)  # fmt: skip
def test_gguf_with_hostile_metadata(tmp_path: Path, key, value):
    from helpers.gguf_writing import write_gguf

    hf = _tiny_hf_llama()
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", **{key: value})
    _expect_clean_error(lambda: al.interop.load_gguf(path), f"{key} = {value}")


def test_gguf_with_nan_weights_is_refused(tmp_path: Path):
    from helpers.gguf_writing import write_gguf

    hf = _tiny_hf_llama()
    with torch.no_grad():
        hf.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    path = write_gguf(tmp_path / "m.gguf", hf, "llama")
    msg = _expect_clean_error(lambda: al.interop.load_gguf(path), "nan")
    assert "NaN or infinite" in msg
    g = al.interop.load_gguf(path, allow_nonfinite=True)
    assert torch.isnan(g.model.decoder.blocks[0].ffn.down_proj.weight).any()


# --- --set fuzz ----------------------------------------------------------------------------------

SETS = [
    "seed=-1", "seed=abc", "seed=1e400", "steps=0", "steps=-5", "steps=[1, 2]", "steps={a: 1}",
    "log_every=0", "precision=fp8", "model=3", "model.preset=nope", "model.preset=[1]",
    "model.overrides=5", "model.overrides.n_heads=0", "model.overrides.n_heads=7",
    "model.overrides.d_model=-1", "model.overrides.d_model=1.5", "model.overrides.d_model=nan",
    "model.overrides.n_layers=1000000", "model.overrides.d_model=100000",
    "model.overrides.positional=5", "model.overrides.positional.kind=warp",
    "model.overrides.positional={kind: rope, scaling: {kind: llama3, factor: 0}}",
    "model.overrides.attention.softcap=-1", "model.overrides.ffn={kind: moe, n_experts: 0}",
    "model.overrides.norm_placement=middle", "model.overrides.layer_pattern=[]",
    "model.overrides.layer_pattern=[{sliding_window: 0}]", "model.overrides.dropout=1.5",
    "model.overrides.vocab_size=99", "model.overrides.head_dim=0",
    "data=1", "data.kind=video", "data.context=0", "data.context=-3", "data.dataset=nope",
    "batch.size=0", "batch.size=x", "batch=[]", "optimizer.lr=-1", "optimizer.lr=inf",
    "optimizer.kind=sgd2", "optimizer.betas=[2, 3]", "schedule.kind=warp", "schedule.warmup=-1",
    "eval.every=0", "eval.batches=-1", "checkpoint.minutes=0", "checkpoint.every=-2",
    "decoding.temperature=-1", "unknown_key=1", "model.overrides.n_head=2", "=1", "steps",
    "a.b.c.d.e=1", "steps=&a [*a]", "model.overrides.d_ff=1e30",
]  # fmt: skip


def test_set_fuzz_ends_in_clean_errors():
    """Each --set item, applied to a recipe and its model built (the data's sizes given), is
    either valid or an attnlab error naming the problem, within seconds: no traceback, no hang."""
    from attnlab.train import recipes

    for item in SETS:
        t0 = time.perf_counter()
        try:
            recipe = recipes.load("shakespeare-char", [item])
            cfg = recipes.model_config(recipe.model, vocab_size=65)
            from attnlab.build import check_fits

            check_fits(cfg)  # what build_model does first
            with torch.device("meta"):
                al.build_model(cfg)
        except Exception as err:
            assert _ours(err), f"--set {item}: {type(err).__module__}.{type(err).__name__}: {err}"
        assert time.perf_counter() - t0 < SECONDS, f"--set {item}: {time.perf_counter() - t0:.1f} s"
