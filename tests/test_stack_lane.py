"""The live-stack lane (nnsight_repro/lane.py; the plugin tests/stack_lane.py), with fake jobs
(tests/stack_lane_cases.py): each record reaches its fixture, a failing job is named and stops nothing, a job a dead lane never reached runs in a lane of its
own, an interrupted or orphaned lane still brings its job down, what a killed lane left up (or a job that
failed) is brought down by the session, and the tests that read the lane run last."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import stack_lane
from nnsight_repro import ROOT, channel
from nnsight_repro.lane import Lane, LaneError

CASES = "stack_lane_cases:JOBS"
#: Where the lane imports the fake jobs from.
HERE = [Path(__file__).resolve().parent]
SLOW = "runs until interrupted"


@pytest.fixture
def brought_down():
    return []


@pytest.fixture
def lane(tmp_path, brought_down):
    running = Lane(tmp_path, CASES, HERE, bring_down=brought_down.append, say=lambda line: None)
    yield running
    running.stop()


def wait_for(path: Path, log: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared; the lane's log:\n{log.read_text()}"
        time.sleep(0.05)


def test_each_job_s_record_reaches_its_fixture_whichever_is_asked_for_first(lane):
    lane.start(["first", "second"])
    assert lane.result("second") == [2]
    assert lane.result("first") == {"made in": "first"}


def test_a_failing_job_is_named_with_its_traceback_and_the_next_job_still_runs(lane):
    lane.start(["fails", "first"])
    with pytest.raises(LaneError) as raised:
        lane.result("fails")
    message = str(raised.value)
    assert message.startswith("The live-stack job fails failed") and str(lane.log) in message, message
    assert "RuntimeError: the job's own error" in message, message
    assert lane.result("first") == {"made in": "first"}


def test_a_job_the_session_did_not_foresee_starts_when_first_asked_for(lane):
    lane.start([])
    assert lane.streams == {}
    assert lane.result("second") == [2]


def test_a_job_the_session_did_not_foresee_waits_for_the_running_lane_to_end(lane):
    lane.start(["takes a moment"])
    started = lane.result("clock")
    assert started >= float((lane.scratch / "takes a moment" / "ended").read_text())


def test_every_lane_sees_the_environment_the_session_started_with_not_what_a_test_sets_later(monkeypatch, tmp_path):
    monkeypatch.setenv("NNSIGHT_REPRO_CACHE", str(tmp_path / "the session's"))
    running = Lane(tmp_path, CASES, HERE, say=lambda line: None)
    monkeypatch.setenv("NNSIGHT_REPRO_CACHE", str(tmp_path / "a test's own"))
    try:
        running.start(["first"])
        assert running.result("first") == {"made in": "first"}
        # Not foreseen: a lane of its own, started now.
        assert running.result("reads the cache setting") == str(tmp_path / "the session's")
    finally:
        running.stop()


def test_stop_interrupts_a_running_job_through_its_finally_and_the_session_makes_sure(lane, brought_down):
    lane.start([SLOW, "first"])
    wait_for(lane.scratch / SLOW / "started", lane.log)
    lane.stop()
    assert (lane.scratch / SLOW / "came down").exists()
    assert brought_down == [SLOW]  # and not "first", which never started


def test_stop_lets_a_lane_that_sent_every_record_exit_by_itself(tmp_path, brought_down):
    said = []
    running = Lane(tmp_path, CASES, HERE, bring_down=brought_down.append, say=said.append)
    running.start(["leaves a thread running"])
    assert running.result("leaves a thread running") == "sent"
    (stream,) = set(running.streams.values())
    assert stream.poll() is None  # still exiting: the thread outlives the last record
    running.stop()
    assert said == [] and brought_down == []
    assert stream.process.returncode == 0


def test_a_second_sigterm_does_not_cut_the_bringing_down_short(lane):
    lane.start([SLOW])
    (stream,) = set(lane.streams.values())
    wait_for(lane.scratch / SLOW / "started", lane.log)
    os.kill(stream.pid, signal.SIGTERM)
    wait_for(lane.scratch / SLOW / "coming down", lane.log)
    os.kill(stream.pid, signal.SIGTERM)
    stream.process.wait(60)
    assert (lane.scratch / SLOW / "came down").exists()


def test_a_lane_killed_mid_job_has_that_job_brought_down_by_the_session(lane, brought_down):
    lane.start([SLOW, "first"])
    (stream,) = set(lane.streams.values())
    wait_for(lane.scratch / SLOW / "started", lane.log)
    os.killpg(stream.pid, signal.SIGKILL)
    lane.stop()
    assert brought_down == [SLOW]  # and not "first", which never started


def test_a_lane_whose_session_is_killed_outright_brings_its_job_down(tmp_path):
    session = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom nnsight_repro.lane import Lane\n"
         f"Lane({str(tmp_path)!r}, {CASES!r}, {[str(p) for p in HERE]!r}).start([{SLOW!r}])\n"
         "time.sleep(300)\n"],
        cwd=Path(__file__).parent, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_for(tmp_path / SLOW / "started", tmp_path / "lane.log")
        session.kill()
        wait_for(tmp_path / SLOW / "came down", tmp_path / "lane.log", seconds=30)
    finally:
        session.kill()
        session.wait()


def test_a_job_that_failed_has_its_stack_brought_down_again_by_the_session(lane, brought_down):
    lane.start(["fails", "first"])
    assert lane.result("first") == {"made in": "first"}
    lane.stop()
    assert brought_down == ["fails"]  # its own `down` may be what failed


def test_a_job_after_the_one_its_lane_died_in_runs_in_a_lane_of_its_own_once_that_stack_is_down(lane, brought_down):
    lane.start(["dies", "first"])
    assert lane.result("first") == {"made in": "first"}
    assert brought_down == ["dies"]
    assert len(set(lane.streams.values())) == 2


def test_a_lane_that_dies_is_a_channel_error_naming_the_lane_and_its_log(lane):
    lane.start(["dies", "first"])
    with pytest.raises(channel.ChannelError) as raised:
        lane.result("dies")
    message = str(raised.value)
    assert message.startswith("the live-stack lane (dies, first; its log: "), message
    assert "was killed by SIGKILL" in message, message


def test_jobs_are_needed_in_the_order_the_run_first_reaches_them_by_fixture_or_parameter():
    items = [SimpleNamespace(fixturenames=names) for names in
             (["tmp_path"], ["b", "tmp_path"], ["a", "b"], ["c"])]
    items.insert(1, SimpleNamespace(fixturenames=["request"], callspec=SimpleNamespace(params={"extra": "c"})))
    assert stack_lane.needed(items, ["a", "b", "c"]) == ["c", "b", "a"]


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
