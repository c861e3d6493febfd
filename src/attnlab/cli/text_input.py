"""Text a user gives on the command line or stdin, as UTF-8 or one error naming the byte.

generate's prompt, chat's lines and translate's sentences are read here. Bytes that are not
UTF-8 are refused, not replaced with U+FFFD: a replacement would change the text the model sees,
and silently (`printf '\xff' | attnlab chat MODEL` ended in the tokenizer's
`TypeError: TextInputSequence must be str`, issue 49).
"""

from __future__ import annotations

import sys


def utf8(data: bytes, where: str) -> str:
    """`data` as UTF-8 text; else ValueError naming the first byte that is not and its place
    (a Latin-1 or UTF-16 file would otherwise become another prompt)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - data.rfind(b"\n", 0, err.start)  # 1-based, in bytes
        raise ValueError(
            f"{where} is not UTF-8 text: byte 0x{data[err.start]:02x} at line {line}, byte "
            f"{column} ({err.reason}); convert it first, e.g. `iconv -f latin1 -t utf-8`"
        ) from None


def check_text(text: str, where: str) -> str:
    """`text` from a str source (a command-line argument, a text stdin) that is UTF-8 text.
    Python keeps bytes it could not decode there as lone surrogates (surrogateescape: argv
    always, stdin under the C locale), which the tokenizer refuses with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")  # the bytes that were given
        except UnicodeEncodeError:
            raise ValueError(f"{where} holds a lone surrogate (not text)") from None
        return utf8(raw, where)
    return text


def read_stdin(where: str = "stdin", line: bool = False) -> str:
    """All of stdin (or its next line, with its line break; "" at its end) as UTF-8 text
    (`utf8`), read as bytes where it has them."""
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream in its place (a test's StringIO)
        return check_text(sys.stdin.readline() if line else sys.stdin.read(), where)
    return utf8(buffer.readline() if line else buffer.read(), where)
