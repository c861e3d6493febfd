"""Run `attnlab` commands on hostile files in a child process with a time and memory guard.

A hostile file's failure mode is a hang or memory growing by gigabytes (a GGUF array claiming
2^62 elements grew a process from 2.6 to 7.3 GB in 61 s), so the commands run in one child
process (the imports paid once) whose address space is capped (`CAP`) and which is killed at a
deadline: the machine is never at risk, and a command that runs away fails its test instead of
the suite. For each command the child reports its exit status (None where it raised instead of
returning one: a traceback), what it wrote to stderr, the seconds it took and how far the
process's peak resident memory rose while it ran (`grew`, bytes: the high-water mark after it
minus before it, with every module the commands use imported first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CAP = 8 * 2**30  # address space: torch reserves ~2 GB of it at import; a runaway dies at 8 GB

_CHILD = r"""
import contextlib, io, json, resource, sys, time, traceback
resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))
import torch, gguf, tokenizers  # noqa: F401  (imported before measuring: not the commands' cost)
import attnlab.loading, attnlab.interop.gguf.reader, attnlab.cli.inspect  # noqa: F401
from attnlab.cli import main

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

for argv in json.loads(sys.argv[1]):
    err, before, t0 = io.StringIO(), peak(), time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except BaseException:
            rc = None
            traceback.print_exc(file=err)
    out = dict(rc=rc, err=err.getvalue()[-3000:], seconds=time.perf_counter() - t0,
               grew=peak() - before)
    print(json.dumps(out), flush=True)
"""


@dataclass(frozen=True)
class Outcome:
    rc: int | None
    err: str
    seconds: float
    grew: int


def run_guarded(commands: list[list[str]], timeout: float = 240) -> list[Outcome | None]:
    """Each command's Outcome, in order; None for those the deadline (or the cap) cut off."""
    child = _CHILD.replace("CAP", str(CAP))
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            [sys.executable, "-c", child, json.dumps(commands)],
            capture_output=True, text=True, timeout=timeout, cwd=root,
            # torch's matmuls: the CPU kernels' first build (minutes) must not eat the deadline
            env={**os.environ, "ATTNLAB_KERNELS": "0"},
        )  # fmt: skip
        stdout = done.stdout
    except subprocess.TimeoutExpired as err:
        stdout = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else err.stdout or ""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    got: list[Outcome | None] = [Outcome(**d) for d in lines]
    return got + [None] * (len(commands) - len(got))
