"""The patch series: each names a real upstream base, applies to it and only to it; the 0.8.1 port's tests pass.

``nnsight-v0.7.0`` carries the fix; ``nnsight-v0.8.1`` carries no fix (0.8 fixed the envoy bug its own
way) but forward-ports our regression tests into nnsight's own ``tests/``, so for it "it works" also
means: the test file it adds passes when run by nnsight 0.8.1 (the ``upstream-0.8`` environment) from
the patched tree.
"""

import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import pytest

from nnsight_repro import envs, series, settings


@dataclass(frozen=True)
class Base:
    #: The environment built from the released source the series is based on, and one built from another.
    env: str
    other_env: str
    tag: str
    commit: str


SERIES = {
    "nnsight-v0.7.0": Base("main", "upstream-0.8", "v0.7.0", "884bd1c7b0dbd53be01ade6a18843078d90367b4"),
    "nnsight-v0.8.1": Base("upstream-0.8", "main", "v0.8.1", "de7fec4d207fc8e0deacaa44fb68f8d0412506ef"),
}
PORT = "nnsight-v0.8.1"
ADDED_TESTS = "tests/test_overloaded_mount.py"
#: What the port adds: the encoder tree (4), the remote path (2), the key (4),
#: an `input` submodule (1). The mount itself is 0.8.1's own TestOverloadedMount.
PORTED_TESTS = 11


def released_source(env_name: str):
    """The released nnsight source, as the environment ``env_name`` was built from it."""
    return envs.ensure(env_name, build=False).source


def failed_cases(report):
    cases = list(ET.parse(report).iter("testcase"))
    return cases, [c.get("name") for c in cases if any(child.tag in ("failure", "error", "skipped") for child in c)]


@pytest.mark.parametrize("name", SERIES)
def test_series_names_its_upstream_base(name):
    base = series.base(name)
    assert (base.repo, base.tag, base.commit) == ("ndif-team/nnsight", SERIES[name].tag, SERIES[name].commit)


@pytest.mark.parametrize("name", SERIES)
def test_series_lists_every_patch_in_its_folder(name):
    folder = series.directory(name)
    assert sorted(p.name for p in series.patches(name)) == sorted(p.name for p in folder.glob("*.patch"))


@pytest.mark.parametrize("name", SERIES)
def test_series_pins_a_file_that_exists_at_the_base(name):
    # A series of new files only would pass the blob check on any tree.
    assert series.preimages(name), "the series modifies no existing file, so its base cannot be checked"


@pytest.mark.parametrize("name", SERIES)
def test_series_git_ams_cleanly_onto_the_released_source(name):
    series.am_onto_tree(name, released_source(SERIES[name].env))


@pytest.mark.parametrize("name", SERIES)
def test_series_refuses_a_tree_of_another_release_naming_the_base(name):
    base = SERIES[name]
    with pytest.raises(series.SeriesError, match=rf"{base.tag.replace('.', '[.]')} \({base.commit}\)"):
        series.am_onto_tree(name, released_source(base.other_env))


def test_series_refuses_a_checkout_at_another_commit(tmp_path):
    repo = tmp_path / "nnsight"
    repo.mkdir()
    for args in (["init", "-q"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    with pytest.raises(series.SeriesError, match="git -C .* checkout v0.7.0"):
        series.check_repo("nnsight-v0.7.0", repo)


def test_series_digest_follows_every_patch(tmp_path, monkeypatch):
    name = "nnsight-v0.7.0"
    before = series.digest(name)
    copy = tmp_path / "patches"
    shutil.copytree(series.PATCHES, copy)
    first = series.patches(name)[0].name
    (copy / name / first).write_text((copy / name / first).read_text() + "\n")
    monkeypatch.setattr(series, "PATCHES", copy)
    assert series.digest(name) != before


def test_series_base_check_limited_to_a_folder_passes_on_a_tree_of_only_that_folder(tmp_path):
    # What an installed package gives (overlays.with_package_series): its library files, no tests/.
    name = "nnsight-v0.7.0-extras"
    shutil.copytree(released_source("main") / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    with pytest.raises(series.SeriesError, match="tests/test_lambda_serialization.py is missing"):
        series.check_tree(name, tmp_path)
    series.check_tree(name, tmp_path, only="src")


def test_series_applied_with_only_a_folder_changes_nothing_outside_it(tmp_path):
    name = "nnsight-v0.7.0-extras"
    shutil.copytree(released_source("main") / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    series.apply(name, tmp_path, only="src")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    with pytest.raises(series.SeriesError, match="serialization.py is blob"):
        series.check_tree(name, tmp_path, only="src")  # it did change src/


def test_series_base_check_limited_to_a_folder_it_does_not_modify_is_refused(tmp_path):
    with pytest.raises(series.SeriesError, match="modifies no existing file under docs/"):
        series.check_tree("nnsight-v0.7.0", tmp_path, only="docs")


def test_unknown_series_is_refused_naming_the_known_ones():
    with pytest.raises(series.SeriesError, match="nnsight-v0.7.0"):
        series.patches("nnsight-v9.9.9")


# The 0.8.1 port -------------------------------------------------------------------------------

def test_081_base_commit_is_the_one_the_released_sdist_was_built_from():
    # setuptools-scm records the commit it built from; distance 0 and not dirty
    # mean the sdist is exactly that commit's tree.
    tree = released_source(SERIES[PORT].env)
    recorded = json.loads((tree / "src" / "nnsight.egg-info" / "scm_version.json").read_text())
    assert recorded["node"] == "g" + series.base(PORT).commit
    assert (recorded["tag"], recorded["distance"], recorded["dirty"]) == ("0.8.1", 0, False)


@pytest.fixture(scope="module")
def applied_081_tree(tmp_path_factory):
    """A copy of the 0.8.1 source with the port applied (build output left behind)."""
    tree = tmp_path_factory.mktemp("nnsight-0.8.1") / "nnsight"
    shutil.copytree(released_source(SERIES[PORT].env), tree, ignore=shutil.ignore_patterns("build", "__pycache__"))
    series.apply(PORT, tree)
    return tree


def test_081_port_s_tests_pass_on_nnsight_081(applied_081_tree, tmp_path):
    env = envs.ensure("upstream-0.8", build=False)
    report = tmp_path / "report.xml"
    result = env.run(["-m", "pytest", ADDED_TESTS, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
                     cwd=applied_081_tree, timeout=900)
    assert report.is_file(), f"pytest did not run:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    cases, failed = failed_cases(report)
    assert len(cases) == PORTED_TESTS and not failed, (len(cases), failed, result.stdout[-3000:])


def test_081_covers_the_overloaded_mount_offline_in_its_own_suite(tmp_path):
    # Why the port carries no mount tests: 0.8.1's own TestOverloadedMount pins
    # the served value, E_output, its path, named_modules, get, rename, repr
    # and alias conflicts on a toy module, with no Hub access.
    env = envs.ensure("upstream-0.8", build=False)
    report = tmp_path / "report.xml"
    result = env.run(["-m", "pytest", "tests/test_interleaving.py::TestOverloadedMount", "-q",
                      "-p", "no:cacheprovider", f"--junitxml={report}"],
                     cwd=released_source(SERIES[PORT].env), extra_env=dict(settings.HF_OFFLINE), timeout=900)
    assert report.is_file(), f"pytest did not run:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    cases, failed = failed_cases(report)
    assert len(cases) == 11 and not failed, (len(cases), failed, result.stdout[-3000:])
