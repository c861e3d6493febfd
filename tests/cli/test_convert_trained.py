"""`attnlab convert` on the models the README trains from scratch (issue 49, items 2 and 10): the
character-level Shakespeare model in nanoGPT's recipe (learned positions, LayerNorm without bias,
exact GELU: written as GPT-2 with zero biases) and in the modern one (RoPE, RMSNorm, SwiGLU:
written as Llama), each trained here for a few dozen steps on a tiny text, leaves through
`attnlab convert` without --model-type:

- to an HF folder that transformers (AutoModelForCausalLM + AutoTokenizer) loads to the same
  token ids and the same greedy tokens as attnlab's own greedy decoding of the run;
- to a .gguf file whose character vocabulary is a byte-level BPE vocabulary without merges:
  llama.cpp (llama-cpp-python, where installed) tokenizes to the run's ids, computes its logits
  and greedy-generates its tokens; attnlab reads the file back to the same logits;
- a run fine-tuned from a .gguf file is written with that file's context length (item 10).

The references: attnlab's greedy decoding and logits of the run itself, transformers, llama.cpp.
"""

from __future__ import annotations

import gzip
import json
import re
import warnings
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from attnlab.cli import main
from attnlab.decode.generate import generate
from attnlab.loading import load_model
from helpers.train import set_args

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
try:
    import llama_cpp
except ImportError:  # llama-cpp-python is optional (benchmarks/check_llamacpp.py builds it)
    llama_cpp = None

TEXT = (
    "ROMEO:\nBut soft, what light through yonder window breaks?\n"
    "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?\n"
)
PROMPT = "ROMEO:\nBut soft"
N = 24  # greedy tokens; the prompt and these stay inside the 64 learned positions
SAMPLE = TEXT[:60]  # logits compared over it (64 learned positions)
# recipe -> the family its config matches (src/attnlab/interop/export_family.py)
FAMILY = {"shakespeare-char": "gpt2", "shakespeare-char-modern": "llama"}
# a seconds-long run of either recipe on TEXT (both recipes read these keys)
SETS = [
    "model.overrides.d_model=32", "model.overrides.n_layers=2", "data.context=32",
    "batch.size=8", "optimizer.lr=1e-2", "schedule.warmup=5", "steps=40", "eval.every=40",
    "eval.batches=1", "log_every=40", "eval.samples=[]",
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """recipe -> its run directory, trained on TEXT (each about a second after the imports)."""
    root = tmp_path_factory.mktemp("trained")
    data = root / "data" / "tinyshakespeare" / "input.txt.gz"
    data.parent.mkdir(parents=True)
    data.write_bytes(gzip.compress((TEXT * 100).encode()))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(root / "home"))  # the tokenizer cache stays in the test
        for recipe in FAMILY:
            argv = ["train", recipe, "--run-dir", str(root / recipe), "--data-dir",
                    str(root / "data"), "--device", "cpu", *set_args(SETS)]  # fmt: skip
            assert main(argv) == 0
    return {recipe: root / recipe for recipe in FAMILY}


def greedy(model, ids: list[int], n: int = N) -> list[int]:
    """attnlab's own greedy continuation: the reference."""
    with torch.no_grad():
        out = generate(model, torch.tensor([ids]), max_new_tokens=n, strategy="greedy")
    return out[0, len(ids) :].tolist()


def _convert(capsys, run, dst, *more: str) -> str:
    """`attnlab convert RUN DST` (no --model-type): asserts it succeeds; its stderr."""
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # GPT-2's GELU note (asserted below)
        assert main(["convert", str(run), str(dst), *more]) == 0
    return capsys.readouterr().err


@pytest.mark.parametrize("recipe", list(FAMILY))
def test_a_run_trained_here_converts_to_an_hf_folder_transformers_runs(
    recipe, runs, tmp_path, capsys
):
    err = _convert(capsys, runs[recipe], tmp_path / "hf")
    assert f"as {FAMILY[recipe]}, the family whose architecture matches" in err
    run = load_model(runs[recipe])
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.config.model_type == FAMILY[recipe]
    for text in (TEXT, PROMPT, "thou art"):
        assert tok(text).input_ids == run.tokenizer.encode(text).ids, text
    ids = run.tokenizer.encode(PROMPT).ids
    want = greedy(run.model, ids)
    assert len(set(want)) > 3  # a trained model's continuation, not one token repeated
    with torch.no_grad():
        got = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False)
    assert got[0, len(ids) :].tolist() == want
    assert tok.decode(want) == run.tokenizer.decode(want)
    # the family's default BOS / EOS (Llama's 1 and 2) are characters here: not written
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None


