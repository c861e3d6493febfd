"""Locating data sets: search order, an explicit data_dir that is never overridden, empty folders,
the error that names every place looked. Offline: HOME is a temporary folder and no URL opens."""

import urllib.request

import pytest

from attnlab.data import DataNotFoundError, locate, read_text


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No test here may reach the network or the real ~/.cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ATTNLAB_DATA", raising=False)

    def refuse(url, *args, **kwargs):
        raise AssertionError(f"test_locate opened {url}")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


def test_search_order_and_empty_folders_do_not_count(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_DATA", str(tmp_path / "env"))
    (tmp_path / "env" / "toyset").mkdir(parents=True)  # empty: an interrupted copy leaves this
    with pytest.raises(DataNotFoundError) as err:
        locate("toyset")
    msg = str(err.value)
    assert str(tmp_path / "env" / "toyset") in msg
    assert str(tmp_path / "home" / ".cache" / "attnlab" / "toyset") in msg
    assert "ATTNLAB_DATA" in msg and "--data-dir" in msg and "no automatic download" in msg
    (tmp_path / "env" / "toyset" / "a.txt").write_text("x")
    assert locate("toyset") == tmp_path / "env" / "toyset"
    # the cache comes after $ATTNLAB_DATA, and is used when that lacks the file asked for
    cache = tmp_path / "home" / ".cache" / "attnlab" / "toyset"
    cache.mkdir(parents=True)
    (cache / "b.txt").write_text("y")
    assert locate("toyset") == tmp_path / "env" / "toyset"
    assert locate("toyset", must_contain="b.txt") == cache


def test_explicit_data_dir_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_DATA", str(tmp_path / "env"))
    for root in ("env", "explicit"):
        (tmp_path / root / "toyset").mkdir(parents=True)
        (tmp_path / root / "toyset" / "a.txt").write_text(root)
    assert locate("toyset", tmp_path / "explicit") == tmp_path / "explicit" / "toyset"
    assert read_text("toyset", "a.txt", tmp_path / "explicit") == "explicit"
    assert read_text("toyset", "a.txt") == "env"


@pytest.mark.parametrize("state", ["missing", "empty", "other files"])
def test_explicit_data_dir_without_the_set_is_never_overridden(tmp_path, monkeypatch, state):
    monkeypatch.setenv("ATTNLAB_DATA", str(tmp_path / "env"))
    (tmp_path / "env" / "toyset").mkdir(parents=True)
    (tmp_path / "env" / "toyset" / "a.txt").write_text("x")  # the data exists elsewhere
    explicit = tmp_path / "explicit"
    if state != "missing":
        (explicit / "toyset").mkdir(parents=True)
    if state == "other files":
        (explicit / "toyset" / "a.text").write_text("typo")
    with pytest.raises(DataNotFoundError) as err:
        locate("toyset", explicit, must_contain="a.txt")
    msg = str(err.value)
    assert str(explicit / "toyset" / "a.txt") in msg  # the folder and the file expected
    assert "never overridden" in msg and str(tmp_path / "env") not in msg
    if state == "other files":
        assert "a.text" in msg  # what is there instead, so a typo shows
    with pytest.raises(DataNotFoundError, match="explicit"):
        read_text("toyset", "a.txt", explicit)
    if state != "other files":  # no file asked for: the folder must exist and not be empty
        with pytest.raises(DataNotFoundError, match="never overridden"):
            locate("toyset", explicit)
    assert locate("toyset", must_contain="a.txt") == tmp_path / "env" / "toyset"
