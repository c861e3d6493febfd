"""Locating data sets: search order, empty folders, the error that names every place looked."""

import pytest

from attnlab.data import DataNotFoundError, locate


def test_explicit_dir_wins_and_empty_folders_do_not_count(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ATTNLAB_DATA", str(tmp_path / "env"))
    (tmp_path / "env" / "toyset").mkdir(parents=True)  # empty: a failed download leaves this
    with pytest.raises(DataNotFoundError) as err:
        locate("toyset", tmp_path / "explicit")
    msg = str(err.value)
    assert str(tmp_path / "explicit" / "toyset") in msg and str(tmp_path / "env" / "toyset") in msg
    assert "ATTNLAB_DATA" in msg and "--data-dir" in msg
    (tmp_path / "env" / "toyset" / "a.txt").write_text("x")
    assert locate("toyset", tmp_path / "explicit") == tmp_path / "env" / "toyset"
    (tmp_path / "explicit" / "toyset").mkdir(parents=True)
    (tmp_path / "explicit" / "toyset" / "b.txt").write_text("y")
    assert locate("toyset", tmp_path / "explicit") == tmp_path / "explicit" / "toyset"
    # a required file decides, not the folder
    assert (
        locate("toyset", tmp_path / "explicit", must_contain="a.txt") == tmp_path / "env" / "toyset"
    )
