"""The live-stack lane (tests/stack_lane.py), with fake jobs (tests/stack_lane_cases.py): each record reaches
its fixture, a failing job is named and stops nothing, an interrupted job still comes down, and the modules
that read the lane run after the rest."""

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import stack_lane
from nnsight_repro import ROOT, channel


@pytest.fixture
def lane(tmp_path):
    running = stack_lane.Lane(tmp_path, table="stack_lane_cases:JOBS")
    yield running
    running.stop()


def test_each_job_s_record_reaches_its_fixture_whichever_is_asked_for_first(lane):
    lane.start(["first", "second"])
    assert lane.result("second") == [2]
    assert lane.result("first") == {"made in": "first"}


def test_a_failing_job_is_named_with_its_traceback_and_the_next_job_still_runs(lane):
    lane.start(["fails", "first"])
    with pytest.raises(stack_lane.LaneError) as raised:
        lane.result("fails")
    message = str(raised.value)
    assert message.startswith("The live-stack job fails failed") and str(lane.log) in message, message
    assert "RuntimeError: the job's own error" in message, message
    assert lane.result("first") == {"made in": "first"}


def test_a_job_the_session_did_not_foresee_starts_when_first_asked_for(lane):
    lane.start([])
    assert lane.streams == {}
    assert lane.result("second") == [2]


def test_jobs_see_the_environment_the_lane_started_with_not_what_a_test_sets_later(lane, monkeypatch, tmp_path):
    monkeypatch.setenv("NNSIGHT_REPRO_CACHE", str(tmp_path / "the session's"))
    lane.start(["first", "reads the cache setting"])
    monkeypatch.setenv("NNSIGHT_REPRO_CACHE", str(tmp_path / "a test's own"))
    assert lane.result("reads the cache setting") == str(tmp_path / "the session's")


def test_stop_interrupts_a_running_job_through_its_finally_and_waits_for_it(lane):
    lane.start(["runs until interrupted"])
    started = lane.scratch / "runs until interrupted" / "started"
    deadline = time.monotonic() + 60
    while not started.exists():
        assert time.monotonic() < deadline, lane.log.read_text()
        time.sleep(0.05)
    stopped_at = time.monotonic()
    lane.stop()
    assert (started.parent / "came down").exists()
    assert time.monotonic() - stopped_at < 30
    assert all(stream.poll() is not None for stream in lane.streams.values())


def test_a_lane_that_dies_is_a_channel_error_naming_the_lane_and_its_log(lane):
    lane.start(["dies", "first"])
    with pytest.raises(channel.ChannelError) as raised:
        lane.result("first")
    message = str(raised.value)
    assert message.startswith("the live-stack lane (dies, first; its log: "), message
    assert "was killed by SIGKILL" in message, message


def test_jobs_are_needed_in_the_order_the_run_first_reaches_them():
    items = [SimpleNamespace(fixturenames=names) for names in
             (["tmp_path"], ["b", "tmp_path"], ["a", "b"], ["c"])]
    assert stack_lane.needed(items, ["a", "b"]) == ["b", "a"]


def test_modules_that_read_the_lane_run_after_the_others_each_whole():
    def item(module, *fixtures):
        return SimpleNamespace(path=Path(module), fixturenames=list(fixtures))

    items = [item("a.py"), item("remote.py"), item("remote.py", "a job"), item("b.py"), item("remote.py")]
    assert [(str(i.path), i.fixturenames) for i in stack_lane.readers_last(items, ["a job"])] == [
        ("a.py", []), ("b.py", []), ("remote.py", []), ("remote.py", ["a job"]), ("remote.py", [])]



def test_a_mode_the_lane_does_not_have_stops_the_session_before_any_test_naming_the_variable(monkeypatch):
    monkeypatch.setenv("NNSIGHT_REPRO_STACK_LANE", "sideways")
    run = subprocess.run([sys.executable, "-m", "pytest", "tests/test_layout.py", "-q"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 4, run.stdout + run.stderr
    assert ("NNSIGHT_REPRO_STACK_LANE='sideways' is not a mode of the live-stack lane: use ahead or on-demand."
            in run.stderr), run.stderr
