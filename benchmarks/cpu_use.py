"""Where a command's CPU time goes: core-seconds sampled from ``/proc`` while it runs.

A live NDIF stack daemonizes (Ray re-parents its workers), so a child's ``rusage`` misses most of what a
suite spends. This reads the machine instead:

- **the machine**: busy core-seconds from ``/proc/stat`` over the run (user, nice, system, irq, softirq;
  steal and iowait apart), beside the capacity, wall seconds times cores. Busy counts everything the machine
  ran, this bench's command or not;
- **by where**: every process that is this bench's descendant or lives in one of the project's network
  namespaces (``nnsr-*``: every process a stack starts, daemonized or not), the user + system time it spent
  during the run (its time at the last sample that saw it, less its time when the run began), summed by
  *where*: the namespace's name for a stack's processes (a process that enters a namespace after it starts,
  as ``ip netns exec`` does, counts there once it has); ``lane`` for the live-stack lane's process and
  everything it starts outside a namespace (the probe scripts and their clients; the fake lanes of
  tests/test_stack_lane.py count here too); else the test module whose test was running when the process
  started (``PYTEST_CURRENT_TEST``, inherited); else ``session`` (pytest itself, anything started outside a
  test).

Within a stack, **by program** too: what each process ran, as its command line names it at the last sample
that saw it (Ray retitles a worker ``ray::<Actor>`` once it holds one; an idle worker's ``ray::IDLE`` does
not replace an earlier title); a Python process by ``python -m <module>``, ``python <script>`` or
``python -c``.

Sampled every ``interval`` seconds and once more at the end, so it misses a process that lives less than an
interval and the last interval of every other; ``unattributed`` is the machine's busy time less what was
attributed: those misses, this sampler's own time, and anything else the machine ran. Linux only; stdlib
only (``/proc`` is read by :mod:`nnsight_repro.procfs`). It measures; it does not decide anything.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nnsight_repro import procfs  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
NETNS_DIR = Path("/run/netns")
NETNS_PREFIX = "nnsr-"
LANE_SCRIPT = "nnsight_repro.lane"


def machine_ticks() -> dict:
    """Cumulative ticks of all cores: busy, idle, iowait, steal."""
    user, nice, system, idle, iowait, irq, softirq, steal = procfs.cpu_ticks()[:8]
    return {"busy": user + nice + system + irq + softirq, "idle": idle, "iowait": iowait, "steal": steal}


def _stat(pid: str):
    """(ppid, start time, utime + stime in ticks) of a live process, else None."""
    try:
        fields = procfs.stat(pid)
    except OSError:
        return None
    return int(fields[1]), int(fields[19]), int(fields[11]) + int(fields[12])


def _runs_the_lane(pid: int) -> bool:
    try:
        return any(LANE_SCRIPT in arg for arg in procfs.command_line(pid))
    except OSError:
        return False


def _test_module(pid: str) -> str:
    try:
        current = procfs.environ(pid).get("PYTEST_CURRENT_TEST")
    except OSError:
        return "session"
    return current.split("::", 1)[0] if current is not None else "session"


def program(pid: str):
    """What ``pid`` runs, as :class:`CpuUse` names it by program (see the module docstring), else None."""
    try:
        args = procfs.command_line(pid)
    except OSError:
        return None
    if not args:
        return None  # a zombie, or a kernel thread
    first = (args[0].split() or [args[0]])[0]
    if first.startswith("ray::"):
        return first
    name = os.path.basename(first)
    if not name.startswith("python"):
        return name
    rest = args[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):  # the interpreter's own options
        rest = rest[2:] if rest[0] in ("-X", "-W") else rest[1:]
    if not rest:
        return "python"
    if rest[0] == "-m":
        return f"python -m {rest[1]}" if len(rest) > 1 else "python -m"
    return "python -c" if rest[0] == "-c" else f"python {os.path.basename(rest[0])}"


class CpuUse:
    """``with CpuUse() as use: run(...)``, then ``use.record()``."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.root = os.getpid()
        # By (pid, start time): a run starts more processes than this kernel has pids (32,768 here).
        self.where = {}  # process -> where it counts (None: not ours)
        self.base = {}  # process -> its ticks when the run began (processes alive then)
        self.ticks = {}  # process -> its last sampled ticks
        self.program = {}  # a stack's process -> what it runs, as last sampled
        self.netns = {}  # namespace inode -> name, as of _netns_mtime
        self._netns_mtime = None
        self.errors = []  # what broke a sample: a record with errors undercounts
        self._stop = threading.Event()

    def __enter__(self):
        self.started, self.before = time.monotonic(), machine_ticks()
        self.base = {(pid, start): ticks for pid, (_, start, ticks) in self._live().items()}
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample_or_note()
        self.wall, self.after = time.monotonic() - self.started, machine_ticks()

    def _loop(self):
        while not self._stop.wait(self.interval):
            self._sample_or_note()

    def _sample_or_note(self):
        try:
            self.sample()
        except Exception as exc:  # a sampler that dies silently would report a run as cheaper than it was
            self.errors.append(repr(exc))

    def _live(self) -> dict:
        live = {}
        for pid in procfs.pids():
            if pid != self.root:
                stat = _stat(pid)
                if stat:
                    live[str(pid)] = stat
        return live

    def _namespace(self, pid: str):
        """The ``nnsr-*`` namespace ``pid`` lives in, else None."""
        try:
            inode = procfs.net_namespace(pid)
            mtime = NETNS_DIR.stat().st_mtime_ns
        except OSError:
            return None
        if mtime != self._netns_mtime:  # a stack came up or went down: read the names again
            self._netns_mtime, self.netns = mtime, {}
            for path in NETNS_DIR.glob(NETNS_PREFIX + "*"):
                try:
                    self.netns[path.stat().st_ino] = path.name
                except OSError:
                    continue
        return self.netns.get(inode)

    def _first_sight(self, pid: str, parents: dict):
        """Where a process newly seen counts: by its namespace, else by its ancestry, else None."""
        namespace = self._namespace(pid)
        if namespace:
            return f"stack {namespace}"
        ancestor, seen, lane = int(pid), set(), False
        while ancestor > 1 and ancestor not in seen:
            if ancestor == self.root:
                return "lane" if lane else _test_module(pid)
            seen.add(ancestor)
            lane = lane or _runs_the_lane(ancestor)
            ancestor = parents.get(ancestor, 0)
        return None

    def sample(self):
        live = self._live()
        parents = {int(pid): ppid for pid, (ppid, *_) in live.items()}
        for pid, (_, start, ticks) in live.items():
            process = (pid, start)
            if process not in self.where:
                self.where[process] = self._first_sight(pid, parents)
            elif not str(self.where[process]).startswith("stack "):
                # `ip netns exec` enters the namespace after the process starts; look again.
                namespace = self._namespace(pid)
                if namespace:
                    self.where[process] = f"stack {namespace}"
            if self.where[process] is not None:
                self.ticks[process] = ticks
            if str(self.where[process]).startswith("stack "):
                name = program(pid)
                if name and not (name == "ray::IDLE" and process in self.program):
                    self.program[process] = name

    def record(self) -> dict:
        """Core-seconds by where (largest first), the machine's, and what sampling could not attribute."""
        by_where, processes = defaultdict(int), defaultdict(int)
        by_program = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # where -> program -> [ticks, processes]
        for process, ticks in self.ticks.items():
            spent = ticks - self.base.get(process, 0)
            by_where[self.where[process]] += spent
            processes[self.where[process]] += 1
            if process in self.program:
                place = by_program[self.where[process]][self.program[process]]
                place[0] += spent
                place[1] += 1
        machine = {k: round((self.after[k] - self.before[k]) / TICK, 1) for k in self.after}
        attributed = sum(by_where.values()) / TICK
        cores = os.cpu_count()
        return {"wall_s": round(self.wall, 1), "cores": cores, "capacity_core_s": round(self.wall * cores, 1),
                "machine_core_s": machine, "attributed_core_s": round(attributed, 1),
                "unattributed_core_s": round(machine["busy"] - attributed, 1),
                "by_where": {where: {"core_s": round(ticks / TICK, 1), "processes": processes[where],
                                     **({"by_program": {name: {"core_s": round(t / TICK, 1), "processes": n}
                                                        for name, (t, n) in sorted(by_program[where].items(),
                                                                                   key=lambda kv: -kv[1][0])}}
                                        if where in by_program else {})}
                             for where, ticks in sorted(by_where.items(), key=lambda kv: -kv[1])},
                "interval_s": self.interval, "sample_errors": self.errors}
