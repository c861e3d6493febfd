"""Broken and hostile JSON files of an HF-format folder through the commands a user runs
(`attnlab inspect`, `generate`, `convert`): each ends in one error line naming the file (and the
key) within seconds and without the memory a size it claims would take (issue 49, item 19; the
third fault probe's files). Every folder is a valid one (save_pretrained's config.json and
weights, a word-level tokenizer.json) with one file changed; the reference that the rest is
sound: the unchanged folder is inspected and generates (`test_the_unchanged_folder_works`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import attnlab as al
from helpers.guarded_cli import run_guarded

SECONDS = 10  # each command, in a child process whose imports are already paid
GREW = 300 * 2**20  # peak memory a refused folder may add: the fixes refuse before allocating


def _config(change):
    return lambda folder: _edit(folder / "config.json", change)


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    new = change(data)
    path.write_text(new if isinstance(new, str) else json.dumps(new))


# name -> (how the folder is changed, the command, what the message says besides the file)
CASES = {
    "list": (_config(lambda c: "[1, 2]"), "inspect", "config.json", "JSON list"),
    "nested": (_config(lambda c: "[" * 100_000 + "]" * 100_000), "inspect", "config.json", "nests"),
    "not-json": (_config(lambda c: "{not json"), "inspect", "config.json", "not JSON"),
    "layers": (
        _config(lambda c: {**c, "num_hidden_layers": 10**9}), "inspect", "config.json",
        "num_hidden_layers = 1,000,000,000",
    ),
    "wide": (  # 1.9 GB of parameters claimed beside 0.4 MB of weights
        _config(lambda c: {**c, "hidden_size": 4096, "intermediate_size": 16384}), "generate",
        "config.json", "hidden_size = 4,096",
    ),
    "tokenizer-config": (
        lambda f: (f / "tokenizer_config.json").write_text("{not json"), "convert",
        "tokenizer_config.json", "not JSON",
    ),
    "eos-in-generation-config": (
        lambda f: _edit(f / "generation_config.json", lambda g: {**g, "eos_token_id": "abc"}),
        "convert", "generation_config.json", "eos_token_id = 'abc'",
    ),
    "eos-in-config": (
        _config(lambda c: {**c, "eos_token_id": "abc"}), "generate", "config.json",
        "eos_token_id = 'abc'",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-config")
    cfg = al.presets.tiny(al.presets.get("llama2-7b"))
    torch.manual_seed(0)
    model = al.build_model(cfg)
    model.hf_model_type = "llama"
    ok = al.interop.save_pretrained(model, root / "ok")
    vocab = {"[UNK]": 0, **{chr(97 + i): 1 + i for i in range(26)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(ok / "tokenizer.json"))
    out = {"ok": ok}
    for name, (change, *_) in CASES.items():
        out[name] = shutil.copytree(ok, root / name)
        change(out[name])
    return out


@pytest.fixture(scope="module")
def outcomes(folders, tmp_path_factory):
    dst = tmp_path_factory.mktemp("out")
    gen = ["--prompt", "hi", "--max-new-tokens", "2", "--temperature", "0"]

    def command(name: str, kind: str) -> list[str]:
        if kind == "generate":
            return ["generate", str(folders[name]), *gen]
        if kind == "convert":
            return ["convert", str(folders[name]), str(dst / name), "--to", "hf"]
        return ["inspect", str(folders[name])]

    commands = {f"ok {k}": command("ok", k) for k in ("inspect", "generate", "convert")}
    # "layers" last: before the fix it hung, and the deadline cuts off every command after it
    for name in sorted(CASES, key=lambda n: n == "layers"):
        commands[name] = command(name, CASES[name][1])
    return dict(zip(commands, run_guarded(list(commands.values())), strict=True))


@pytest.mark.parametrize("kind", ["inspect", "generate", "convert"])
def test_the_unchanged_folder_works(outcomes, kind):
    got = outcomes[f"ok {kind}"]
    assert got is not None and got.rc == 0, got


@pytest.mark.parametrize("name", list(CASES))
def test_a_broken_json_file_is_one_error_naming_it(outcomes, folders, name):
    _, _, file, says = CASES[name]
    got = outcomes[name]
    assert got is not None, f"{name}: still running at the deadline (a hang) or killed at the cap"
    assert got.rc == 2 and "Traceback" not in got.err, f"{name}: rc {got.rc}: {got.err}"
    line = got.err.strip()
    assert line.startswith("error: ") and "\n" not in line, line
    assert str(folders[name] / file) in line, f"{name}: the message does not name {file}: {line}"
    assert says in line, f"{name}: {says!r} not in {line}"
    assert got.seconds < SECONDS, f"{name}: {got.seconds:.1f} s"
    assert got.grew < GREW, f"{name}: the peak memory rose by {got.grew / 2**20:.0f} MiB"
