"""`attnlab convert` (src/attnlab/cli/convert.py) in every direction, and the atomic writes under
it (src/attnlab/atomic.py):

- GGUF -> GGUF keeps every tensor's storage type and bytes, and the tokenizer and model card keys;
- GGUF -> HF gives a folder transformers loads to the same logits and tokens as attnlab's model of
  the GGUF file; HF -> GGUF (q8_0, with the tokenizer.json written as llama.cpp's converter
  writes it) loads back with the same token ids and logits within Q8_0's rounding;
- a run directory is written as the family its config matches (--model-type names another),
  both ways (tests/cli/test_convert_trained.py: the runs the README trains);
- refusals name the problem and the fix; nothing is left at DST by a refusal; a value of
  --quant / --model-type that is not one gets a did-you-mean, a hub id the download to run, a
  file that cannot be read is named;
- an interrupted --force over an existing folder says what the disk holds (tests/test_atomic.py:
  each stage of the swap);
- a write stopped by SIGTERM leaves neither DST nor its partial; one killed by SIGKILL leaves no
  DST, and the next write to that DST removes the partial; save_pretrained writes config.json
  last, each file whole.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attnlab as al
from attnlab.atomic import PARTIAL, atomic_file, atomic_folder, partial_of
from attnlab.cli import main

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from attnlab.interop.gguf import load_gguf  # noqa: E402
from helpers.gguf_families import tiny  # noqa: E402
from helpers.gguf_writing import TEMPLATE, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
TEXTS = ["the weather in there", "héllo wörld 12345", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.fixture
def source(tmp_path):
    """A tiny Llama 3 written as llama.cpp would, its attention Q8_0 and feed-forward Q4_0, with a
    byte-level BPE vocabulary, a chat template and model-card keys."""
    types = {"attn_": Q.Q8_0, "ffn_": Q.Q4_0}
    card = {"general.license": "apache-2.0", "general.languages": ["en"]}
    path = write_gguf(tmp_path / "src.gguf", tiny("llama3"), "llama", types=types, **card)
    return path


def _tensors(path) -> dict:
    return {t.name: (t.tensor_type, bytes(t.data)) for t in gguf.GGUFReader(str(path)).tensors}


def _ids(n: int = 24, vocab: int = 250) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(3))


def test_gguf_to_gguf_keeps_every_tensor_and_key(source, tmp_path, capsys):
    assert main(["convert", str(source), str(tmp_path / "out.gguf")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert _tensors(tmp_path / "out.gguf") == _tensors(source)
    meta = load_gguf(tmp_path / "out.gguf").metadata
    want = load_gguf(source).metadata
    for key in ("general.license", "general.languages", "tokenizer.ggml.merges",
                "tokenizer.ggml.tokens", "tokenizer.chat_template", "llama.context_length"):  # fmt: skip
        assert meta[key] == want[key], key
    assert meta["general.file_type"] == want.get("general.file_type", meta["general.file_type"])


def test_gguf_to_hf_is_what_transformers_loads(source, tmp_path):
    out = tmp_path / "hf"
    assert main(["convert", str(source), str(out)]) == 0
    g = load_gguf(source)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = _ids(vocab=g.model.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, g.model(ids).logits, rtol=1e-5, atol=1e-5)
    for text in TEXTS:
        assert tok(text).input_ids == g.tokenizer.encode(text).ids, text
    assert tok.chat_template == TEMPLATE == g.chat_template
    assert tok.eos_token == "<|im_end|>"
    assert hf.config.max_position_embeddings == g.metadata["llama.context_length"]


def test_hf_to_gguf_quantized_reads_back(source, tmp_path):
    folder = tmp_path / "hf"
    assert main(["convert", str(source), str(folder), "--dtype", "f32"]) == 0
    out = tmp_path / "q8.gguf"
    assert main(["convert", str(folder), str(out), "--quant", "q8_0"]) == 0
    back, ref = load_gguf(out), load_gguf(source)
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert kinds["blk.0.attn_q.weight"] == Q.Q8_0 and kinds["blk.0.attn_norm.weight"] == Q.F32
    for text in TEXTS:
        assert back.tokenizer.encode(text).ids == ref.tokenizer.encode(text).ids, text
    assert back.metadata["tokenizer.ggml.pre"] == "gpt-2"  # the tokenizer.json's own split
    assert back.chat_template == TEMPLATE and back.eos_token_ids == ref.eos_token_ids
    ids = _ids(vocab=ref.model.vocab_size)
    with torch.no_grad():
        err = (back.model(ids).logits - ref.model(ids).logits).abs().max().item()
    assert err < 0.05, err


def test_a_run_directory_is_written_as_its_family_both_ways(source, tmp_path, capsys):
    from attnlab.train import checkpoint

    g = load_gguf(source)
    run = tmp_path / "run"
    checkpoint.save(run, "last", g.model, g.model.config, {}, {"step": 1})
    g.tokenizer.save(str(run / "tokenizer.json"))
    assert main(["convert", str(run), str(tmp_path / "a")]) == 0
    assert "as llama, the family whose architecture matches" in capsys.readouterr().err
    assert main(["convert", str(run), str(tmp_path / "b.gguf"), "--model-type", "llama",
                 "--vocab-from", str(source), "--dtype", "f16"]) == 0  # fmt: skip
    ids = _ids(vocab=g.model.vocab_size)
    with torch.no_grad():
        want = g.model(ids).logits
        hf = al.interop.load_pretrained(tmp_path / "a")
        torch.testing.assert_close(hf(ids).logits, want, rtol=1e-5, atol=1e-5)
        err = (load_gguf(tmp_path / "b.gguf").model(ids).logits - want).abs().max().item()
    assert err < 0.02, err
    assert load_gguf(tmp_path / "b.gguf").metadata["general.license"] == "apache-2.0"


@pytest.mark.parametrize(
    "args, message",
    [
        (["{dst}.gguf"], "exists: choose another DST, or pass --force"),
        (["{tmp}/x", "--quant", "q8_0"], "--quant q8_0 writes GGUF blocks"),
        (["{tmp}/x.gguf", "--quant", "q4_k"], "cannot quantize K-quants.*llama-quantize"),
        (["{tmp}/x", "--to", "gguf"], r"name it x\.gguf"),
        (["{tmp}/x.gguf", "--dtype", "f16", "--quant", "q8_0"], "give one"),
        (["{src}"], "exists"),
    ],
)
def test_refusals_name_the_problem_and_write_nothing(source, tmp_path, capsys, args, message):
    (tmp_path / "dst.gguf").write_bytes(b"old")
    argv = [a.format(dst=tmp_path / "dst", tmp=tmp_path, src=source) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["convert", str(source), *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / "dst.gguf").read_bytes() == b"old"


def test_force_replaces_an_existing_destination(source, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("x")
    assert main(["convert", str(source), str(tmp_path / "out"), "--force"]) == 0
    assert not (tmp_path / "out" / "stale.txt").exists()
    assert (tmp_path / "out" / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir() if PARTIAL in p.name] == []


# --- atomic writes under signals -----------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from attnlab.atomic import atomic_file, atomic_folder
    dst, kind = Path(sys.argv[1]), sys.argv[2]
    with (atomic_file(dst) if kind == "file" else atomic_folder(dst)) as tmp:
        target = tmp if kind == "file" else tmp / "model.safetensors"
        target.write_bytes(b"x" * 1000)
        print("writing", flush=True)
        time.sleep(60)
    """
)