@pytest.mark.parametrize("recipe", list(FAMILY))
def test_a_run_trained_here_converts_to_gguf_that_llama_cpp_runs(recipe, runs, tmp_path, capsys):
    dst = tmp_path / "model.gguf"
    gelu = FAMILY[recipe] == "gpt2"  # exact GELU, which llama.cpp's gpt2 computes as tanh's
    note = (
        pytest.warns(RuntimeWarning, match="llama.cpp's gpt2 its tanh") if gelu else nullcontext()
    )
    with note:
        assert main(["convert", str(runs[recipe]), str(dst)]) == 0
    run, back = load_model(runs[recipe]), load_model(dst)
    meta = back.metadata
    assert meta["general.architecture"] == FAMILY[recipe]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.merges"] == []
    assert "Ġ" in meta["tokenizer.ggml.tokens"] and "Ċ" in meta["tokenizer.ggml.tokens"]
    ids = run.tokenizer.encode(PROMPT).ids
    want = greedy(run.model, ids)
    assert back.tokenizer.encode(TEXT).ids == run.tokenizer.encode(TEXT).ids
    text_ids = run.tokenizer.encode(SAMPLE).ids
    with torch.no_grad():
        ref = run.model(torch.tensor([text_ids])).logits[0].numpy()
        err = np.abs(back.model(torch.tensor([text_ids])).logits[0].numpy() - ref).max()
    # Llama: the same function; GPT-2: llama.cpp's (and so the reader's) tanh GELU
    assert err < (2e-3 if gelu else 1e-5), err
    assert greedy(back.model, ids) == want
    if llama_cpp is None:
        pytest.skip("llama-cpp-python is not installed: attnlab's reading checked only")
    llm = llama_cpp.Llama(str(dst), n_ctx=128, logits_all=True, n_threads=1, verbose=False)
    try:
        assert llm.tokenize(TEXT.encode(), add_bos=False, special=False) == (
            run.tokenizer.encode(TEXT).ids
        )
        llm.eval(text_ids)
        theirs = np.asarray(llm.scores[: len(text_ids)])
        assert np.abs(theirs - ref).max() < 5e-3  # llama.cpp keeps its KV cache in f16
        llm.reset()
        got = []
        for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            got.append(t)  # llama.cpp ends at id 11 unless told (a BPE vocabulary's default
            if len(got) == N:  # end-of-text, which a character vocabulary does not name)
                break
        assert got == want
        assert llm.detokenize(got).decode() == run.tokenizer.decode(want)
    finally:
        llm.close()


