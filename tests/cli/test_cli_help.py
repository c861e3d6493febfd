"""The `attnlab` command as a newcomer meets it, through the real entry point (a subprocess):
help pages that describe every option and show its default, `attnlab --help` without torch, and
bad arguments to every subcommand ending in one `error:` line (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from attnlab import cli


def _attnlab(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnlab", *args],
        capture_output=True, text=True, timeout=300, cwd=cwd,
    )  # fmt: skip


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(command line, parser) of every subcommand, nested ones (lab run, ...) included."""
    top = argparse.ArgumentParser(prog="attnlab")
    sub = top.add_subparsers()
    for name in cli.SUBCOMMANDS:
        __import__(f"attnlab.cli.{name}", fromlist=["register"]).register(sub)
    out, todo = [], [("attnlab", top)]
    while todo:
        prefix, parser = todo.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{prefix} {n}", p) for n, p in action.choices.items()]
        if prefix != "attnlab":
            out.append((prefix, parser))
    return out


def test_every_subcommand_page_has_a_description_and_every_option_help():
    missing = []
    for prefix, parser in _parsers():
        if not parser.description:
            missing.append(f"{prefix}: no description")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
                continue
            if not action.help:
                missing.append(f"{prefix} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


def test_help_shows_the_defaults():
    pages = {prefix: parser.format_help() for prefix, parser in _parsers()}
    assert "(default: 127.0.0.1)" in pages["attnlab serve"]
    assert "(default: 8000)" in pages["attnlab serve"]
    assert "(default: 0.8)" in pages["attnlab generate"]
    assert "(default: 0)" in pages["attnlab generate"]
    assert ".gguf" in pages["attnlab generate"]  # every README generate example uses one
    assert "(default: None)" not in "".join(pages.values())


def test_top_level_help_imports_no_torch():
    code = (
        "import sys\nfrom attnlab.cli import main\ntry:\n    main(['--help'])\n"
        "except SystemExit:\n    pass\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False", "attnlab --help imported torch"
    for name in cli.SUBCOMMANDS:
        assert f"    {name}" in out.stdout


BAD = [  # (arguments, what the error line must say)
    (("serve", "runs/nothing-here"), "runs/nothing-here does not exist"),
    (("generate", "runs/nothing-here", "--prompt", "hi"), "runs/nothing-here does not exist"),
    (("generate", "README.md", "--prompt", "hi"), "neither a folder nor a .gguf file"),
    (("eval", "runs/nothing-here"), "runs/nothing-here does not exist"),
    (("translate", "runs/nothing-here", "hi"), "runs/nothing-here does not exist"),
    (("lab", "attention", "runs/nothing-here", "x"), "runs/nothing-here does not exist"),
    (("lab", "attention", "labdir", "x"), "it holds the runs rope-s0"),
    (("lab", "report", "runs/nothing-here"), "is runs/nothing-here a lab run folder"),
    (("lab", "run", "no-such-lab"), "no experiment 'no-such-lab'"),
    (("plot", "runs/nothing-here"), "is runs/nothing-here a training run folder"),
    (("train", "no-such-recipe"), "no recipe 'no-such-recipe'"),
    (("train", "shakespeare-char", "--set", "seed"), "expected key.sub=value"),
    (("inspect", "./nonexistent_dir/"), "./nonexistent_dir/ does not exist"),
]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A folder with a README.md (not a model) and a lab folder holding one run without a
    checkpoint of its own at the top."""
    (tmp_path / "README.md").write_text("# not a model\n")
    (tmp_path / "labdir" / "rope-s0" / "last").mkdir(parents=True)
    (tmp_path / "labdir" / "rope-s0" / "last" / "manifest.json").write_text("{}")
    return tmp_path


def test_bad_arguments_end_in_one_error_line(workdir: Path):
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda case: _attnlab(*case[0], cwd=workdir), BAD))
    for (args, says), out in zip(BAD, runs, strict=True):
        where = f"attnlab {' '.join(args)}"
        assert out.returncode == 2, f"{where}: exit {out.returncode}\n{out.stderr}"
        assert "Traceback" not in out.stderr, f"{where}:\n{out.stderr}"
        lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1 and says in out.stderr, f"{where}:\n{out.stderr}"  # one report