def _stopped_writer(tmp_path: Path, kind: str, sig: int) -> tuple[subprocess.Popen, Path]:
    dst = tmp_path / ("out.bin" if kind == "file" else "out")
    env = dict(os.environ, PYTHONPATH=str(Path(al.__file__).parents[1]))
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(dst), kind], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert p.stdout.readline().strip() == "writing"
    assert partial_of(dst, p.pid).exists()  # mid-write: the partial, never DST
    p.send_signal(sig)
    p.communicate(timeout=30)
    assert not dst.exists()
    return p, partial_of(dst, p.pid)


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_sigterm_mid_write_leaves_nothing(tmp_path, kind):
    p, partial = _stopped_writer(tmp_path, kind, signal.SIGTERM)
    assert p.returncode != 0
    assert not partial.exists()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_sigkill_leaves_no_destination_and_the_next_write_sweeps(tmp_path, kind):
    p, partial = _stopped_writer(tmp_path, kind, signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL
    assert partial.exists()  # nothing can clean up after SIGKILL ...
    dst = tmp_path / ("out.bin" if kind == "file" else "out")
    with atomic_file(dst) if kind == "file" else atomic_folder(dst) as tmp:
        (tmp if kind == "file" else tmp / "f").write_text("whole")
    assert not partial.exists()  # ... but the next write to that DST does
    assert (dst if kind == "file" else dst / "f").read_text() == "whole"


def test_a_failed_write_removes_its_partial_and_keeps_the_old_file(tmp_path):
    dst = tmp_path / "f.txt"
    dst.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(dst) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert dst.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]


