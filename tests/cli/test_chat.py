"""`attnlab chat` and the stdin prompt of `attnlab generate`, through the real entry point (a
subprocess), on a tiny GGUF file with a chat template (tests/helpers/gguf_writing.py):

- a greedy chat turn is what `attnlab generate --chat` gives for the same conversation: turn one
  the user's message alone, turn two the whole history rendered by the template (fed to generate
  on stdin), which differs from turn two's message alone, so a chat that dropped the history fails;
- /reset drops the history, Ctrl-C stops a reply and returns to the prompt, Ctrl-C at the prompt
  leaves with status 0;
- a Hugging Face hub id says to download it first; a model without a chat template names the
  problem and `attnlab generate --prompt`; `generate --chat` without a prompt points at chat.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from attnlab.serve.chat import render_chat

pytest.importorskip("gguf")
pytest.importorskip("transformers")
from helpers.gguf_families import tiny
from helpers.gguf_writing import TEMPLATE, write_gguf

ATTNLAB = Path(sys.executable).with_name("attnlab")  # the installed entry point, beside python
U1, U2 = "hello there", "the weather"
GREEDY = ("--temperature", "0", "--max-new-tokens", "12", "--threads", "1")
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _attnlab(*args: str, stdin: str | None = None, cwd: Path | None = None):
    return subprocess.run(
        [str(ATTNLAB), *args], input=stdin, capture_output=True, text=True, timeout=300, cwd=cwd,
        stdin=subprocess.DEVNULL if stdin is None else None,
    )  # fmt: skip


def _ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny Llama 3 with the ChatML template whose replies are printable ASCII on one line:
    weights scaled up (at init scale the reply hardly depends on the prompt) and the output rows
    of every other token zeroed (a logit of 0 loses to the best printable one)."""
    hf = tiny("llama3")
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 2:
                p.mul_(10.0)
        printable = torch.zeros(hf.config.vocab_size, dtype=torch.bool)
        printable[32:127] = True  # byte tokens are their byte's id (gguf_writing.bpe_vocab)
        printable[256:268] = True  # the BPE merges ("Ġt", "he", ...): letters and spaces
        hf.lm_head.weight[~printable] = 0.0
    # a context far past the 256 positions of its config: a reply ends at the model's context
    # (src/attnlab/cli/generate.py), and the Ctrl-C test needs one that does not end by itself
    path = tmp_path_factory.mktemp("chat") / "m.gguf"
    return write_gguf(path, hf, "llama", **{"llama.context_length": 1 << 20})


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every subprocess the tests read, two at a time (the history check needs turn one first)."""
    import attnlab as al
    from attnlab.data import train_tokenizer

    # an HF folder without a chat template (a base model)
    base = tmp_path_factory.mktemp("base")
    tok = train_tokenizer("char", ["to be or not to be"], 0, cache_dir=base / "c")
    cfg = al.presets.tiny(al.presets.get("llama2-7b"), vocab_size=tok.get_vocab_size())
    al.interop.save_pretrained(al.build_model(cfg), base / "m", "llama")
    tok.save(str(base / "m" / "tokenizer.json"))
    m = str(model)
    first = {
        "chat": (("chat", m, *GREEDY), f"{U1}\n{U2}\n"),
        "reset": (("chat", m, *GREEDY), f"{U1}\n/reset\n{U2}\n"),
        "generate1": (("generate", m, "--chat", "--prompt", U1, *GREEDY), None),
        "generate2_alone": (("generate", m, "--chat", "--prompt", "-", *GREEDY), f"{U2}\n"),
        "hub_chat": (("chat", HUB_ID), ""),
        "hub_generate": (("generate", HUB_ID, "--prompt", "hi"), None),
        "no_template": (("chat", str(base / "m"), *GREEDY), f"{U1}\n"),
    }
    cwd = tmp_path_factory.mktemp("cwd")  # where HUB_ID is not a folder
    with ThreadPoolExecutor(2) as pool:
        futures = {k: pool.submit(_attnlab, *a, stdin=s, cwd=cwd) for k, (a, s) in first.items()}
        out = {k: f.result() for k, f in futures.items()}
    r1 = _ok(out["chat"]).splitlines()[0]
    history = [{"role": "user", "content": U1}, {"role": "assistant", "content": r1}]
    text = render_chat(TEMPLATE, [*history, {"role": "user", "content": U2}])
    out["history_prompt"] = text
    # no --prompt, stdin not a terminal: the prompt is stdin, less its final line break
    out["generate2"] = _attnlab("generate", m, *GREEDY, stdin=text + "\n")
    return out


def test_a_greedy_chat_is_generate_turn_by_turn_with_the_history(runs):
    r1, r2 = _ok(runs["chat"]).split("\n")[:2]
    assert _ok(runs["chat"]) == f"{r1}\n{r2}\n"  # one line per reply, nothing else
    assert r1 and r2 and r1.isprintable(), "the replies must say something for the test to mean it"
    assert _ok(runs["generate1"]) == f"{U1}\n{r1}\n"
    text = runs["history_prompt"]
    assert U1 in text and r1 in text  # turn two's prompt holds turn one
    assert _ok(runs["generate2"]) == f"{text}{r2}\n"
    alone = _ok(runs["generate2_alone"]).split("\n")[1]
    assert alone != r2, "turn two alone must reply otherwise, or a chat without history passes"


def test_reset_drops_the_history(runs):
    alone = _ok(runs["generate2_alone"]).split("\n")[1]
    r1 = _ok(runs["generate1"]).split("\n")[1]
    assert _ok(runs["reset"]) == f"{r1}\n{alone}\n"
    assert "[conversation cleared]" in runs["reset"].stderr


@pytest.mark.parametrize("command", ["hub_chat", "hub_generate"])
def test_a_hub_id_says_to_download_it_first(runs, command):
    out = runs[command]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"error: {HUB_ID} does not exist: ")
    assert "attnlab reads local folders and files only (no downloads)" in out.stderr
    assert f"`hf download {HUB_ID} --local-dir DIR`, then pass DIR" in out.stderr
    assert out.stderr.count("\n") == 1 and out.stdout == ""


def test_a_model_without_a_chat_template_is_sent_to_generate(runs):
    out = runs["no_template"]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "has no chat template" in out.stderr
    assert "attnlab generate" in out.stderr and "--prompt TEXT" in out.stderr
    assert out.stdout == ""


def test_generate_chat_without_a_prompt_on_a_terminal_points_at_chat(monkeypatch, capsys):
    from attnlab.cli import main

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    assert main(["generate", "some.gguf", "--chat"]) == 2
    err = capsys.readouterr().err
    assert "--chat needs --prompt TEXT" in err and "`attnlab chat some.gguf`" in err


def test_ctrl_c_stops_a_reply_and_at_the_prompt_leaves(model):
    """A reply too long to end by itself: Ctrl-C (SIGINT) once it streams stops it and the loop
    waits for the next line; Ctrl-C there leaves with status 0."""
    proc = subprocess.Popen(
        [str(ATTNLAB), "chat", str(model), "--temperature", "0", "--max-new-tokens", "20000",
         "--threads", "1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        proc.stdin.write(f"{U1}\n".encode())
        proc.stdin.flush()
        shown = proc.stdout.read(1)  # the reply streams
        os.kill(proc.pid, signal.SIGINT)
        shown += proc.stdout.readline()  # the reply ends: back at the prompt
        time.sleep(0.5)  # reading stdin by now
        os.kill(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert shown.endswith(b" [stopped]\n"), shown[-200:]
    assert proc.returncode == 0 and rest == b"", err.decode()
    assert b"Traceback" not in err, err.decode()


def test_device_option_moves_the_model_or_names_what_is_missing(model):
    """--device cpu decodes as no --device does; a CUDA device on a torch without one, a name
    that is no device, and the CPU-only kernel options with another device are refused."""
    want = _ok(_attnlab("generate", str(model), "--prompt", U1, *GREEDY))
    assert _ok(_attnlab("generate", str(model), "--prompt", U1, *GREEDY, "--device", "cpu")) == want
    bad = _attnlab("generate", str(model), "--prompt", U1, "--device", "gpu7")
    assert bad.returncode == 2 and "--device 'gpu7' is not a device" in bad.stderr
    if not torch.cuda.is_available():
        out = _attnlab("chat", str(model), "--device", "cuda", stdin=U1 + "\n")
        assert out.returncode == 2 and "sees no CUDA device" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
