"""`attnlab serve` as a user starts and stops it (src/attnlab/cli/serve.py): the checks made
before anything is served, and the server's own lines.

- an empty API key (`--api-key "$UNSET"`) is refused; listening beyond loopback without a key
  warns, naming --api-key and ATTNLAB_API_KEY (both before the model loads, so a missing model
  keeps these tests fast);
- a translation (encoder-decoder) run and an encoder run are refused in one line naming the
  command for them, with no traceback;
- `--max-waiting` bounds every request not yet running (the engine's inbox included), and a
  request that alone asks for more is a 400 naming `n`, not a 429 that could never succeed;
- one access-log line per request; Ctrl-C stops the server with "stopped", exit status 0;
- an API key with a character clients cannot send in a header is refused at start, and every
  numeric flag is range-checked in one line naming it (issue 49, items 21 and 4).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import attnlab as al  # noqa: E402
from helpers.serve import CHATML, Server, bpe_tokenizer, free_port, save_model  # noqa: E402


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`attnlab serve ARGS` run to its end (these all end before serving)."""
    return subprocess.run(
        [sys.executable, "-m", "attnlab", "serve", *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("tiny-llama")
    save_model(f, CHATML)
    return f


def test_an_empty_api_key_is_refused(folder):
    port = str(free_port())
    for args, env, where in (
        (["--api-key", ""], {}, "--api-key"),
        (["--api-key", "  "], {}, "--api-key"),
        ([], {"ATTNLAB_API_KEY": ""}, "ATTNLAB_API_KEY"),
    ):
        out = _serve(str(folder), "--port", port, *args, env=env)
        assert out.returncode == 2, out.stderr
        assert f"error: {where} is empty" in out.stderr and "unset shell variable" in out.stderr
        assert "Traceback" not in out.stderr and "serving" not in out.stdout


def test_listening_beyond_loopback_without_a_key_warns(tmp_path):
    """The warning comes once the port is bound, before the model loads: a missing model ends
    the run right after it."""
    missing = str(tmp_path / "no-model")
    for host, args, warned in (
        ("0.0.0.0", [], True),
        ("0.0.0.0", ["--api-key", "k"], False),
        ("127.0.0.1", [], False),
    ):
        out = _serve(missing, "--host", host, "--port", str(free_port()), *args)
        assert out.returncode == 2 and "does not exist" in out.stderr, out.stderr
        said = "without an API key" in out.stderr
        assert said == warned, (host, args, out.stderr)
        if warned:
            assert "--api-key" in out.stderr and "ATTNLAB_API_KEY" in out.stderr


@pytest.mark.parametrize(
    "preset, says",
    [
        ("transformer-base-2017", ["encoder-decoder (translation)", "attnlab translate"]),
        ("bert-base", ["an encoder", "attnlab eval"]),
    ],
)
def test_a_run_the_engine_cannot_serve_names_the_command_for_it(tmp_path, preset, says):
    from attnlab.train import checkpoint

    torch.manual_seed(0)
    model = al.build_model(al.presets.tiny(al.presets.get(preset), vocab_size=320))
    run = tmp_path / "run"
    checkpoint.save(run, "last", model, model.config, {}, {"step": 1})
    bpe_tokenizer().save(str(run / "tokenizer.json"))
    out = _serve(str(run), "--port", str(free_port()))
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert line.startswith("error: attnlab serve serves decoder-only (causal LM) models"), line
    assert all(s in line for s in says) and str(run) in line, line
    assert "Traceback" not in out.stderr and "serving" not in out.stdout


def test_max_waiting_bounds_every_request_not_yet_running(folder):
    """--max-batch 1 and long answers: one request runs, the rest wait. A burst of requests at
    once: the server's waiting count (/health, sampled throughout) never passes the bound, and
    every request beyond it gets a 429. n above the bound is a 400 naming n, even when idle."""
    bound, burst, long = 4, 12, 300
    s = Server(folder, "--max-batch", "1", "--max-waiting", str(bound), "--num-blocks", "64",
               "--block-size", "8")  # fmt: skip
    try:
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 2, "n": 5})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "n", r.text
        assert "n (5)" in error["message"] and f"--max-waiting {bound}" in error["message"]
        r = s.post("/v1/completions", {"model": "tiny", "prompt": "the", "max_tokens": 2, "n": 4})
        assert r.status_code == 200  # exactly the bound: admitted on an idle server
        body = {"model": "tiny", "prompt": "the quick", "max_tokens": long, "temperature": 0}
        peak, done = [0], []

        def watch() -> None:
            while not done:
                peak[0] = max(peak[0], s.health()["waiting"])

        with ThreadPoolExecutor(burst + 1) as pool:
            watcher = pool.submit(watch)
            answers = list(pool.map(lambda _: s.post("/v1/completions", body), range(burst)))
            done.append(True)
            watcher.result()
        codes = [a.status_code for a in answers]
        assert set(codes) <= {200, 429}, codes
        assert peak[0] <= bound, peak[0]
        busy = [a for a in answers if a.status_code == 429]
        assert busy and all("retry later" in a.json()["error"]["message"] for a in busy)
        # admitted: one running and `bound` waiting, plus any that came after one had finished
        assert codes.count(200) >= bound + 1
    finally:
        s.close()


