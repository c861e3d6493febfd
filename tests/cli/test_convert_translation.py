"""`attnlab convert RUN DIR` of a translation run (src/attnlab/train/translation_folder.py,
src/attnlab/interop/bart.py): the README's recipe (configs/multi30k-de-en-quick.yaml, pre-norm
with final norms) leaves as Pegasus, the paper's post-norm as Marian, and transformers reading the
folder translates as `attnlab translate` does:

- AutoTokenizer encodes a source to the ids attnlab's encoder reads (ids + EOS, right-padded);
- generate with the folder's own settings (beams, length penalty, start / end / pad tokens)
  prints `attnlab translate`'s translations; greedy too; and for every batch `translate` decodes,
  generate given the same source and length limit returns the same token ids;
- one forward's logits agree to float rounding;
- what has no target is refused in one line naming the field and the change that exports:
  LayerNorm eps 1e-6 (the 2017 preset's; both families fix 1e-5), and any .gguf (llama.cpp has
  no Marian).

The runs train in seconds on a word-for-word "translation" of a 15-word lexicon written in the
Multi30k layout (tests/train/conftest.py's copy task, with a dictionary), learnable enough that
each sentence gets its own translation that ends with EOS.
"""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest
import torch

import attnlab as al
from attnlab.cli import main
from attnlab.loading import load_model
from helpers.train import TINY, set_args

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

LEXICON = {"ein": "a", "mann": "man", "eine": "one", "frau": "woman", "hund": "dog",
           "katze": "cat", "spielt": "plays", "läuft": "runs", "im": "in the", "park": "park",
           "auf": "on", "der": "the", "straße": "street", "rot": "red", "blau": "blue"}  # fmt: skip
SOURCES = ["ein mann läuft im park", "eine katze spielt", "der hund läuft auf der straße",
           "ein hund", "rot blau rot katze frau"]  # fmt: skip
STEPS = 120
# the recipe's norms with nn.LayerNorm's eps, which Marian and Pegasus fix (bart.py)
EPS = "model.overrides.norm.eps=1e-5"
PLACEMENTS = {
    "pegasus": [],  # the quick recipe as it is: pre-norm, final norms
    "marian": ["model.overrides.norm_placement=post", "model.overrides.final_norm=false"],
}


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A HOME of the module's own (tokenizer cache), the built CPU kernels of the real one."""
    from torch.utils.cpp_extension import get_default_build_root

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", get_default_build_root())  # before HOME changes
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        yield


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    for split, n in (("train", 400), ("val", 20), ("test_2016_flickr", 20)):
        de = [rng.choices(list(LEXICON), k=rng.randint(2, 6)) for _ in range(n)]
        for lang, lines in (("de", de), ("en", [[LEXICON[w] for w in s] for s in de])):
            path = root / "multi30k" / f"{split}.{lang}.gz"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(gzip.compress("".join(" ".join(s) + "\n" for s in lines).encode()))
    return root


@pytest.fixture(scope="module", params=list(PLACEMENTS))
def run(request, home, data_dir, tmp_path_factory) -> tuple[str, Path]:
    """(the family it leaves as, a trained run directory)."""
    family = request.param
    run = tmp_path_factory.mktemp(family) / "run"
    sets = [*TINY["multi30k-de-en-quick"], f"steps={STEPS}", f"eval.every={STEPS}", EPS]
    argv = ["train", "multi30k-de-en-quick", "--run-dir", str(run), "--data-dir",
            str(data_dir), "--device", "cpu", *set_args(sets + PLACEMENTS[family])]  # fmt: skip
    assert main(argv) == 0
    return family, run


def _convert(run: Path, out: Path, capsys, *extra: str) -> str:
    capsys.readouterr()
    assert main(["convert", str(run), str(out), *extra]) == 0, capsys.readouterr().err
    return capsys.readouterr().err


def _translate(run: Path, capsys, *extra: str) -> list[str]:
    capsys.readouterr()
    assert main(["translate", str(run), *extra, *SOURCES, "--device", "cpu"]) == 0
    return capsys.readouterr().out.splitlines()


