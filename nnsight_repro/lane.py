"""Jobs run one after another in a process of their own, beside the process that asked for them.

The test session runs its live-stack jobs here (``tests/stack_lane.py``, the pytest plugin, says which and
when): a *job* brings a stack up cold, runs what the session asks of it, brings it down and returns a JSON
record, and a cold start leaves a core idle for much of its length, so the offline tests run meanwhile.

Why a process and not a thread: the offline tests monkeypatch ``nnsight_repro.ndif.stack`` and set
``NNSIGHT_REPRO_CACHE``, and either would reach a stack coming up in a thread of the same interpreter. A lane
sees the environment its session started with, nothing a test changes afterwards.

Owns: starting a lane with its jobs (:meth:`Lane.start`), handing each job's record over (:meth:`Lane.result`;
a job nobody foresaw, or one a lane died before reaching, starts on first request, once no other lane runs,
since two jobs may use one stack folder), and stopping the lanes so that every stack they started comes down
(:meth:`Lane.stop`). Each job is bounded by its stack's own timeouts and its clients'; a lane adds none.

Does not own: which jobs a session needs or what they do (``tests/stack_lane.py``, ``tests/ndif_fixture.py``),
how a stack runs (:mod:`nnsight_repro.ndif.stack`), or the channel a record travels on
(:mod:`nnsight_repro.channel`).

Run as ``python -m nnsight_repro.lane PARENT SCRATCH MODULE:TABLE JOB...`` it is a lane: it runs the jobs of
that table (importable from its ``PYTHONPATH``) one after another and sends ``{"job", "started"}`` before each
and ``{"job", "result"}`` or ``{"job", "error"}`` after it; a job that fails does not stop the ones after it.
SIGTERM, or the death of the process ``PARENT``, ends it through every ``finally``, so the stack it is running
comes down; a second SIGTERM cannot cut that short. What a lane that was killed could not bring down,
:meth:`Lane.stop` does: it knows which job had started and sent nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

from . import ROOT, channel, settings

#: What ``NNSIGHT_REPRO_STACK_LANE`` may say: start the jobs ahead (the default), or each when first asked for.
MODES = ("ahead", "on-demand")


def mode() -> str:
    """The lane's mode this session; anything else is refused, naming the variable and its values."""
    chosen = settings.setting("STACK_LANE", MODES[0])
    if chosen not in MODES:
        raise LaneError(f"{settings.variable('STACK_LANE')}={chosen!r} is not a mode of the live-stack lane: "
                        f"use {' or '.join(MODES)}.")
    return chosen


#: Seconds :meth:`Lane.stop` waits for a lane it interrupted to bring its stack down before killing it.
STOP_GRACE_S = 300
#: Seconds :meth:`Lane.stop` gives a lane that has sent every job's record to exit by itself.
EXITING_S = 30
#: Linux's prctl option that sends this process a signal when its parent dies.
PR_SET_PDEATHSIG = 1


class LaneError(Exception):
    """A lane cannot hand over a job's record: the job failed, or the lane died; the message names which,
    with the job's traceback or the lane's log."""


