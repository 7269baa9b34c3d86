"""The session's self-contained live-stack jobs, run in a process of their own while the other tests run.

A *job* is everything a session fixture does with one cold stack (``tests/ndif_fixture.py``, ``LANE_JOBS``):
bring it up, run what the session asks of it, bring it down, and return a JSON record. The suite spends most
of its wall time in those cold starts, and a cold start leaves a core idle for much of its length (services
waiting on each other, clients waiting on a server), so the offline tests run meanwhile.

Why a process and not a thread: the offline tests monkeypatch ``nnsight_repro.ndif.stack`` and set
``NNSIGHT_REPRO_CACHE``, and either would reach a stack coming up in a thread of the same interpreter. The
lane starts once, before the first test, with the environment the session started with, and its jobs see
nothing the tests change afterwards.

Owns: which jobs a session needs and in what order (:func:`needed`), running the tests that read them last
(:func:`readers_last`), starting the lane with them, handing each job's record to its fixture
(:meth:`Lane.result`, which starts a job the session did not foresee on first request), and stopping the lane
so that every stack it started comes down (:meth:`Lane.stop`). Each job is bounded by its stack's own
timeouts and its clients'; the lane adds no timeout of its own.

Does not own: what a job does (``tests/ndif_fixture.py``), how a stack runs (:mod:`nnsight_repro.ndif.stack`),
or the channel a record travels on (:mod:`nnsight_repro.channel`).

Run as a script it is the lane itself: ``python stack_lane.py SCRATCH MODULE:TABLE JOB...`` runs the jobs
of that table (``ndif_fixture:LANE_JOBS``; the lane's own tests give it fakes) one after another (never two
stacks of one folder at once) and sends ``{"job", "result"}`` or ``{"job", "error"}`` for each; a job that
fails does not stop the ones after it. SIGTERM ends it through every ``finally``, so the stack it is running
comes down.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, Iterable, List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: Seconds :meth:`Lane.stop` waits for a lane it interrupted to bring its stack down before killing it.
STOP_GRACE_S = 300


class LaneError(Exception):
    """A job of the lane failed; the message names the job and carries its traceback."""


#: What ``NNSIGHT_REPRO_STACK_LANE`` may say: start the jobs ahead (the default), or each when first asked for.
MODES = ("ahead", "on-demand")


def mode() -> str:
    """The lane's mode this session; anything else is refused, naming the variable and its values."""
    from nnsight_repro import paths

    chosen = paths.setting("STACK_LANE", MODES[0])
    if chosen not in MODES:
        raise LaneError(f"{paths.variable('STACK_LANE')}={chosen!r} is not a mode of the live-stack lane: "
                        f"use {' or '.join(MODES)}.")
    return chosen


def needed(items, jobs: Iterable[str]) -> List[str]:
    """The ``jobs`` the collected ``items`` ask for as fixtures, in the order the run first reaches them."""
    known, order = set(jobs), []
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            if name in known and name not in order:
                order.append(name)
    return order


def readers_last(items, jobs: Iterable[str]) -> list:
    """``items`` with every module that reads one of ``jobs`` moved after the others, so the tests that need no
    live stack run while the lane's stacks come up. Modules keep their order and move whole: splitting one
    would set its module fixtures up twice."""
    late = {item.path for item in items if needed([item], jobs)}
    return [i for i in items if i.path not in late] + [i for i in items if i.path in late]


class Lane:
    """The lane processes of one session (one at the start; one more per job asked for unforeseen)."""

    def __init__(self, scratch: Path, table: str = "ndif_fixture:LANE_JOBS"):
        self.scratch, self.table = Path(scratch), table
        self.log = self.scratch / "lane.log"
        self.streams: Dict[str, object] = {}  # job -> the stream of the process running it
        self.records: Dict[str, dict] = {}

    def start(self, jobs: List[str]) -> None:
        from nnsight_repro import channel

        if not jobs:
            return
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        argv = [sys.executable, str(Path(__file__)), str(self.scratch), self.table, *jobs]
        stream = channel.start(argv, env=env, cwd=ROOT, stderr=self.log, new_session=True,
                               what=f"the live-stack lane ({', '.join(jobs)}; its log: {self.log})")
        self.streams.update({job: stream for job in jobs})

    def result(self, job: str):
        """The record ``job`` returned, waiting for it; :class:`LaneError` with its traceback if it failed."""
        if job not in self.streams:
            self.start([job])
        stream = self.streams[job]
        while job not in self.records:
            record = stream.next()
            if record is None:
                raise LaneError(f"The live-stack lane exited without a record for {job} (its log: {self.log}).")
            self.records[record["job"]] = record
        record = self.records[job]
        if "error" in record:
            raise LaneError(f"The live-stack job {job} failed (its log: {self.log}):\n{record['error']}")
        return record["result"]

    def stop(self) -> None:
        """Interrupt what still runs (a session that ended early) and wait for its stack to come down."""
        import subprocess

        for stream in set(self.streams.values()):
            if stream.poll() is None:
                os.kill(stream.pid, signal.SIGTERM)
                try:
                    stream.process.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
            stream.close()


def main(argv: List[str]) -> int:
    scratch, (module, _, name), jobs = Path(argv[0]), argv[1].partition(":"), argv[2:]
    # What the jobs print (a stack's progress, one line per phase) goes to the lane's log with its errors.
    os.dup2(2, 1)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    from nnsight_repro import channel

    table = getattr(importlib.import_module(module), name)  # a module beside this file: first on the path

    for job in jobs:
        print(f"[lane] {job}: starting", flush=True)
        started = time.monotonic()
        folder = scratch / job
        folder.mkdir(parents=True, exist_ok=True)
        try:
            channel.send({"job": job, "result": table[job](folder)})
            outcome = "done"
        except Exception:
            channel.send({"job": job, "error": traceback.format_exc()})
            outcome = "failed"
        print(f"[lane] {job}: {outcome} in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
