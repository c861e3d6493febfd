"""The `attnlab` command as a newcomer meets it, through the real entry point (a subprocess):
help pages that describe every option and show its default, `attnlab --help` without torch, and
bad arguments to every subcommand ending in one `error:` line (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import shlex
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


# --- examples and --version (issue 49, item 6) ----------------------------------------------------


def _examples(parser: argparse.ArgumentParser) -> list[list[str]]:
    """The command lines under "examples:" of a parser's epilog as the shell splits them, each
    less its `# comment`."""
    lines = (parser.epilog or "").splitlines()
    if "examples:" not in lines:
        return []
    return [shlex.split(x, comments=True) for x in lines[lines.index("examples:") + 1 :] if x]


def test_every_subcommand_shows_runnable_examples():
    """Each subcommand's --help (nested ones included) ends in examples: two to four, one where
    the command takes no arguments; every one of them parses with the real `attnlab` parser into
    that very subcommand, so an example cannot rot when an option is renamed or range-checked."""
    top, problems = cli.build_parser(), []
    for prefix, parser in _parsers():
        examples = _examples(parser)
        takes = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
        if not (2 <= len(examples) <= 4 or (len(examples) == 1 and not takes)):
            problems.append(f"{prefix}: {len(examples)} examples")
        if "examples:\n" not in parser.format_help():
            problems.append(f"{prefix}: --help shows no examples")
        for words in examples:
            line = shlex.join(words)
            if " ".join(words[: len(prefix.split())]) != prefix:
                problems.append(f"{prefix}: {line!r} runs another command")
                continue
            try:
                args = top.parse_args(words[1:])
            except SystemExit:
                problems.append(f"{prefix}: {line!r} does not parse")
                continue
            if not callable(getattr(args, "func", None)):
                problems.append(f"{prefix}: {line!r} names no command")
    assert not problems, "\n".join(problems)


def test_examples_keep_their_lines(capsys):
    """The help page keeps each example on its own line (argparse's default formatter would
    join them into one paragraph), and still wraps the description."""
    with pytest.raises(SystemExit):
        cli.main(["inspect", "--help"])
    out = capsys.readouterr().out
    assert "\nexamples:\n  attnlab inspect llama3.1-8b " in out
    assert "\n  attnlab inspect runs/shakespeare-char " in out
    assert max(len(line) for line in out.split("examples:")[0].splitlines()) <= 100


def test_version(capsys):
    """`attnlab --version` prints the installed package's version (its metadata) and exits 0."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"attnlab {version('attnlab')}\n"


RANGES = [  # (arguments, the flag and the range argparse names): issue 49, item 4
    (("inspect", "gpt2-small", "--kernels", "--tokens", "0"), "--tokens: 0 is not >= 1"),
    (("train", "shakespeare-char", "--threads", "-2"), "--threads: -2 is not >= 1"),
    (("lab", "run", "positions", "--jobs", "0"), "--jobs: 0 is not >= 1"),
    (("lab", "run", "positions", "--seeds", "1", "-1"), "--seeds: -1 is not in [0, "),
    (("lab", "run", "positions", "--seeds", str(2**64)), "is not in [0, 18446744073709551615]"),
    (("lab", "run", "positions", "--plan", "2"), "--plan: 2 is not >= 3"),
    (("lab", "run", "positions", "--threads", "0"), "--threads: 0 is not >= 1"),
    (("lab", "attention", "runs/r", "x", "--layer", "-1"), "--layer: -1 is not >= 0"),
    (("lab", "attention", "runs/r", "x", "--head", "1.5"), "--head: '1.5' is not a whole number"),
]


@pytest.mark.parametrize(("args", "says"), RANGES, ids=[" ".join(a[:2]) for a, _ in RANGES])
def test_numbers_out_of_range_name_the_flag(args, says, capsys):
    """A number out of its range ends in argparse's one line naming the flag and the range
    (status 2) before anything runs (before: accepted, and a traceback or an odd run later)."""
    with pytest.raises(SystemExit) as stop:
        cli.main(list(args))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {says}" in err if says.startswith("--") else says in err
    assert "Traceback" not in err


def test_ctrl_c_is_not_called_an_error(capsys, monkeypatch):
    """Ctrl-C in a command says it was interrupted, status 130, without calling it an error
    (before: "error: interrupted"); training says more itself (tests/train/test_train_cli_end.py)."""
    from attnlab.cli import presets

    def ctrl_c(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(presets, "run", ctrl_c)
    assert cli.main(["presets"]) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C)\n"