class Lane:
    """The lane processes of one session: one at the start, and one more per job asked for unforeseen.

    ``table``: the jobs, as ``module:name`` importable from ``path`` (folders put first on the lane's
    ``PYTHONPATH``). ``bring_down(job)``: brings down the
    stack of a job that started and sent nothing before its lane ended. An interrupted lane brings its stack
    down itself, but the SIGTERM may have landed in that job's own ``down`` and cut it short, and a killed lane
    brings nothing down; ``down`` is idempotent, so the session does it again. ``say``: where :meth:`stop`
    reports.
    """

    def __init__(self, scratch: Path, table: str, path: List[Path], bring_down: Optional[Callable[[str], object]] = None,
                 say: Callable[[str], None] = print):
        self.scratch, self.table, self.path, self.bring_down, self.say = Path(scratch), table, path, bring_down, say
        self.log = self.scratch / "lane.log"
        # Every lane sees the environment the session started with, not what a test has set by the time it
        # asks for an unforeseen job.
        self.env = dict(os.environ)
        self.streams: Dict[str, object] = {}  # job -> the stream of the lane process running it
        self.records: Dict[str, dict] = {}  # job -> its result or error record
        self.started: set = set()
        self.downed: set = set()  # jobs whose stack the session brought down
        self.closed: set = set()  # streams stop() has read to the end and closed
        self.died: Dict[object, Exception] = {}  # stream -> the ChannelError it ended with

    def start(self, jobs: List[str]) -> None:
        if not jobs:
            return
        env = dict(self.env)
        # The caller's interpreter need not be a project environment (which puts the project on the path).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, self.path), str(ROOT), env.get("PYTHONPATH")]))
        argv = [sys.executable, "-m", __name__, str(os.getpid()), str(self.scratch), self.table, *jobs]
        stream = channel.start(argv, env=env, cwd=ROOT, stderr=self.log, new_session=True,
                               what=f"the live-stack lane ({', '.join(jobs)}; its log: {self.log})")
        self.streams.update({job: stream for job in jobs})

    def result(self, job: str):
        """The record ``job`` returned, waiting for it; :class:`LaneError` with its traceback if it failed."""
        if job not in self.streams:
            self._finish_running()
            self.start([job])
        stream = self.streams[job]
        while job not in self.records:
            if not self._read(stream):
                if stream in self.died and job not in self.started:
                    # The lane died in an earlier job: this one never ran, so it gets a lane of its own, once
                    # the stack of the job it died in is down (the two may share a folder).
                    self._bring_down_unfinished(stream)
                    self._finish_running()
                    self.start([job])
                    stream = self.streams[job]
                    continue
                if stream in self.died:
                    raise self.died[stream]
                raise LaneError(f"The live-stack lane exited without a record for {job} (its log: {self.log}).")
        record = self.records[job]
        if "error" in record:
            raise LaneError(f"The live-stack job {job} failed (its log: {self.log}):\n{record['error']}")
        return record["result"]

    def stop(self) -> None:
        """Interrupt whatever lane still runs (a session that ended early), wait for it to bring its stack
        down, and bring down what it could not."""
        lanes = [stream for stream in dict.fromkeys(self.streams.values()) if stream not in self.closed]
        try:
            for stream in lanes:
                if stream.poll() is None and self._sent_everything(stream):
                    # Its last record can arrive before its process has exited: it is ending, not to be interrupted.
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        stream.process.wait(EXITING_S)
            running = [stream for stream in lanes if stream.poll() is None]
            if running:
                self.say(f"[ndif] interrupting the live-stack lane; it brings its stack down (log: {self.log})")
            for stream in running:
                os.kill(stream.pid, signal.SIGTERM)
            for stream in running:
                try:
                    stream.process.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    stream.kill()  # what it left up is brought down below
        finally:
            for stream in lanes:
                if stream.poll() is None:
                    stream.kill()  # interrupted again while waiting: what it left up is brought down below
                while self._read(stream):
                    pass
                stream.close()
                self.closed.add(stream)
            for stream in lanes:
                self._bring_down_unfinished(stream)

    def _jobs_of(self, stream) -> List[str]:
        return sorted(job for job, s in self.streams.items() if s is stream)

    def _sent_everything(self, stream) -> bool:
        return all(job in self.records for job in self._jobs_of(stream))

    def _bring_down_unfinished(self, stream) -> None:
        """Bring down the stack of each job of ``stream`` that started and returned no result: the lane was
        killed in it, or its own ``down`` failed (``down`` is idempotent, so an error record gets one too)."""
        for job in self._jobs_of(stream):
            if job in self.started and "result" not in self.records.get(job, {}) and job not in self.downed:
                self.downed.add(job)
                if self.bring_down is not None:
                    self.say(f"[ndif] {job} returned no result: making sure its stack is down")
                    self.bring_down(job)

    def _read(self, stream) -> bool:
        """Take the stream's next record; False once it has none left (it exited, or died: kept in ``died``)."""
        if stream in self.died:
            return False
        try:
            record = stream.next()
        except channel.ChannelError as exc:
            self.died[stream] = exc
            return False
        if record is None:
            return False
        if record.get("started"):
            self.started.add(record["job"])
        else:
            self.records[record["job"]] = record
        return True

    def _finish_running(self) -> None:
        # Two lanes at once could run two jobs of one stack folder: a new one waits for the last to end.
        for stream in dict.fromkeys(self.streams.values()):
            while stream.poll() is None and self._read(stream):
                pass



def _end_with_the_parent(parent: int) -> None:
    """SIGTERM this process when ``parent`` (the session) dies, so a session killed outright leaves no lane
    starting stacks nobody reads."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _interrupted(signum, frame):
    # Once: the unwinding is bringing a stack down, and a second SIGTERM must not cut that short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(128 + signum)


def main(argv: List[str]) -> int:
    parent, scratch, (module, _, name), jobs = int(argv[0]), Path(argv[1]), argv[2].partition(":"), argv[3:]
    # What the jobs print (a stack's progress, one line per phase) goes to the lane's log with its errors.
    os.dup2(2, 1)
    signal.signal(signal.SIGTERM, _interrupted)
    _end_with_the_parent(parent)
    table = getattr(importlib.import_module(module), name)
    for job in jobs:
        print(f"[lane] {job}: starting", flush=True)
        started = time.monotonic()
        folder = scratch / job
        folder.mkdir(parents=True, exist_ok=True)
        channel.send({"job": job, "started": True})
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
