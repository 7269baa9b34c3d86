"""Fake jobs for tests/test_stack_lane.py: ``python tests/stack_lane.py SCRATCH stack_lane_cases:JOBS JOB...``.

Each does in a moment what a live-stack job may do in minutes: return a record, fail, read the
environment, run until it is interrupted, or die.
"""

import os
import signal
import time


def _fails(folder):
    raise RuntimeError("the job's own error")


def _runs_until_interrupted(folder):
    (folder / "started").touch()
    try:
        time.sleep(120)
    finally:
        # Where a real job brings its stack down.
        (folder / "came down").touch()


def _dies(folder):
    os.kill(os.getpid(), signal.SIGKILL)


JOBS = {
    "first": lambda folder: {"made in": folder.name},
    "second": lambda folder: [2],
    "fails": _fails,
    "reads the cache setting": lambda folder: os.environ.get("NNSIGHT_REPRO_CACHE"),
    "runs until interrupted": _runs_until_interrupted,
    "dies": _dies,
}