def test_the_readme_row_writes_q8_0(runs, tmp_path, capsys):
    """`attnlab convert runs/shakespeare-char x.gguf --quant q8_0`, the README's row: the
    weights in Q8_0 blocks, read back within Q8_0's rounding of the run's logits."""
    run = runs["shakespeare-char-modern"]
    _convert(capsys, run, tmp_path / "x.gguf", "--quant", "q8_0")
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "x.gguf")).tensors}
    assert kinds["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    ids = torch.tensor([load_model(run).tokenizer.encode(SAMPLE).ids])
    with torch.no_grad():
        want = load_model(run).model(ids).logits
        got = load_model(tmp_path / "x.gguf").model(ids).logits
    assert (got - want).abs().max().item() < 0.05


def test_a_config_no_family_expresses_is_refused_naming_the_fields(tmp_path, capsys):
    """ALiBi with Llama's parts: no family computes it; the refusal names the field for the
    nearest families and writes nothing."""
    import attnlab as al
    from attnlab.train import checkpoint

    cfg = al.presets.tiny(al.presets.get("llama3.2-1b")).merged(positional={"kind": "alibi"})
    run = tmp_path / "run"
    checkpoint.save(run, "last", al.build_model(cfg), cfg, {}, {"step": 1})
    (run / "tokenizer.json").write_text(_char_tokenizer("ab\n").to_str())
    for dst in ("out", "out.gguf"):
        assert main(["convert", str(run), str(tmp_path / dst)]) == 2
        err = capsys.readouterr().err
        assert "family computes this model exactly" in err
        assert "as llama: positional.kind = 'alibi': transformers' llama needs 'rope'" in err
        assert not (tmp_path / dst).exists()


def _char_tokenizer(text: str):
    from attnlab.data.tokenizers import _char

    return _char([text], None, [])


def test_a_character_vocabulary_is_written_as_bytes_or_refused_naming_the_characters():
    from attnlab.interop.gguf.tokenizer import byte_alphabet, gguf_vocab_items

    tok = _char_tokenizer("To be, or not\n")
    items = {k: v for k, v, _ in gguf_vocab_items(tok, tok.get_vocab_size())}
    alphabet = byte_alphabet()  # GPT-2's: ' ' -> 'Ġ', '\n' -> 'Ċ', printable ASCII as itself
    assert alphabet[ord(" ")] == "Ġ" and alphabet[ord("\n")] == "Ċ"
    want = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert items["tokenizer.ggml.tokens"] == [alphabet[ord(c)] for c, _ in want]
    assert items["tokenizer.ggml.merges"] == [] and items["tokenizer.ggml.pre"] == "gpt-2"
    wide = _char_tokenizer("café über\n")
    with pytest.raises(ValueError, match=r"2 character\(s\) of more than one byte.*'é', 'ü'"):
        gguf_vocab_items(wide, wide.get_vocab_size())


def test_encoder_decoder_models_are_bart_modules_business(monkeypatch):
    """choose_family hands an encoder-decoder config to attnlab.interop.bart.export_family."""
    import attnlab as al
    from attnlab.interop import bart
    from attnlab.interop.export_family import choose_family

    seen = []
    monkeypatch.setattr(bart, "export_family", lambda cfg, t: seen.append(t) or "marian", False)
    cfg = al.presets.tiny(al.presets.get("transformer-base-2017"))
    assert choose_family(cfg, "hf") == "marian" and seen == ["hf"]


def test_the_recipes_configs_choose_their_families():
    """The two recipes as written (full size), without training: GPT-2 and Llama, both ways."""
    from attnlab.interop.export_family import choose_family
    from attnlab.train import recipes

    for recipe, family in FAMILY.items():
        cfg = recipes.model_config(recipes.load(recipe).model, vocab_size=65)
        assert choose_family(cfg, "hf") == family == choose_family(cfg, "gguf")


# --- item 10: a fine-tuned checkpoint keeps its source's context length --------------------------


def test_a_run_fine_tuned_from_a_gguf_file_keeps_its_context_length(tmp_path, capsys):
    """SmolLM2's file says 8192; the run fine-tuned from it (configs/smollm2-shakespeare-quick.yaml,
    3 steps) was written back with Llama's default, 2048. Both formats now state the source's."""
    import transformers as tf

    from helpers.gguf_families import SMALL
    from helpers.gguf_writing import vocab_size, write_gguf

    torch.manual_seed(0)
    config = tf.LlamaConfig(**SMALL, vocab_size=vocab_size("gpt2"), max_position_embeddings=8192)
    src = write_gguf(tmp_path / "smol.gguf", tf.LlamaForCausalLM(config).eval(), "llama")
    data = tmp_path / "data" / "tinyshakespeare" / "input.txt.gz"
    data.parent.mkdir(parents=True)
    data.write_bytes(gzip.compress((TEXT * 20).encode()))
    run = tmp_path / "run"
    argv = ["train", "configs/smollm2-shakespeare-quick.yaml", "--run-dir", str(run),
            "--data-dir", str(tmp_path / "data"), "--device", "cpu",
            *set_args([f"model.pretrained={src}", "eval.samples=[]"])]  # fmt: skip
    assert main(argv) == 0
    _convert(capsys, run, tmp_path / "ft.gguf")
    assert load_model(tmp_path / "ft.gguf").metadata["llama.context_length"] == 8192
    _convert(capsys, run, tmp_path / "ft")
    hf = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert hf["max_position_embeddings"] == 8192


def test_a_run_trained_here_says_which_family_it_chose_and_model_type_overrides(
    runs, tmp_path, capsys
):
    """--model-type still decides; a family that does not fit is refused naming the field; one
    that fits gets the run's own special ids too, not the family's."""
    run = runs["shakespeare-char"]
    assert main(["convert", str(run), str(tmp_path / "x"), "--model-type", "llama"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"positional.kind = 'learned': transformers' llama needs 'rope'", err)
    assert not (tmp_path / "x").exists()
    run = runs["shakespeare-char-modern"]
    assert main(["convert", str(run), str(tmp_path / "y"), "--model-type", "llama"]) == 0
    assert "the family whose architecture matches" not in capsys.readouterr().err
    config = json.loads((tmp_path / "y" / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