def test_access_log_and_ctrl_c(folder):
    """One line per request on stderr (method, path, status, duration, tokens); SIGINT (Ctrl-C)
    stops the server cleanly: "stopped", exit status 0, no "error"."""
    s = Server(folder, "--num-blocks", "32")
    try:
        body = {"model": "tiny", "prompt": "the quick", "max_tokens": 3, "temperature": 0}
        usage = s.post("/v1/completions", body).json()["usage"]
        assert httpx.get(s.url + "/nowhere").status_code == 404
        s.proc.send_signal(signal.SIGINT)
        s.proc.wait(timeout=30)
        out = s.output()
    finally:
        s.close()
    assert s.proc.returncode == 0, out
    lines = out.splitlines()
    assert lines[-1] == "stopped" and "error" not in out and "Traceback" not in out, out
    want = ('"POST /v1/completions" 200', f"tokens {usage['prompt_tokens']} + "
            f"{usage['completion_tokens']}")  # fmt: skip
    assert any(all(w in line for w in want) for line in lines), out
    assert any('"GET /nowhere" 404' in line for line in lines), out
    assert any('"GET /health" 200' in line for line in lines), out  # Server's readiness polls


@pytest.mark.parametrize(
    "args, env, where, char",
    [
        (["--api-key", "clé-secrète"], {}, "--api-key", "'é' (U+00E9)"),
        ([], {"ATTNLAB_API_KEY": "κλειδί"}, "ATTNLAB_API_KEY", "'κ' (U+03BA)"),
        (["--api-key", "tab\there"], {}, "--api-key", "'\\t' (U+0009)"),
    ],
)
def test_an_api_key_clients_cannot_send_is_refused_at_start(tmp_path, args, env, where, char):
    """A header value is bytes: httpx and the openai client send only ASCII (they raise on
    'é'), curl sends UTF-8, which the server reads as latin-1: such a key could never be
    matched (every request a 401). Refused before the model loads (a missing one here is not
    even reported), with the character and a way to make a key."""
    out = _serve(str(tmp_path / "no-model"), "--port", str(free_port()), *args, env=env)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert line.startswith(f"error: {where} holds {char}"), line
    assert "printable ASCII" in line and "secrets.token_urlsafe" in line, line
    assert "Traceback" not in out.stderr and "does not exist" not in out.stderr


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--port", "-1", "-1 is not in [0, 65535]"),
        ("--port", "70000", "70000 is not in [0, 65535]"),
        ("--num-blocks", "0", "0 is not >= 1"),
        ("--block-size", "0", "0 is not >= 1"),
        ("--max-batch", "-3", "-3 is not >= 1"),
        ("--max-prefill-tokens", "0", "0 is not >= 1"),
        ("--step-tokens", "-1", "-1 is not >= 0"),
        ("--max-step-ms", "0", "0 is not > 0"),
        ("--max-model-len", "1", "1 is not >= 2"),
        ("--threads", "-2", "-2 is not >= 1"),
        ("--max-body-bytes", "0", "0 is not >= 1"),
        ("--max-waiting", "0", "0 is not >= 1"),
        ("--max-connections", "0", "0 is not >= 1"),
        ("--header-timeout", "0", "0 is not > 0"),
        ("--idle-timeout", "nan", "nan is not a finite number"),
        ("--num-blocks", "many", "'many' is not a whole number"),
    ],
)
def test_every_numeric_flag_is_range_checked(capsys, flag, value, says):
    """One line naming the flag and the range, before anything is bound or loaded (`--port -1`
    blamed the host before: getaddrinfo's error)."""
    from attnlab.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "no-model", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: {says}" in err, err
    assert "Traceback" not in err
