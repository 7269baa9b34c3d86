"""The 0.8.1 series: it names a real upstream base, applies only there, and its tests pass on 0.8.1.

The series carries no fix (0.8 fixed the envoy bug its own way); it forward-ports
our regression tests into nnsight's own ``tests/``. So "it works" means: it
``git am``s onto the released 0.8.1 source, and the test file it adds passes
when run by nnsight 0.8.1 (the ``upstream-0.8`` environment) from that tree.
"""

import json
import shutil
import xml.etree.ElementTree as ET

import pytest

from nnsight_repro import envs, series

NAME = "nnsight-v0.8.1"
ADDED_TESTS = "tests/test_overloaded_mount.py"
BASE_COMMIT = "de7fec4d207fc8e0deacaa44fb68f8d0412506ef"
#: What the port adds: the encoder tree (4), the remote path (2), the key (4),
#: an `input` submodule (1). The mount itself is 0.8.1's own TestOverloadedMount.
PORTED_TESTS = 11


@pytest.fixture(scope="module")
def release_tree():
    """The released nnsight 0.8.1 source, as the ``upstream-0.8`` environment was built from it."""
    return envs.ensure("upstream-0.8", build=False).source


def test_series_names_its_upstream_base():
    base = series.base(NAME)
    assert (base.repo, base.tag, base.commit) == ("ndif-team/nnsight", "v0.8.1", BASE_COMMIT)


def test_base_commit_is_the_one_the_released_sdist_was_built_from(release_tree):
    # setuptools-scm records the commit it built from; distance 0 and not dirty
    # mean the sdist is exactly that commit's tree.
    recorded = json.loads((release_tree / "src" / "nnsight.egg-info" / "scm_version.json").read_text())
    assert recorded["node"] == "g" + series.base(NAME).commit
    assert (recorded["tag"], recorded["distance"], recorded["dirty"]) == ("0.8.1", 0, False)


def test_series_lists_every_patch_in_its_folder():
    folder = series.directory(NAME)
    assert sorted(p.name for p in series.patches(NAME)) == sorted(p.name for p in folder.glob("*.patch"))


def test_series_pins_a_file_that_exists_at_the_base():
    # A series of new files only would pass the blob check on any tree.
    assert series.preimages(NAME), "the series modifies no existing file, so its base cannot be checked"


def test_series_git_ams_cleanly_onto_the_released_source(release_tree):
    series.am_onto_tree(NAME, release_tree)


def test_series_refuses_the_07_release_naming_the_base():
    other = envs.ensure("main", build=False).source
    with pytest.raises(series.SeriesError, match=rf"v0\.8\.1 \({BASE_COMMIT}\)"):
        series.am_onto_tree(NAME, other)


@pytest.fixture(scope="module")
def applied_tree(release_tree, tmp_path_factory):
    """A copy of the 0.8.1 source with the series applied (build output left behind)."""
    tree = tmp_path_factory.mktemp("nnsight-0.8.1") / "nnsight"
    shutil.copytree(release_tree, tree, ignore=shutil.ignore_patterns("build", "__pycache__"))
    series.apply(NAME, tree)
    return tree


def test_series_tests_pass_on_nnsight_081(applied_tree, tmp_path):
    env = envs.ensure("upstream-0.8", build=False)
    report = tmp_path / "report.xml"
    result = env.run(["-m", "pytest", ADDED_TESTS, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
                     cwd=applied_tree, timeout=900)
    assert report.is_file(), f"pytest did not run:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    cases = list(ET.parse(report).iter("testcase"))
    failed = [c.get("name") for c in cases if any(child.tag in ("failure", "error", "skipped") for child in c)]
    assert len(cases) == PORTED_TESTS and not failed, (len(cases), failed, result.stdout[-3000:])


def test_081_covers_the_overloaded_mount_offline_in_its_own_suite(release_tree, tmp_path):
    # Why the port carries no mount tests: 0.8.1's own TestOverloadedMount pins
    # the served value, E_output, its path, named_modules, get, rename, repr
    # and alias conflicts on a toy module, with no Hub access.
    env = envs.ensure("upstream-0.8", build=False)
    report = tmp_path / "report.xml"
    result = env.run(["-m", "pytest", "tests/test_interleaving.py::TestOverloadedMount", "-q",
                      "-p", "no:cacheprovider", f"--junitxml={report}"],
                     cwd=release_tree, extra_env={"HF_HUB_OFFLINE": "1"}, timeout=900)
    assert report.is_file(), f"pytest did not run:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    cases = list(ET.parse(report).iter("testcase"))
    failed = [c.get("name") for c in cases if any(child.tag in ("failure", "error", "skipped") for child in c)]
    assert len(cases) == 11 and not failed, (len(cases), failed, result.stdout[-3000:])
