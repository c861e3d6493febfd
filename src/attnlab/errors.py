"""How attnlab reports problems: all of them at once, each naming field, value, rule and fix.

    invalid ModelConfig (2 problem(s)):
      - n_heads (12) must be divisible by n_kv_heads (5): choose n_kv_heads in {1, 2, 3, 4, 6, 12}
      - residual ('parallel') needs norm_placement 'pre': ...

`problem_list` formats that message — config, recipes and the interop converters all use it, so
every report reads the same. `Problems` collects lines and raises once. `check_choice` guards a
string argument with a fixed set of values (a `Literal` in the config), so that a component built
by hand refuses a typo the way a config does, with a did-you-mean. This module imports neither
torch nor pydantic.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


class AttnlabError(Exception):
    """A failure a user causes and can fix (a missing or corrupt checkpoint, a diverged or
    interrupted run): its message names the problem and the fix, and the `attnlab` command prints
    it as one `error:` line instead of a traceback, exiting with `exit_status`. Input errors
    are ValueErrors as well."""

    exit_status: int = 2  # the command's exit status: 2 a usage or input error


class FileFormatError(AttnlabError, ValueError):
    """A file attnlab cannot read (truncated, corrupt, another format, unsafe): the message
    names the file, what is wrong and the fix."""


def excerpt(text: object, limit: int = 200) -> str:
    """`text` as a string of at most `limit` characters (an error quotes input, never all of it)."""
    s = str(text)
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s):,} characters)"


@contextmanager
def reading(path: str | Path, what: str, fix: str) -> Iterator[None]:
    """The one boundary around parsing a file: any failure of the parser (a library's own
    exception, an IndexError on a truncated header, a KeyError on a missing entry) becomes a
    FileFormatError naming `path`, `what` was read and the `fix`. attnlab's own errors, which
    already say what is wrong, pass through unchanged."""
    try:
        yield
    except Exception as err:
        if type(err).__module__.startswith("attnlab"):
            raise
        why = f"{type(err).__name__}: {excerpt(err)}" if str(err) else type(err).__name__
        raise FileFormatError(f"{path}: cannot read {what} ({why}): {fix}") from err


def problem_list(title: str, problems: Iterable[str]) -> str:
    """'invalid TITLE (n problem(s)):' followed by one bulleted line per problem."""
    lines = [str(p) for p in problems]
    body = "\n".join(f"  - {line}" for line in lines)
    return f"invalid {title} ({len(lines)} problem(s)):\n{body}"


class Problems:
    """A list of problem lines that raises them together: `p.add(...)`, then `p.raise_as(E, t)`."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        self.lines.append(line)

    def __bool__(self) -> bool:
        return bool(self.lines)

    def raise_as(self, error: type[Exception], title: str) -> None:
        """Raise `error(problem_list(title, lines))` if any problem was added."""
        if self.lines:
            raise error(problem_list(title, self.lines))


def did_you_mean(value: object, allowed: Iterable[object]) -> str:
    """' Did you mean 'x'?' for close string matches, '' otherwise."""
    if not isinstance(value, str):
        return ""
    names = [str(a) for a in allowed]
    close = difflib.get_close_matches(str(value), names, n=3, cutoff=0.5)
    return f" Did you mean {' or '.join(map(repr, close))}?" if close else ""


def check_choice(name: str, value: object, allowed: Iterable[object]) -> None:
    """Raise ValueError unless `value` is one of `allowed`, listing them with a did-you-mean."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}."
            f"{did_you_mean(value, allowed)}"
        )
