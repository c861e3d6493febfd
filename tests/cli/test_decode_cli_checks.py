"""`attnlab generate`, `chat`, `translate` and `eval` as a user meets them when something is off
(issue 49, items 3, 4, 7, 8, 16, 17), through the entry point (`attnlab.cli.main`, stdin
monkeypatched), on tiny models built here:

- a model of the wrong kind names the command that was run and the one to use (3);
- every numeric flag out of its range is one argparse line naming the flag and the range (4);
- a reply cut at its token limit says so and names the flag, `chat` says it is loading, and
  `generate` reports prompt and reply tokens and tokens/s on stderr, stdout being the text (7);
- `translate RUN --beams 1 "..."` takes options before the sentences, and no sentences is
  said, with a hint on a terminal (8);
- a prompt or chat message past the model's context is refused with its count and the limit,
  and a reply ends at the context (16);
- stdin or --prompt that is not UTF-8 is one line naming the byte and where it is (17).

Each reply is checked against `attnlab.generate`'s greedy tokens (the library call), each
translation against `attnlab.train.tasks.translate`.
"""

from __future__ import annotations

import io
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import attnlab as al
from attnlab.cli import main

pytest.importorskip("tokenizers")

TEXT = "to be or not to be, that is the question"
CONTEXT = 40  # the context the HF folder states (config.json): its model is RoPE, unbounded
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # characters in TEXT only
GREEDY = ["--temperature", "0", "--threads", "1"]


