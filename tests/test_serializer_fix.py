"""The serializer fix in both extras series: its nnsight tests, and the wire.

nnsight ships a function defined in a user's script by its source, and read
that source through ``inspect``, which follows ``__wrapped__``: a
``functools.wraps`` wrapper went as the function it wraps. The fix is 0002 of
``patches/nnsight-v0.8.1-extras`` and 0003 of ``patches/nnsight-v0.7.0-extras``;
``tests/test_upstream_repros.py`` keeps the repros.

Here:

- the tests each fix adds to nnsight's own ``tests/`` pass with it and fail on
  the release (exactly the ones that test the bug), run by the line's
  interpreter from a copy of its installed nnsight with the series applied;
- the wire, the way a server meets a request: a payload is dumped in one
  process and loaded and called in a fresh process of the other build. A
  payload from a fixed client runs right on a released server, and a payload
  from a released client loads on a fixed server as it does on the release.

Every child sends its record through nnsight_repro.channel; the payloads
themselves travel in files the parent names.
"""

import xml.etree.ElementTree as ET
from dataclasses import dataclass

import pytest

from decorated_cases import DEFINITIONS
from nnsight_repro import ROOT, envs, overlays, settings


@dataclass(frozen=True)
class Line:
    env: str
    series: str
    tests: tuple  # pytest arguments selecting the fix's tests in nnsight's tests/
    count: int  # tests the fix adds
    pass_on_release: frozenset  # of them, the ones that hold already (guards, not the bug)


LINES = {
    "0.8.1": Line("upstream-0.8", "nnsight-v0.8.1-extras",
                  ("tests/test_serialization.py", "-k", "TestDecoratedFunctions"), 15,
                  # The fallback for a wrapper whose own state cannot be pickled sends the wrapped
                  # function, as the release does: these two pin that both builds agree.
                  frozenset({"test_wrapper_whose_closure_cannot_be_pickled_sends_the_wrapped_function",
                             "test_torch_compile_helper_goes_undecorated"})),
    "0.7.0": Line("main", "nnsight-v0.7.0-extras",
                  ("tests/test_decorated_function_serialization.py",), 18,
                  frozenset({"test_function_without_source_is_refused_naming_it",
                             "test_payload_in_the_0_7_0_format_still_loads",
                             "test_plain_function_state_carries_no_name"})),
}


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """Per line, a copy of the installed nnsight with the extras series applied (its ``src``; ``tests`` beside it)."""
    scratch = tmp_path_factory.mktemp("serializer-fix")
    return {name: overlays.with_series(envs.ensure(line.env, build=False), line.series, scratch / name)
            for name, line in LINES.items()}


