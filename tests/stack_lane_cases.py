"""Fake jobs for tests/test_stack_lane.py: ``python -m nnsight_repro.lane PARENT SCRATCH stack_lane_cases:JOBS JOB...``.

Each does in a moment what a live-stack job may do in minutes: return a record, fail, read the
environment, run until it is interrupted (its ``finally`` standing for bringing a stack down), or die.
"""

import os
import signal
import threading
import time


def _fails(folder):
    raise RuntimeError("the job's own error")


def _runs_until_interrupted(folder):
    try:
        (folder / "started").touch()
        time.sleep(120)
    finally:
        (folder / "coming down").touch()
        time.sleep(1)  # a `down` takes a while: long enough for a second SIGTERM to arrive
        (folder / "came down").touch()


def _takes_a_moment(folder):
    time.sleep(1)
    (folder / "ended").write_text(repr(time.time()))


def _leaves_a_thread_running(folder):
    # Not a daemon: the lane's interpreter waits for it after its last record, as it may for a stack's threads.
    threading.Thread(target=time.sleep, args=(3,)).start()
    return "sent"


def _dies(folder):
    os.kill(os.getpid(), signal.SIGKILL)


JOBS = {
    "first": lambda folder: {"made in": folder.name},
    "second": lambda folder: [2],
    "fails": _fails,
    "reads the cache setting": lambda folder: os.environ.get("NNSIGHT_REPRO_CACHE"),
    "runs until interrupted": _runs_until_interrupted,
    "takes a moment": _takes_a_moment,
    "clock": lambda folder: time.time(),
    "dies": _dies,
    "leaves a thread running": _leaves_a_thread_running,
}