class _Model:
    def __init__(self, folder: Path, model, tok):
        self.folder, self.model, self.tok = folder, model, tok
        self.eos = tok.token_to_id("</s>")

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def greedy(self, text: str, n: int) -> list[int]:
        """The library's greedy continuation of `text`: n tokens, cut at the first EOS."""
        ids = torch.tensor([self.ids(text)])
        new = al.generate(self.model, ids, n, eos_token_id=self.eos)[0, ids.shape[1] :].tolist()
        return new[: new.index(self.eos)] if self.eos in new else new


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> _Model:
    """A tiny Llama HF folder with a character tokenizer, a chat template that writes each
    message followed by a space, and a stated context of CONTEXT tokens."""
    from attnlab.data import train_tokenizer

    root = tmp_path_factory.mktemp("lm")
    tok = train_tokenizer("char", [TEXT], 0, cache_dir=root / "c")
    cfg = al.presets.tiny(al.presets.get("llama2-7b"), vocab_size=tok.get_vocab_size())
    torch.manual_seed(0)
    model = al.build_model(cfg.replace(init="xavier")).eval()
    folder = root / "m"
    al.interop.save_pretrained(model, folder, "llama")
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return _Model(folder, model, tok)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Run folders as `attnlab train` leaves them (checkpoint, recipe, tokenizer), untrained: a
    translation run, a language-model run and a classification run."""
    from attnlab.data import train_tokenizer
    from attnlab.train import checkpoint, recipes

    root = tmp_path_factory.mktemp("runs")
    tok = train_tokenizer("char", ["ein hund läuft im park. a dog runs."], 0, cache_dir=root / "c")
    out = {}
    for name, preset, recipe in (
        ("mt", "transformer-base-2017", "multi30k-de-en-quick"),
        ("lm", "gpt2-small", "shakespeare-char"),
        ("cls", "bert-base", "sst2"),
    ):
        torch.manual_seed(0)
        cfg = al.presets.tiny(al.presets.get(preset), vocab_size=tok.get_vocab_size())
        model = al.build_model(cfg)
        checkpoint.save(
            root / name, "best", model, model.config, recipes.load(recipe).to_dict(),
            {"step": 1}, {"tokenizer.json": tok.to_str().encode()},
        )  # fmt: skip
        out[name] = root / name
    return out


class _Stdin(io.TextIOWrapper):
    """stdin holding `data` (bytes), decoded as Python decodes a pipe under the C locale
    (surrogateescape: bad bytes become lone surrogates) or strictly; a terminal if `tty`."""

    def __init__(self, data: bytes, errors: str = "surrogateescape", tty: bool = False):
        super().__init__(io.BytesIO(data), encoding="utf-8", errors=errors)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _run(capsys, monkeypatch, argv: list[str], stdin: bytes = b"", **how) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", _Stdin(stdin, **how))
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def _one_error(err: str) -> str:
    """The one line of an error (after chat's "loading" lines), and nothing else."""
    lines = [x for x in err.splitlines() if not x.startswith(("loading ", "loaded in "))]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


# item 3: the command that was run, and the one to use


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_translation_or_encoder_run_names_the_command_run_and_the_one_to_use(
    runs, capsys, monkeypatch, command
):
    extra = ["--prompt", "hi"] if command == "generate" else []
    mt = (
        f"an encoder-decoder (translation) model: translate with it: attnlab translate {runs['mt']}"
    )
    for run, says in (
        ("mt", f'{mt} "a sentence"'),
        ("cls", f"which generates no text: evaluate it with attnlab eval {runs['cls']}"),
    ):
        status, out, err = _run(capsys, monkeypatch, [command, runs[run], *extra])
        line = _one_error(err)
        assert status == 2 and out == ""
        assert line.startswith(f"error: attnlab {command} ") and "decoder-only" in line, line
        assert "serve" not in line and line.endswith(says), line


def test_serve_names_itself_through_the_same_check(runs):
    from attnlab.cli.runs import check_decoder_only
    from attnlab.loading import load_model

    with pytest.raises(
        ValueError, match=r"^attnlab serve serves decoder-only .* attnlab translate"
    ):
        check_decoder_only(load_model(runs["mt"]).model, runs["mt"], "serve")


def test_translate_sends_a_language_model_run_to_generate_and_an_encoder_run_to_eval(
    runs, capsys, monkeypatch
):
    for run, says in (
        ("lm", f'continue text with it: attnlab generate {runs["lm"]} --prompt "some text"'),
        ("cls", f"evaluate it with attnlab eval {runs['cls']}"),
    ):
        status, out, err = _run(capsys, monkeypatch, ["translate", runs[run], "ein hund"])
        assert status == 2 and out == "" and _one_error(err).endswith(says), err


# item 4: every numeric flag's range


@pytest.mark.parametrize(
    "command, flag, value, want",
    [
        ("generate", "--max-new-tokens", "-5", "-5 is not >= 1"),
        ("generate", "--threads", "-2", "-2 is not >= 1"),
        ("generate", "--temperature", "-1", "-1 is not >= 0"),
        ("generate", "--top-p", "1.5", "1.5 is not in (0, 1]"),
        ("generate", "--top-p", "0", "0 is not in (0, 1]"),
        ("generate", "--top-k", "0", "0 is not >= 1"),
        ("generate", "--seed", "-1", "-1 is not in [0, 18446744073709551615]"),
        ("chat", "--max-new-tokens", "0", "0 is not >= 1"),
        ("chat", "--temperature", "nan", "nan is not a finite number"),
        ("translate", "--beams", "0", "0 is not >= 1"),
        ("eval", "--threads", "0", "0 is not >= 1"),
    ],
)
def test_a_number_out_of_range_is_one_line_naming_the_flag_and_the_range(
    capsys, command, flag, value, want
):
    with pytest.raises(SystemExit) as exit_:
        main([command, "no-such-model", f"{flag}={value}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == f"attnlab {command}: error: argument {flag}: {want}"


def test_the_ends_of_each_range_are_accepted(capsys, tmp_path):
    """The boundary values parse: the run fails on the missing model, after parsing."""
    ends = ["--max-new-tokens", "1", "--temperature", "0", "--top-k", "1", "--top-p", "1",
            "--seed", str(2**64 - 1), "--threads", "1"]  # fmt: skip
    missing = tmp_path / "none"
    for argv in (
        ["generate", missing, "--prompt", "x", *ends],
        ["translate", missing, "--beams", "1", "x"],
    ):
        assert main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        assert _one_error(err) and str(tmp_path / "none") in err and "argument" not in err


# item 7: what a reply and a load cost, and why a reply stopped


def test_generate_prints_the_text_on_stdout_and_tokens_per_second_on_stderr(
    lm, capsys, monkeypatch
):
    want = lm.greedy("to be", 12)
    assert len(want) == 12, "the continuation must run to the limit for this test to mean it"
    status, out, err = _run(capsys, monkeypatch, ["generate", lm.folder, "--prompt", "to be",
                                                  "--max-new-tokens", "12", *GREEDY])  # fmt: skip
    assert status == 0 and out == "to be" + lm.tok.decode(want) + "\n"
    line = err.strip()
    m = re.fullmatch(
        r"\[(\d+) prompt tokens, first new token after [\d.]+ s; (\d+) new tokens at ([\d.]+) "
        r"tokens/s; stopped at the limit of 12 new tokens \(--max-new-tokens\)\]",
        line,
    )
    assert m, line
    assert int(m[1]) == len(lm.ids("to be")) and int(m[2]) == 12 and float(m[3]) > 0


def test_chat_says_it_is_loading_and_when_a_reply_stops_at_the_token_limit(lm, capsys, monkeypatch):
    want = lm.greedy("to be ", 5)
    assert len(want) == 5, "the reply must run to the limit for this test to mean it"
    argv = ["chat", lm.folder, "--max-new-tokens", "5", *GREEDY]
    status, out, err = _run(capsys, monkeypatch, argv, b"to be\n")
    assert status == 0 and out == lm.tok.decode(want) + "\n"
    lines = err.splitlines()
    assert lines[0] == f"loading {lm.folder} ..." and re.fullmatch(r"loaded in \d+\.\d s", lines[1])
    assert lines[2:] == [
        "[the reply stopped at 5 new tokens (--max-new-tokens): raise --max-new-tokens for "
        "longer replies]"
    ]


# item 8: translate's arguments


def _translations(run: Path, sentences: list[str], beams: int) -> list[str]:
    from attnlab.train import checkpoint
    from attnlab.train.recipes import Recipe
    from attnlab.train.run import load_tokenizer
    from attnlab.train.tasks import translate

    folder = checkpoint.find(run, "best")
    model, _ = checkpoint.load(folder)
    recipe = Recipe.from_dict(checkpoint.load_recipe(folder))
    return translate(model.eval(), load_tokenizer(folder), sentences, recipe, beams=beams)


def test_translate_takes_options_before_and_after_the_sentences(runs, capsys, monkeypatch):
    sentences = ["ein hund läuft.", "im park"]
    want = "".join(f"{t}\n" for t in _translations(runs["mt"], sentences, beams=1))
    assert want.strip(), "the translations must say something for this test to mean it"
    for argv in (
        [runs["mt"], "--beams", "1", *sentences],
        [runs["mt"], sentences[0], "--beams", "1", sentences[1]],
        [runs["mt"], *sentences, "--beams", "1", "--device", "cpu"],
    ):
        status, out, err = _run(capsys, monkeypatch, ["translate", *argv])
        assert (status, out) == (0, want), err
    status, out, _ = _run(capsys, monkeypatch, ["translate", runs["mt"], "--beams", "1"],
                          "\n".join(sentences).encode() + b"\n")  # fmt: skip
    assert (status, out) == (0, want)


def test_translate_without_sentences_says_where_they_come_from(runs, capsys, monkeypatch):
    status, out, err = _run(capsys, monkeypatch, ["translate", runs["mt"]], b"\n  \n")
    assert status == 2 and out == ""
    assert _one_error(err).startswith(
        "error: no sentences to translate: give them after RUN_DIR "
        f"(attnlab translate {runs['mt']} "
    )
    # on a terminal: a hint before reading what is typed
    want = "".join(f"{t}\n" for t in _translations(runs["mt"], ["ein hund"], beams=2))
    status, out, err = _run(capsys, monkeypatch, ["translate", runs["mt"]], b"ein hund\n", tty=True)
    assert (status, out) == (0, want)
    assert err.startswith("type sentences, one per line, then Ctrl-D"), err


# item 16: the context bounds a prompt, a chat message and a reply


def test_generate_refuses_a_prompt_past_the_context_and_ends_a_reply_at_it(lm, capsys, monkeypatch):
    long = TEXT + " " + TEXT  # 83 characters, 83 tokens
    status, out, err = _run(capsys, monkeypatch, ["generate", lm.folder, "--prompt", long, *GREEDY])
    assert status == 2 and out == ""
    assert _one_error(err) == (
        f"error: the prompt is {len(lm.ids(long))} tokens and the model's context holds "
        f"{CONTEXT} (prompt and reply together): shorten it"
    )
    prompt = TEXT[:30]  # 30 tokens: 10 left for the reply
    want = lm.greedy(prompt, CONTEXT - 30)
    assert len(want) == CONTEXT - 30, "the reply must reach the context for this test to mean it"
    argv = ["generate", lm.folder, "--prompt", prompt, "--max-new-tokens", "50", *GREEDY]
    status, out, err = _run(capsys, monkeypatch, argv)
    assert status == 0 and out == prompt + lm.tok.decode(want) + "\n"
    assert f"stopped at the limit of 10 new tokens (the model's {CONTEXT}-token context)" in err


def test_chat_refuses_a_message_past_the_context_and_goes_on(lm, capsys, monkeypatch):
    """A message that would pass the context is not sent (nor kept in the history); the next
    one is answered as the first of the conversation; a reply that reaches the context says
    so and how to start over."""
    long = (TEXT + " ") * 3
    first = "to be or not to be, that is"  # 27 + 1 tokens rendered: 12 left
    want = lm.greedy(first + " ", CONTEXT - 28)
    assert len(want) == CONTEXT - 28, "the reply must reach the context for this test to mean it"
    argv = ["chat", lm.folder, "--max-new-tokens", "100", *GREEDY]
    status, out, err = _run(capsys, monkeypatch, argv, f"{long}\n{first}\n".encode())
    assert status == 0 and out == lm.tok.decode(want) + "\n"
    n = len(lm.ids(long + " "))
    assert err.splitlines()[2:] == [
        f"[not sent: the conversation with this message is {n} tokens and the model's context "
        f"holds {CONTEXT} (prompt and reply together): shorten the message]",
        f"[the reply stopped at 12 new tokens (the model's {CONTEXT}-token context): /reset "
        "starts a new conversation]",
    ]


# item 17: text that is not UTF-8


@pytest.mark.parametrize("errors", ["surrogateescape", "strict"])
def test_stdin_that_is_not_utf8_is_one_line_naming_the_byte(lm, capsys, monkeypatch, errors):
    """Python decodes a pipe with surrogateescape under the C locale (then the tokenizer raised
    TypeError) and strictly under a UTF-8 one (then Python's codec message); both say where."""
    status, out, err = _run(capsys, monkeypatch, ["generate", lm.folder, *GREEDY],
                            b"to be\n\xff\n", errors=errors)  # fmt: skip
    assert status == 2 and out == ""
    assert _one_error(err).startswith(
        "error: the prompt on stdin is not UTF-8 text: byte 0xff at line 2, byte 1 (invalid "
        "start byte); convert it first"
    )
    status, out, err = _run(capsys, monkeypatch, ["generate", lm.folder, "--prompt", "to\udcff"])
    assert status == 2 and _one_error(err).startswith(
        "error: --prompt is not UTF-8 text: byte 0xff at line 1, byte 3"
    )


def test_chat_skips_a_line_that_is_not_utf8_and_answers_the_next(lm, capsys, monkeypatch):
    want = lm.greedy("to be ", 5)
    argv = ["chat", lm.folder, "--max-new-tokens", "5", *GREEDY]
    status, out, err = _run(capsys, monkeypatch, argv, b"\xe9t\xe9\nto be\n")
    assert status == 0 and out == lm.tok.decode(want) + "\n"
    assert err.splitlines()[2].startswith(
        "[skipped: line 1 of stdin is not UTF-8 text: byte 0xe9 at line 1, byte 1"
    ), err