def _run_tests(line: Line, tree, pythonpath, report) -> dict:
    """Run the fix's tests from ``tree``; {test name: passed}."""
    extra = dict(settings.HF_OFFLINE)
    if pythonpath:
        extra["PYTHONPATH"] = str(pythonpath)
    result = envs.ensure(line.env, build=False).run(
        ["-m", "pytest", *line.tests, "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=tree, extra_env=extra, timeout=900)
    assert report.is_file(), f"pytest did not run:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    return {case.get("name"): not any(child.tag in ("failure", "error", "skipped") for child in case)
            for case in ET.parse(report).iter("testcase")}


@pytest.mark.parametrize("name", LINES)
def test_the_fix_passes_its_own_tests(name, fixed, tmp_path):
    line = LINES[name]
    outcome = _run_tests(line, fixed[name].parent, fixed[name], tmp_path / "report.xml")
    assert len(outcome) == line.count and all(outcome.values()), outcome


@pytest.mark.parametrize("name", LINES)
def test_the_release_fails_exactly_the_tests_of_the_bug(name, fixed, tmp_path):
    # The same test files, against the environment's installed (released) nnsight.
    line = LINES[name]
    outcome = _run_tests(line, fixed[name].parent, None, tmp_path / "report.xml")
    assert len(outcome) == line.count, outcome
    assert {test for test, passed in outcome.items() if passed} == line.pass_on_release, outcome


# -- the wire ------------------------------------------------------------------------

# Run as __main__ from a file: every function here goes by value, from its source.
DUMP = """
import pickle, sys, warnings
warnings.simplefilter("ignore")
from nnsight.intervention import serialization
""" + DEFINITIONS + """
cases = {name: CASES[name] for name in ("stacked", "no_grad", "decorated_closure", "plain")}
with open(sys.argv[1], "wb") as out:
    # The arguments pickled apart, so a reader without torch can open the file.
    pickle.dump({name: (serialization.dumps(fn), pickle.dumps(args), repr(fn(*args)), fn.__name__)
                 for name, (fn, args) in cases.items()}, out)
"""

# A fresh process of the server's build: it has never seen the client's script.
LOAD = """
import pickle, sys, warnings
from nnsight_repro.channel import send
warnings.simplefilter("ignore")
from nnsight.intervention import serialization
record = {}
with open(sys.argv[1], "rb") as payloads:
    for name, (data, args, expected, fn_name) in pickle.load(payloads).items():
        try:
            fn = serialization.loads(data)
            got = repr(fn(*pickle.loads(args)))
            record[name] = {"equal": got == expected, "got": got, "name": fn.__name__, "client_name": fn_name}
        except Exception as exc:
            record[name] = {"error": f"{type(exc).__name__}: {exc}"}
send(record)
"""


@pytest.fixture(scope="module")
def wire(fixed, tmp_path_factory):
    """``wire(line, client, server)`` -> the server's record; client and server are "fixed" or "release"."""
    scratch = tmp_path_factory.mktemp("wire")
    (scratch / "dump.py").write_text(DUMP)
    (scratch / "load.py").write_text(LOAD)
    done = {}

    def pythonpath(line, build):
        return {"PYTHONPATH": str(fixed[line])} if build == "fixed" else {}

    def run(line, client, server):
        env = envs.ensure(LINES[line].env, build=False)
        payload = scratch / f"{line}-{client}.pickle"
        if not payload.is_file():
            result = env.run([str(scratch / "dump.py"), str(payload)], cwd=scratch,
                             extra_env=pythonpath(line, client), timeout=600)
            assert payload.is_file(), result.stderr[-3000:]
        if (line, client, server) not in done:
            done[line, client, server] = env.run_one(
                [str(scratch / "load.py"), str(payload)], doing=f"loading a {client} {line} payload",
                cwd=scratch, extra_env={"PYTHONPATH": ":".join([*pythonpath(line, server).values(), str(ROOT)])},
                timeout=600)
        return done[line, client, server]

    run.payload = lambda line, build: scratch / f"{line}-{build}.pickle"
    return run


@pytest.mark.parametrize("name", LINES)
def test_a_plain_functions_payload_is_byte_identical(name, wire):
    import pickle

    wire(name, "fixed", "release"), wire(name, "release", "release")  # both payloads written
    fixed, release = (pickle.loads(wire.payload(name, build).read_bytes())["plain"][0]
                      for build in ("fixed", "release"))
    assert fixed == release


@pytest.mark.parametrize("name", LINES)
def test_a_fixed_clients_payload_runs_right_on_a_released_server(name, wire):
    record = wire(name, "fixed", "release")
    assert {case: r.get("equal") for case, r in record.items()} == dict.fromkeys(record, True), record


def test_a_released_0_7_0_server_names_a_fixed_wrapper_as_its_code(wire):
    # The one thing a released 0.7.0 server does not restore: the wrapper's __name__.
    assert wire("0.7.0", "fixed", "release")["stacked"]["name"] == "wrapper"


def test_a_released_0_8_1_server_restores_a_fixed_wrappers_name(wire):
    # The 0.8.1 fix sends the name through cloudpickle's own function setstate, which 0.8.1 has.
    record = wire("0.8.1", "fixed", "release")
    assert {case: r.get("name") == r.get("client_name") for case, r in record.items()} == \
        dict.fromkeys(record, True), record


@pytest.mark.parametrize("name", LINES)
def test_a_fixed_server_restores_a_wrappers_name(name, wire):
    record = wire(name, "fixed", "fixed")
    assert {case: (r.get("equal"), r.get("name") == r.get("client_name")) for case, r in record.items()} == \
        dict.fromkeys(record, (True, True)), record


@pytest.mark.parametrize("name", LINES)
def test_a_released_clients_payload_loads_on_a_fixed_server_as_on_a_released_one(name, wire):
    assert wire(name, "release", "fixed") == wire(name, "release", "release")


def test_a_released_0_8_1_client_sends_a_stacked_wrapper_as_the_wrapped_function(wire):
    # The control for the test above: the release's payload is wrong on either server.
    assert wire("0.8.1", "release", "release")["stacked"]["got"] == "1"


def test_a_released_0_7_0_client_sends_a_decorated_closure_that_no_server_loads(wire):
    assert wire("0.7.0", "release", "release")["decorated_closure"] == {
        "error": "NameError: name 'register' is not defined"}
