"""The negative control: the same suite and checks on released nnsight 0.7.0 and on the patched build.

The series is proven by difference: on ``main`` exactly the tests marked
``fixed_by_series`` fail and everything else passes; on ``patched`` everything
passes; nnsight's own tests pass on both; and every number the check routine
produces is identical between them. Each side runs in its own cached
environment (built by ``python3 -m nnsight_repro test``); a missing one is an
error that names the command, never a skip.
"""

import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nnsight_repro import ROOT, checks, envs, models

SUITE = "tests/test_envoy_overloaded_mount.py"
UPSTREAM_TINY = "tests/test_tiny.py"
UPSTREAM_REGRESSION = "tests/test_overloaded_mount.py"  # added to nnsight's tests by our series


def run_pytest(env_name: str, target: str, tmp_path_factory, cwd: Path = ROOT, extra=()) -> dict:
    """Outcome per test id ('passed', 'failed', 'error', 'skipped') of one pytest run in an environment."""
    env = envs.ensure(env_name, build=False)
    report = tmp_path_factory.mktemp(f"junit-{env_name}") / "report.xml"
    result = env.run(["-m", "pytest", target, "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *extra],
                     cwd=cwd, timeout=1200)
    if not report.is_file():
        pytest.fail(f"pytest did not run in {env_name!r}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = {"failure": "failed"}.get(kinds[0], kinds[0]) if kinds else "passed"
    return outcomes


def marked_tests(tmp_path_factory) -> set:
    env = envs.ensure("patched", build=False)
    collector = str(Path(__file__).with_name("collect_marked.py"))
    return set(env.run_one([collector, SUITE, "-m", "fixed_by_series"], doing="collecting the marked tests",
                           timeout=600)["ids"])


@pytest.fixture(scope="module")
def suite_outcomes(tmp_path_factory):
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(run_pytest, name, SUITE, tmp_path_factory)
                   for name in ("main", "patched", "upstream-0.8")}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def marked(tmp_path_factory):
    return marked_tests(tmp_path_factory)


def test_release_fails_exactly_the_tests_the_series_fixes(suite_outcomes, marked):
    outcomes = suite_outcomes["main"]
    assert marked, "no test carries the fixed_by_series marker"
    failed = {name for name, outcome in outcomes.items() if outcome in ("failed", "error")}
    assert failed == marked
    assert all(outcomes[name] == "passed" for name in outcomes if name not in marked)


def test_patched_passes_every_test(suite_outcomes):
    outcomes = suite_outcomes["patched"]
    assert outcomes and set(outcomes.values()) == {"passed"}, outcomes
    assert set(outcomes) == set(suite_outcomes["main"])


def test_upstream_08_passes_every_test(suite_outcomes):
    outcomes = suite_outcomes["upstream-0.8"]
    assert outcomes and set(outcomes.values()) == {"passed"}, outcomes


@pytest.mark.parametrize("env_name", ["main", "patched"])
def test_nnsights_own_tiny_suite_passes(env_name, tmp_path_factory):
    source = envs.ensure(env_name, build=False).source
    outcomes = run_pytest(env_name, UPSTREAM_TINY, tmp_path_factory, cwd=source)
    assert len(outcomes) >= 18 and set(outcomes.values()) == {"passed"}, outcomes


def test_series_regression_tests_fail_on_the_release_and_pass_patched(tmp_path_factory):
    tests = envs.ensure("patched", build=False).source / UPSTREAM_REGRESSION
    assert tests.is_file(), "the series no longer adds nnsight's regression tests"
    patched = run_pytest("patched", str(tests), tmp_path_factory, cwd=tests.parent.parent)
    release = run_pytest("main", str(tests), tmp_path_factory, cwd=tests.parent.parent)
    assert patched and set(patched.values()) == {"passed"}, patched
    assert "failed" in release.values() or "error" in release.values(), release


@pytest.fixture(scope="module")
def report(local_verify):
    return local_verify.report


def test_check_routine_numbers_are_identical_between_release_and_patched(report):
    assert report["numbers_identical"], report["numbers"]
    assert all({"main", "patched"} <= set(n["digests"]["embedding_shift"]) for n in report["numbers"].values())


def test_check_routine_covers_every_model_of_both_panels(report):
    assert list(report["outcomes"]) == list(models.extended())


@pytest.mark.parametrize("env_name", ["main", "patched"])
def test_check_routine_outcomes_are_exactly_the_predicted_ones(report, env_name):
    seen = {(m, c): per_env[env_name]["ok"] for m, per_check in report["outcomes"].items()
            for c, per_env in per_check.items()}
    expected = {(m, c): checks.expected_ok(models.get(m), c, fixed=env_name != "main") for m, c in seen}
    assert seen == expected, {k: v for k, v in seen.items() if v != expected[k]}