def test_save_pretrained_writes_config_last_and_each_file_whole(tmp_path, monkeypatch):
    """Stopped while writing the weights: no config.json (it names weights the folder lacks),
    no partial; a complete save is readable by others (0644 under umask 022)."""
    import safetensors.torch

    model = al.build_model(al.presets.tiny(al.presets.get("llama3.2-1b")))

    def fails(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", fails)
    with pytest.raises(KeyboardInterrupt):
        al.interop.save_pretrained(model, tmp_path / "m", "llama")
    assert list((tmp_path / "m").iterdir()) == []
    monkeypatch.undo()
    old = os.umask(0o022)
    try:
        al.interop.save_pretrained(model, tmp_path / "m", "llama")
    finally:
        os.umask(old)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    assert (tmp_path / "m" / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_the_pre_tokenizer_is_named_as_llama_cpp_names_it():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from attnlab.interop.gguf.tokenizer import SPLITS, gguf_vocab_items, pre_tokenizer_name

    def named(pre) -> str | None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre
        import json

        return pre_tokenizer_name(json.loads(tok.to_str())["pre_tokenizer"])

    assert named(pre_tokenizers.ByteLevel(add_prefix_space=False)) == "gpt-2"
    digits = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel()]
    assert named(pre_tokenizers.Sequence(digits)) == "smollm"
    for name in ("llama3", "qwen2", "gpt-4o"):
        split = [pre_tokenizers.Split(Regex(SPLITS[name]), behavior="isolated"),
                 pre_tokenizers.ByteLevel(use_regex=False)]  # fmt: skip
        assert SPLITS[named(pre_tokenizers.Sequence(split))] == SPLITS[name]
    assert named(pre_tokenizers.Whitespace()) is None
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    with pytest.raises(
        ValueError, match=r"writes byte-level BPE vocabularies.*the \.gguf file the model came from"
    ):
        gguf_vocab_items(wordpiece, 2)


def test_a_model_no_llama_cpp_architecture_expresses_is_refused_naming_the_part(
    source, tmp_path, capsys
):
    """ALiBi with SwiGLU and RMSNorm: as llama it lacks RoPE, as MPT (ALiBi) its norm and FFN
    are not MPT's; each refusal names the field and what the family needs, and writes nothing."""
    from attnlab.train import checkpoint

    cfg = al.presets.tiny(al.presets.get("llama3.2-1b")).merged(positional={"kind": "alibi"})
    model = al.build_model(cfg)
    run = tmp_path / "run"
    checkpoint.save(run, "last", model, cfg, {}, {"step": 1})
    load_gguf(source).tokenizer.save(str(run / "tokenizer.json"))
    for family, needs in (("llama", "positional.kind = 'alibi': transformers' llama needs 'rope'"),
                          ("mpt", "norm.kind = 'rmsnorm': transformers' mpt needs 'layernorm'")):  # fmt: skip
        dst = tmp_path / f"{family}.gguf"
        assert main(["convert", str(run), str(dst), "--model-type", family]) == 2
        assert needs in capsys.readouterr().err
        assert not dst.exists()


# --- what an interrupted --force leaves, said as it is (issue 49, item 18) ------------------------


@pytest.mark.parametrize("stage", ["writing", "removing the old folder"])
def test_an_interrupted_force_says_what_the_folder_holds(
    source, tmp_path, capsys, monkeypatch, stage
):
    """Stopped while the new folder is written: the old one is there and the message says so;
    stopped while the old one is removed (after the swap): the new one is there and the
    message says that (before: "nothing was written" either way, and the old folder stayed
    beside it as `.out.old.attnlab-partial-PID` for good). The next convert leaves nothing
    beside DST."""
    import safetensors.torch

    from attnlab import atomic

    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    if stage == "writing":

        def stop(*a, **kw):
            raise atomic.Interrupted("stopped by signal SIGTERM")

        monkeypatch.setattr(safetensors.torch, "save_file", stop)
    else:
        real = atomic._remove

        def stop(p):
            if p.name.endswith(".old") and p.exists():
                raise KeyboardInterrupt
            real(p)

        monkeypatch.setattr(atomic, "_remove", stop)
    rc = main(["convert", str(source), str(out), "--force"])
    err = capsys.readouterr().err
    if stage == "writing":
        assert rc == 2 and f"nothing new was written: {out} holds what it held before" in err
        assert (out / "stale.txt").read_text() == "old"
    else:
        assert rc == 130 and f"{out} holds the new conversion" in err
        assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    monkeypatch.undo()
    assert main(["convert", str(source), str(out), "--force"]) == 0
    assert [p.name for p in tmp_path.iterdir() if PARTIAL in p.name] == []


# --- what a refusal names (issue 49, items 3, 15, 19) ---------------------------------------------


@pytest.mark.parametrize(
    "flag, value, hint",
    [("--quant", "q8", "Did you mean 'q8_0'"), ("--dtype", "fp16", "Did you mean 'f16'"),
     ("--model-type", "lama", "Did you mean 'llama'")],
)  # fmt: skip
def test_a_misspelt_choice_gets_a_did_you_mean(source, tmp_path, capsys, flag, value, hint):
    argv = ["convert", str(source), str(tmp_path / "x.gguf"), flag, value]
    try:
        rc = main(argv)
    except SystemExit as stop:  # argparse's own refusal of a flag's value
        rc = stop.code
    assert rc == 2
    err = capsys.readouterr().err
    assert hint in err and value in err
    assert not (tmp_path / "x.gguf").exists()


def test_a_hub_id_is_answered_with_the_download(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "HuggingFaceTB/SmolLM2-135M", "out.gguf"]) == 2
    err = capsys.readouterr().err
    assert "hf download HuggingFaceTB/SmolLM2-135M --local-dir DIR" in err


