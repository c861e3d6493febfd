"""Locating data sets (DESIGN.md, "Data"). Data never lives in the repository.

Search order: an explicit `data_dir`, then `$ATTNLAB_DATA`, then a `shared/data` folder beside
the repository (`../shared/data` from the project root, or from the current directory), then the
user cache `~/.cache/attnlab`, where a data set with a known public source is downloaded and
checked against its SHA-256. A data set found nowhere raises `DataNotFoundError` naming every
place looked and how to provide it.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path


class DataNotFoundError(FileNotFoundError):
    """A data set that is in none of the places looked."""


@dataclass(frozen=True)
class Source:
    url: str
    sha256: str  # of the downloaded (uncompressed) bytes
    file: str  # name it is stored under, gzip-compressed, in the data set folder


# Public sources for the data sets that can be fetched file by file.
SOURCES: dict[str, list[Source]] = {
    "tinyshakespeare": [
        Source(
            "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
            "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
            "input.txt.gz",
        ),
    ],
}


def candidates(name: str, data_dir: str | Path | None = None) -> list[Path]:
    """Every folder that may hold data set `name`, in search order."""
    out = []
    if data_dir is not None:
        out.append(Path(data_dir) / name)
    if os.environ.get("ATTNLAB_DATA"):
        out.append(Path(os.environ["ATTNLAB_DATA"]) / name)
    repo = Path(__file__).resolve().parents[3]  # src/attnlab/data/locate.py -> project root
    for root in (repo, Path.cwd()):
        out.append(root.parent / "shared" / "data" / name)
    out.append(Path.home() / ".cache" / "attnlab" / name)
    return list(dict.fromkeys(out))


def _download(name: str, folder: Path) -> bool:
    sources = SOURCES.get(name)
    if not sources:
        return False
    for src in sources:
        try:
            with urllib.request.urlopen(src.url, timeout=30) as r:
                data = r.read()
        except OSError:
            return False
        digest = hashlib.sha256(data).hexdigest()
        if digest != src.sha256:
            raise DataNotFoundError(
                f"download of {src.url} has SHA-256 {digest}, expected {src.sha256}: not used"
            )
        folder.mkdir(parents=True, exist_ok=True)  # only once there is something to keep
        tmp = folder / (src.file + ".tmp")
        tmp.write_bytes(gzip.compress(data))
        tmp.replace(folder / src.file)  # atomic: a half-written file is never seen
    return True


def locate(name: str, data_dir: str | Path | None = None, must_contain: str | None = None) -> Path:
    """The folder holding data set `name` (containing file `must_contain`, if given)."""
    places = candidates(name, data_dir)
    for folder in places:
        found = (
            (folder / must_contain).exists()
            if must_contain
            else folder.is_dir() and any(folder.iterdir())
        )
        if found:
            return folder
    cache = places[-1]
    if _download(name, cache) and (must_contain is None or (cache / must_contain).exists()):
        return cache
    looked = "\n".join(f"  - {p}" for p in places)
    raise DataNotFoundError(
        f"data set {name!r} not found. Looked in:\n{looked}\n"
        f"Provide it with --data-dir DIR (DIR/{name}/...), or set ATTNLAB_DATA=DIR, or place it in "
        f"../shared/data/{name} beside the repository"
        + ("" if name in SOURCES else "; it has no automatic download")
    )


def read_text(
    name: str, file: str, data_dir: str | Path | None = None, encoding: str = "utf-8"
) -> str:
    """A whole text file of a data set (transparently gunzipped)."""
    folder = locate(name, data_dir, file)
    raw = (folder / file).read_bytes()
    if file.endswith(".gz"):
        raw = gzip.decompress(raw)
    return raw.decode(encoding).replace("\r", "")
