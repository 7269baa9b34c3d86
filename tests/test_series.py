"""The patch series: it applies to its base, and only to its base."""

import shutil
import subprocess

import pytest

from nnsight_repro import envs, series

NAME = "nnsight-v0.7.0"


@pytest.fixture(scope="module")
def release_tree():
    """The released nnsight 0.7.0 source, as the ``main`` environment was built from it."""
    return envs.ensure("main", build=False).source


def test_series_names_its_upstream_base():
    base = series.base(NAME)
    assert (base.repo, base.tag, base.commit) == ("ndif-team/nnsight", "v0.7.0", "884bd1c7b0dbd53be01ade6a18843078d90367b4")


def test_series_lists_every_patch_in_its_folder():
    folder = series.directory(NAME)
    assert sorted(p.name for p in series.patches(NAME)) == sorted(p.name for p in folder.glob("*.patch"))


def test_series_git_ams_cleanly_onto_the_released_source(release_tree):
    series.am_onto_tree(NAME, release_tree)


def test_series_refuses_a_tree_of_another_release_naming_the_base():
    other = envs.ensure("upstream-0.8", build=False).source
    with pytest.raises(series.SeriesError, match=r"v0\.7\.0 \(884bd1c7b0dbd53be01ade6a18843078d90367b4\)"):
        series.am_onto_tree(NAME, other)


def test_series_refuses_a_checkout_at_another_commit(tmp_path):
    repo = tmp_path / "nnsight"
    repo.mkdir()
    for args in (["init", "-q"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    with pytest.raises(series.SeriesError, match="git -C .* checkout v0.7.0"):
        series.check_repo(NAME, repo)


def test_series_digest_follows_every_patch(tmp_path, monkeypatch):
    before = series.digest(NAME)
    copy = tmp_path / "patches"
    shutil.copytree(series.PATCHES, copy)
    first = series.patches(NAME)[0].name
    (copy / NAME / first).write_text((copy / NAME / first).read_text() + "\n")
    monkeypatch.setattr(series, "PATCHES", copy)
    assert series.digest(NAME) != before


def test_unknown_series_is_refused_naming_the_known_ones():
    with pytest.raises(series.SeriesError, match=NAME):
        series.patches("nnsight-v9.9.9")
