"""Range-checked numbers for the command line: every numeric flag of every subcommand is read
through one of these, so a value out of range ends in one line naming the flag and the range
(argparse prints `attnlab generate: error: argument --top-p: 1.5 is not in [0, 1]`, status 2)
instead of a traceback deep in torch or a silently odd result.

    p.add_argument("--max-new-tokens", type=integer(1), ...)          # 1, 2, ...
    p.add_argument("--top-p", type=real(0, 1, low_open=True), ...)    # (0, 1]
    p.add_argument("--port", type=integer(0, 65535), ...)

argparse names the flag itself: a type function raises `argparse.ArgumentTypeError` with the
value and the range, and argparse prefixes "argument --flag:".
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _range(low, high, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"> {low}" if low_open else f">= {low}"
    if low is None:
        return f"< {high}" if high_open else f"<= {high}"
    return f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def _out_of(value: str, want: str) -> str:
    return f"{value} is not {want}" if want[0] in "<>" else f"{value} is not in {want}"


def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (either end may be None: unbounded)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(_out_of(f"{value}", _range(low, high, False, False)))
        return value

    parse.__name__ = "integer"  # argparse's "invalid integer value" names the type
    return parse


def real(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> Callable[[str], float]:
    """An argparse type: a finite float between low and high, each end closed unless `*_open`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and (value >= high if high_open else value > high)
        if below or above:
            want = _range(low, high, low_open, high_open)
            raise argparse.ArgumentTypeError(_out_of(f"{value:g}", want))
        return value

    parse.__name__ = "real"
    return parse


# the flags several subcommands share
threads = integer(1)  # torch intra-op threads
