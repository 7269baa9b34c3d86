"""What the project reads from Linux's ``/proc``: a process's state, parent, command line, environment, memory
and network namespace, the machine's CPU ticks, memory and CPU model, and this process's mounts and cgroups.

Owns: where each file is and how it is parsed (``/proc/PID/stat``'s command name may hold spaces and
parentheses; ``cmdline`` and ``environ`` are NUL-separated). A process that is gone raises ``OSError`` unless a
function says otherwise. Does not own what a caller makes of the numbers (a stack's memory:
:mod:`nnsight_repro.ndif.panel`; CPU time by where: ``benchmarks/cpu_use.py``; cgroups:
:mod:`nnsight_repro.ndif.memcg`).

Stdlib only, though ``psutil`` would do most of this: the README's first command runs this package with a bare
system ``python3`` on a fresh machine, before any environment (and so any third-party package) exists.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

PROC = Path("/proc")


def stat(pid) -> List[str]:
    """The fields of ``/proc/PID/stat`` after the command name, state first: ``[state, ppid, ...]``, so
    ``utime`` and ``stime`` are at 11 and 12, ``starttime`` at 19 (proc(5)'s numbers less 3)."""
    # "pid (comm) state ppid ...": comm may hold spaces and ")", so the split is after its last ")".
    return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def exited(pid) -> bool:
    """Gone, or a zombie: it has exited and only waits for its parent to reap it."""
    try:
        return stat(pid)[0] == "Z"
    except (OSError, IndexError):
        return True  # gone already


def parent(pid) -> Optional[int]:
    """The parent's pid, or None once ``pid`` is gone."""
    try:
        return int(stat(pid)[1])
    except (OSError, IndexError, ValueError):
        return None


def command_line(pid) -> List[str]:
    """Its arguments as ``/proc/PID/cmdline`` has them (a Ray worker rewrites its first into a title such as
    ``ray::CPUModelActor``); empty for a zombie or a kernel thread."""
    return [arg.decode(errors="replace") for arg in (PROC / str(pid) / "cmdline").read_bytes().split(b"\0") if arg]


def environ(pid) -> Dict[str, str]:
    """Its environment as it started (``/proc/PID/environ``; a later change inside the process is not seen)."""
    found = {}
    for entry in (PROC / str(pid) / "environ").read_bytes().split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            found.setdefault(name.decode(errors="replace"), value.decode(errors="replace"))
    return found


def rss_kib(pid) -> int:
    """Its resident memory in KiB (``VmRSS`` of ``/proc/PID/status``; 0 for a kernel thread, which has none)."""
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def net_namespace(pid) -> int:
    """The inode of its network namespace: the same number as ``/run/netns/<name>``'s for a process in it."""
    return os.stat(PROC / str(pid) / "ns" / "net").st_ino


def pids() -> List[int]:
    """Every process's pid, as listed at the moment (any of them may be gone by the time it is read)."""
    return [int(entry.name) for entry in os.scandir(PROC) if entry.name.isdigit()]


def meminfo() -> Dict[str, int]:
    """``/proc/meminfo`` in KiB by name (``MemTotal``, ``MemAvailable``, ...)."""
    found = {}
    for line in (PROC / "meminfo").read_text().splitlines():
        name, _, value = line.partition(":")
        if value.split():
            found[name] = int(value.split()[0])
    return found


def cpu_ticks() -> List[int]:
    """The machine's cumulative ticks of all cores (``/proc/stat``'s first line): user, nice, system, idle,
    iowait, irq, softirq, steal, ..."""
    return [int(n) for n in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]


def cpu_model() -> Optional[str]:
    """The first CPU's model name, or None where ``/proc/cpuinfo`` has none (or cannot be read)."""
    try:
        for line in (PROC / "cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def own_mounts() -> List[str]:
    """This process's mount table, a line a mount (``/proc/self/mountinfo``)."""
    return (PROC / "self" / "mountinfo").read_text().splitlines()


def own_cgroups() -> List[str]:
    """This process's cgroups, a line a hierarchy (``/proc/self/cgroup``)."""
    return (PROC / "self" / "cgroup").read_text().splitlines()