def _broken(tmp_path, source, what: str):
    """(SRC, extra args, the file the message must name) for one kind of damage."""
    if what in ("not a gguf", "truncated"):
        bad = tmp_path / "bad.gguf"
        data = source.read_bytes()
        bad.write_bytes(b"not a GGUF file" if what == "not a gguf" else data[: len(data) // 3])
        return source, ["--vocab-from", str(bad)], bad
    folder = tmp_path / "hf"
    assert main(["convert", str(source), str(folder)]) == 0
    if what == "tokenizer_config.json":
        (folder / what).write_text("{not json")
        return folder, [], folder / what
    # the file the loader takes eos_token_id from: generation_config.json, else config.json
    named = next(
        f for f in (folder / "generation_config.json", folder / "config.json") if f.exists()
    )
    named.write_text(json.dumps(dict(json.loads(named.read_text()), eos_token_id="abc")))
    return folder, [], named


@pytest.mark.parametrize(
    "what", ["not a gguf", "truncated", "tokenizer_config.json", "eos_token_id"]
)
def test_a_file_convert_cannot_read_is_named(source, tmp_path, capsys, what):
    src, more, named = _broken(tmp_path, source, what)
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "x.gguf"), *more]) == 2
    err = capsys.readouterr().err
    assert str(named) in err and "Traceback" not in err
    assert not (tmp_path / "x.gguf").exists()


def test_a_size_no_gguf_file_holds_is_refused_naming_the_key(source, tmp_path, capsys):
    """A u64 context length of 2^62 (GGUF -> GGUF): llama.cpp reads context_length as a u32,
    so the writer refuses it by name instead of ending in struct.error's traceback."""
    from attnlab.interop.gguf.reader import _value

    reader = gguf.GGUFReader(str(source))
    w = gguf.GGUFWriter(str(tmp_path / "huge.gguf"), "llama")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "llama.context_length":
            w.add_uint64(key, 2**62)
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, _value(f), f.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type if t.tensor_type != Q.F32 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert main(["convert", str(tmp_path / "huge.gguf"), str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert "llama.context_length = 4611686018427387904 does not fit GGUF's UINT32" in err
    assert not (tmp_path / "x.gguf").exists()
