"""The result channel (nnsight_repro.channel): a child's result arrives intact whatever its libraries print,
and every way a child can fail to deliver one is one clear error naming what ran where."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nnsight_repro import ROOT, channel

from channel_child import RECORD  # tests/ is on sys.path under pytest

CHILD = Path(__file__).with_name("channel_child.py")
WHAT = "the test's child environment"


def argv(behaviour):
    return [sys.executable, str(CHILD), behaviour]


def env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def run_one(behaviour, **kwargs):
    return channel.run_one(argv(behaviour), env=env(), cwd=ROOT, timeout=kwargs.pop("timeout", 60), what=WHAT,
                           **kwargs)


def assert_names_what_ran_where(error, behaviour):
    message = str(error)
    assert message.startswith(WHAT + ":"), message
    assert f"channel_child.py {behaviour}" in message, message


def failure(behaviour, match, error=channel.ChannelError, **kwargs):
    """What ``run_one(behaviour)`` raises: ``error`` matching ``match``, naming what ran where."""
    with pytest.raises(error, match=match) as caught:
        run_one(behaviour, **kwargs)
    assert_names_what_ran_where(caught.value, behaviour)
    return caught.value


def test_result_survives_a_spinner_frame_and_noise_on_stdout_and_stderr():
    assert run_one("noisy") == RECORD


def test_result_larger_than_a_pipe_buffer_arrives_whole():
    assert run_one("large") == {"blob": "x" * 1_000_000}


def test_stdin_input_reaches_the_child():
    assert run_one("echo-stdin", input='{"units": [1, 2]}') == {"stdin": '{"units": [1, 2]}'}


def test_malformed_result_is_a_channel_error_not_a_json_error():
    assert not isinstance(failure("malformed", "sent a malformed result"), ValueError)


def test_unfinished_result_is_reported_as_such():
    failure("unfinished", "left an unfinished result")


def test_missing_result_is_an_error_quoting_what_the_child_printed():
    assert "I printed but sent nothing" in failure("silent", "without sending a result").stdout_tail


def test_two_results_where_one_was_expected_is_an_error():
    with pytest.raises(channel.ChannelError, match="sent 2 results where one was expected"):
        run_one("two")
    assert channel.run(argv("two"), env=env(), timeout=60, what=WHAT) == [{"n": 1}, {"n": 2}]


def test_failing_child_is_an_error_with_its_exit_code_and_stderr_tail():
    error = failure("failing", "exited with code 1")
    assert error.returncode == 1
    assert "the child's own error message" in error.stderr_tail
    assert "about to fail" in str(error)


def test_child_killed_by_a_signal_is_named_by_the_signal():
    assert "dying by signal" in failure("signal", "was killed by SIGKILL").stderr_tail


def test_child_past_its_timeout_is_killed_and_reported():
    started = time.monotonic()
    error = failure("hang", "within 2 s and was killed", channel.ChannelTimeout, timeout=2)
    assert time.monotonic() - started < 30
    assert "hanging" in error.stderr_tail


def test_stream_delivers_each_record_then_names_the_crash():
    with channel.start(argv("stream-then-crash"), env=env(), what=WHAT) as stream:
        assert [stream.next(timeout=60) for _ in range(3)] == [{"n": 0}, {"n": 1}, {"n": 2}]
        with pytest.raises(channel.ChannelError, match="was killed by SIGSEGV") as caught:
            stream.next(timeout=60)
    assert "segfaulting now" in caught.value.stderr_tail
    assert_names_what_ran_where(caught.value, "stream-then-crash")


def test_stream_ends_with_none_after_a_clean_exit():
    with channel.start(argv("two"), env=env(), what=WHAT) as stream:
        assert [stream.next(60), stream.next(60), stream.next(60)] == [{"n": 1}, {"n": 2}, None]


def test_stream_read_times_out_and_kills_the_child():
    with channel.start(argv("stream-then-hang"), env=env(), what=WHAT) as stream:
        assert stream.next(timeout=60) == {"n": 0}
        with pytest.raises(channel.ChannelTimeout, match="within 1 s"):
            stream.next(timeout=1)
        assert stream.poll() is not None


def test_stderr_can_go_to_a_callers_log_and_the_tail_is_this_childs_own(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("an earlier worker's last words\n")
    with channel.start(argv("failing"), env=env(), what=WHAT, stderr=log) as stream:
        with pytest.raises(channel.ChannelError) as caught:
            stream.next(60)
    assert "about to fail" in log.read_text() and "earlier worker" not in caught.value.stderr_tail


def test_channel_files_are_removed_once_the_child_is_done():
    stream = channel.start(argv("two"), env=env(), what=WHAT)
    stream.records(60)
    stream.close()
    assert not stream.folder.exists()


def test_send_without_a_channel_is_a_clear_error():
    result = subprocess.run([sys.executable, "-c", "from nnsight_repro import channel; channel.send({'a': 1})"],
                            env={k: v for k, v in env().items() if k != channel.RESULT_FILE},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and f"no result channel ({channel.RESULT_FILE} is not set)" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="entering a namespace needs root and ip")
def test_result_arrives_through_ip_netns_exec():
    name = f"nnsr-channel-test-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert channel.run_one(["ip", "netns", "exec", name, *argv("noisy")], env=env(), timeout=60,
                               what=WHAT)["trace:bert-mlm:0.08"]["ok"]
    finally:
        subprocess.run(["ip", "netns", "del", name])
