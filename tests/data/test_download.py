"""Downloads into the user cache, offline: a local HTTP server (127.0.0.1, a free port) stands in
for the public sources, `SOURCES` is pointed at it, HOME is a temporary folder, and any other URL
fails the test. Then the source table itself: every file the recipes read has a pinned source,
and its checksum agrees with the copy in ../shared/data wherever there is one."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import importlib
import re
import socket
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from attnlab.data import DataNotFoundError, datasets, locate, read_text
from helpers import ROOT

L = importlib.import_module(
    "attnlab.data.locate"
)  # the module: attnlab.data.locate is the function
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))

TEXT = "the first line\nthe second line, with é\n"
GZ = gzip.compress(b"already gzip upstream\n", mtime=0)
SERVED = {"/a.txt": TEXT.encode(), "/b.txt.gz": GZ}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def corrupt(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])  # one bit of the last byte flipped


@dataclass
class FakeSource:
    """What the HTTP server serves, and every path requested from it."""

    base: str = ""
    mode: str = "ok"  # "ok", "corrupt" (one bit flipped) or "cut" (half the bytes, then close)
    requests: list[str] = field(default_factory=list)


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """HOME in tmp_path (so the cache is), no $ATTNLAB_DATA, and only 127.0.0.1 may be opened."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ATTNLAB_DATA", raising=False)
    for var in ("no_proxy", "NO_PROXY"):  # a configured proxy must not see the local server
        monkeypatch.setenv(var, "127.0.0.1")
    real_urlopen = urllib.request.urlopen

    def local_only(url, *args, **kwargs):
        target = url if isinstance(url, str) else url.full_url
        if not target.startswith("http://127.0.0.1:"):
            raise AssertionError(f"a test tried to open {target}")
        return real_urlopen(url, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", local_only)


@pytest.fixture
def server():
    state = FakeSource()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            state.requests.append(self.path)
            body = SERVED.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            sent = {"ok": body, "corrupt": corrupt(body), "cut": body[: len(body) // 2]}
            self.wfile.write(sent[state.mode])

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    state.base = f"http://127.0.0.1:{httpd.server_port}"
    yield state
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def toy_sources(base: str) -> dict[str, L.Source]:
    # a.txt is compressed on the way in; b.txt.gz is gzip upstream and stored as served
    return {
        "a.txt.gz": L.Source(f"{base}/a.txt", sha256(SERVED["/a.txt"])),
        "b.txt.gz": L.Source(f"{base}/b.txt.gz", sha256(GZ)),
    }


@pytest.fixture
def toyset(server, monkeypatch, tmp_path) -> Path:
    """Registers data set "toyset" with sources on the local server; returns its cache folder."""
    monkeypatch.setitem(L.SOURCES, "toyset", toy_sources(server.base))
    return tmp_path / "home" / ".cache" / "attnlab" / "toyset"


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_a_download_lands_in_the_cache_once(toyset, server):
    assert read_text("toyset", "a.txt.gz") == TEXT
    assert server.requests == ["/a.txt"]  # only the file read, not the whole set
    assert gzip.decompress((toyset / "a.txt.gz").read_bytes()) == SERVED["/a.txt"]
    assert locate("toyset", must_contain="a.txt.gz") == toyset
    assert read_text("toyset", "a.txt.gz") == TEXT
    assert server.requests == ["/a.txt"]  # found in the cache: not downloaded again
    assert locate("toyset", must_contain="b.txt.gz") == toyset
    assert (toyset / "b.txt.gz").read_bytes() == GZ  # gzip upstream: stored byte for byte
    assert server.requests == ["/a.txt", "/b.txt.gz"]
    assert [p.name for p in files_under(toyset)] == ["a.txt.gz", "b.txt.gz"]  # no temporary files


def test_locate_without_a_file_downloads_the_whole_set_reproducibly(toyset, server):
    read_text("toyset", "a.txt.gz")
    first = (toyset / "a.txt.gz").read_bytes()
    assert locate("toyset") == toyset  # a non-empty cache folder counts as the set
    assert server.requests == ["/a.txt"]
    (toyset / "a.txt.gz").unlink()
    toyset.rmdir()
    assert locate("toyset") == toyset
    assert server.requests == ["/a.txt", "/a.txt", "/b.txt.gz"]
    assert (toyset / "a.txt.gz").read_bytes() == first  # gzip with mtime 0: same bytes each time
    assert first[4:8] == bytes(4)  # the gzip header's MTIME field (RFC 1952, section 2.3)


@pytest.mark.parametrize("file", ["a.txt.gz", "b.txt.gz"])
def test_a_corrupted_download_is_refused_and_not_kept(toyset, server, tmp_path, file):
    server.mode = "corrupt"
    src = L.SOURCES["toyset"][file]
    with pytest.raises(L.ChecksumError) as err:
        read_text("toyset", file)
    msg = str(err.value)
    served = SERVED[src.url.removeprefix(server.base)]
    assert src.url in msg and src.sha256 in msg and sha256(corrupt(served)) in msg
    assert "not kept" in msg and "--data-dir" in msg  # what happened and what to do
    assert files_under(tmp_path / "home") == []  # neither the file nor a temporary one
    server.mode = "ok"  # nothing left behind stands in the way of the next try
    assert locate("toyset", must_contain=file) == toyset


def test_a_cut_connection_leaves_nothing_and_says_so(toyset, server, tmp_path):
    server.mode = "cut"
    with pytest.raises(DataNotFoundError) as err:
        read_text("toyset", "a.txt.gz")
    msg = str(err.value)
    assert "connection closed after" in msg and f"{server.base}/a.txt" in msg
    assert files_under(tmp_path / "home") == []


def test_a_server_that_is_down_gives_the_not_found_message(monkeypatch, tmp_path):
    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setitem(L.SOURCES, "toyset", toy_sources(f"http://127.0.0.1:{port}"))
    with pytest.raises(DataNotFoundError) as err:
        read_text("toyset", "a.txt.gz")
    msg = str(err.value)
    cache = tmp_path / "home" / ".cache" / "attnlab" / "toyset"
    assert "not found. Looked in:" in msg and str(cache) in msg
    assert f"http://127.0.0.1:{port}/a.txt failed" in msg
    assert "--data-dir" in msg and "ATTNLAB_DATA" in msg
    assert files_under(tmp_path / "home") == []


def test_an_explicit_data_dir_is_not_overridden_by_a_download(toyset, server, tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        read_text("toyset", "a.txt.gz", tmp_path / "mine")
    assert str(tmp_path / "mine" / "toyset" / "a.txt.gz") in str(err.value)
    assert server.requests == [] and files_under(tmp_path / "home") == []


def test_a_file_without_a_source_names_those_there_are(toyset, server):
    with pytest.raises(DataNotFoundError, match=r"no public source .* a\.txt\.gz, b\.txt\.gz"):
        locate("toyset", must_contain="c.txt.gz")
    assert server.requests == []


# --- the source table ---------------------------------------------------------------------------


def files_read(kind: str, name: str) -> tuple[str, list[str]]:
    """(data set folder, every file datasets.py reads) for a recipe's `data: {kind, dataset}`."""
    if kind == "translation":
        return name, [
            f"{s}.{lang}.gz" for s, langs in datasets.MULTI30K_SPLITS.items() for lang in langs
        ]
    if kind == "lm":
        return name, list(datasets.CHAR_CORPORA[name])
    if kind == "classification":
        spec = datasets.CLASSIFICATION[name]
        return "sentence-classification", [spec.pattern.format(split=s) for s in spec.splits]
    raise ValueError(f"data kind {kind!r} unknown to this test; add it to files_read")


def missing_sources(folder: str, files: list[str]) -> list[str]:
    return [f"{folder}/{f}" for f in files if f not in L.SOURCES.get(folder, {})]


def test_every_file_the_recipes_read_has_a_source():
    assert RECIPES, f"no recipes found in {ROOT / 'configs'}"
    for path in RECIPES:
        data = yaml.safe_load(path.read_text())["data"]
        folder, files = files_read(data["kind"], data["dataset"])
        assert not missing_sources(folder, files), path.name


def test_every_data_set_of_datasets_py_has_a_source_or_says_why_not():
    sets = [files_read("translation", "multi30k")]
    sets += [files_read("lm", name) for name in datasets.CHAR_CORPORA]
    sets += [files_read("classification", name) for name in datasets.CLASSIFICATION]
    for folder, files in sets:
        if folder not in L.NO_SOURCE:
            assert not missing_sources(folder, files)
    assert set(L.NO_SOURCE) == {"warpeace"}  # no checksum known (the module's NO_SOURCE)
    assert not set(L.NO_SOURCE) & set(L.SOURCES)


def test_every_source_is_pinned_to_a_commit():
    pinned = re.compile(r"https://raw\.githubusercontent\.com/[\w.-]+/[\w.-]+/[0-9a-f]{40}/\S+")
    for folder, table in L.SOURCES.items():
        for file, src in table.items():
            assert pinned.fullmatch(src.url), f"{folder}/{file}: {src.url} is not pinned"
            assert re.fullmatch(r"[0-9a-f]{64}", src.sha256), f"{folder}/{file}"
            assert file.endswith(".gz"), f"{folder}/{file} is not stored gzip-compressed"


def test_checksums_agree_with_the_shared_copies():
    """Oracle: every file listed in a ../shared/data SHA256SUMS (copies made from upstream) has a
    source here, and its bytes (uncompressed where the source is not gzip) match the checksum."""
    shared = ROOT.parent / "shared" / "data"
    if not shared.is_dir():
        pytest.skip(f"no shared data at {shared}")
    checked = 0
    for folder, table in L.SOURCES.items():
        sums = shared / folder / "SHA256SUMS"
        for name in sums.read_text().split()[1::2] if sums.is_file() else []:
            src = table.get(name)
            assert src is not None, f"{folder}/{name} is in {shared} but has no source"
            raw = (shared / folder / name).read_bytes()
            assert sha256(gzip.decompress(raw) if src.compress else raw) == src.sha256, name
            checked += 1
    assert checked > 0, f"{shared} holds none of the data sets with a source"
