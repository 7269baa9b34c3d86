"""The file-system idioms of ``nnsight_repro.fsutil``."""

import pytest

from nnsight_repro import fsutil


def test_a_staged_directory_appears_whole(tmp_path):
    with fsutil.staged_directory(tmp_path / "out") as staging:
        (staging / "a").write_text("1")
        assert not (tmp_path / "out").exists()
    assert (tmp_path / "out" / "a").read_text() == "1"


def test_a_staged_directory_that_fails_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), fsutil.staged_directory(tmp_path / "out") as staging:
        (staging / "a").write_text("1")
        raise RuntimeError("half built")
    assert list(tmp_path.iterdir()) == []