def _cut(row: torch.Tensor, eos: int) -> list[int]:
    """A generated row up to and with its first EOS (what follows is padding)."""
    ids = row.tolist()
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_transformers_translates_the_folder_as_attnlab_translate(run, tmp_path, capsys):
    family, run_dir = run
    out = tmp_path / "hf"
    assert f"as {family}" in _convert(run_dir, out, capsys)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert hf.config.model_type == family

    # the source ids attnlab's encoder reads (src/attnlab/train/tasks/translation.py)
    loaded = load_model(run_dir)
    ids = al.data.special_ids(loaded.tokenizer)
    src = al.data.collate_translation(
        [(al.data.encode(loaded.tokenizer, s), []) for s in SOURCES],
        ids["pad"], ids["bos"], ids["eos"],
    )  # fmt: skip
    enc = tok(SOURCES, padding=True, return_tensors="pt")
    assert torch.equal(enc["input_ids"], src["input_ids"])
    assert torch.equal(enc["attention_mask"], src["attention_mask"])

    # beam search with the folder's own settings (the recipe's 2 beams), then greedy
    beams = _translate(run_dir, capsys)
    assert len(set(beams)) == len(SOURCES) and all(beams), beams  # it learned: the test has teeth
    assert tok.batch_decode(hf.generate(**enc), skip_special_tokens=True) == beams
    greedy = _translate(run_dir, capsys, "--beams", "1")
    got = tok.batch_decode(hf.generate(**enc, num_beams=1), skip_special_tokens=True)
    assert got == greedy

    # token for token: every batch `translate` decodes, given to generate as it is
    from attnlab.train.tasks import translation as tasks

    calls, real = [], tasks.generate

    def spy(model, src, **kw):
        out = real(model, src, **kw)
        calls.append((src, kw, out))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tasks, "generate", spy)
        for extra in ((), ("--beams", "1"), ("--beams", "3")):
            _translate(run_dir, capsys, *extra)
    assert len(calls) == 3
    for src_ids, kw, ours in calls:
        theirs = hf.generate(
            input_ids=src_ids,
            attention_mask=kw["attention_mask"],
            max_new_tokens=kw["max_new_tokens"],
            num_beams=kw.get("num_beams", 1),
        )
        assert [_cut(r, ids["eos"]) for r in theirs] == [_cut(r, ids["eos"]) for r in ours]


def test_one_forward_has_the_same_logits(run, tmp_path, capsys):
    _, run_dir = run
    _convert(run_dir, tmp_path / "hf", capsys)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    ours = load_model(run_dir).model
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, ours.vocab_size, (3, 9), generator=g)
    tgt = torch.randint(4, ours.vocab_size, (3, 7), generator=g)
    mask = torch.ones_like(src)
    mask[1, 6:] = 0  # a padded row
    with torch.no_grad():
        a = ours(src, tgt, mask).logits
        b = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    # float rounding: transformers' fp64-made sinusoid table, sums in permuted channel order
    assert (a - b).abs().max().item() < 1e-4 * a.abs().max().item()


def test_what_has_no_target_is_refused_in_one_line(run, tmp_path, capsys):
    _, run_dir = run
    capsys.readouterr()
    assert main(["convert", str(run_dir), str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "llama.cpp has no Marian" in err and "--to hf" in err, err
    assert not (tmp_path / "x.gguf").exists()


def test_the_2017_presets_layernorm_eps_is_refused_with_the_fix(home, tmp_path, capsys):
    """transformer-base-2017 keeps tensor2tensor's eps 1e-6; Marian and Pegasus compute 1e-5."""
    from attnlab.train import checkpoint

    for placement in ("post", "pre"):
        cfg = al.presets.tiny(al.presets.get("transformer-base-2017"), vocab_size=64)
        cfg = cfg.replace(norm_placement=placement, final_norm=placement == "pre")
        run = tmp_path / placement
        tokenizer = {"tokenizer.json": _tokenizer_json().encode()}
        checkpoint.save(run, "last", al.build_model(cfg), cfg, {}, {"step": 1}, tokenizer)
        capsys.readouterr()
        assert main(["convert", str(run), str(tmp_path / f"{placement}-hf")]) == 2
        err = capsys.readouterr().err
        assert "norm.eps = 1e-06" in err and "--set model.overrides.norm.eps=1e-5" in err, err
        assert "Traceback" not in err and not (tmp_path / f"{placement}-hf").exists()


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", "a", "b"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(["<pad>", "<s>", "</s>", "<unk>"])
    return tok.to_str()
