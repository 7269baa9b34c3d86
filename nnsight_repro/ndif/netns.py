"""A private network namespace with only loopback: where a local NDIF stack lives.

Why a namespace: ndif's Ray start script binds the dashboard to 0.0.0.0, ``gunicorn_conf`` binds
0.0.0.0, and Ray uses fixed ports. Inside a namespace whose only interface is ``lo``, "all interfaces"
*is* loopback, and the fixed ports cannot collide with another stack or with anything on the host.

Why killing by namespace: every process started inside inherits the namespace, including the ones Ray
daemonizes, so ``ip netns pids`` is exactly the set a stack started. ``ray stop`` / ``ndif stop`` would
instead kill every Ray process on the host by name.

Needs root (``ip netns add``). Stdlib only. What a process is (its state, parent, command line) is read by
:mod:`nnsight_repro.procfs`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import List, Sequence

from ..procfs import exited


class NetnsError(Exception):
    """The namespace cannot be created, entered or removed; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(["ip", *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise NetnsError("`ip` (iproute2) is not installed; a local NDIF stack needs it.") from None
    if check and result.returncode:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


def exists(name: str) -> bool:
    return os.path.exists(f"/var/run/netns/{name}") or name in names()


def names() -> List[str]:
    result = _ip("netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def create(name: str) -> None:
    """A new namespace with ``lo`` up and no other interface."""
    if os.geteuid() != 0:
        raise NetnsError("Creating a network namespace needs root (the local NDIF stack runs in one).")
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
    except NetnsError:
        _ip("netns", "del", name, check=False)
        raise


def command(name: str, argv: Sequence[str]) -> List[str]:
    """``argv`` run inside the namespace (``ip netns exec`` execs it: the PID is the program's)."""
    return ["ip", "netns", "exec", name, *argv]


def interfaces(name: str) -> List[str]:
    result = _ip("-n", name, "-o", "link", "show")
    return [line.split(":")[1].strip().split("@")[0] for line in result.stdout.splitlines() if ":" in line]


def pids(name: str) -> List[int]:
    """Every live process whose network namespace is ``name``.

    Zombies are left out: they have exited and only wait for their parent (possibly the process that
    ran ``up``) to reap them, so they are neither running nor killable.
    """
    if not exists(name):
        return []
    result = _ip("netns", "pids", name, check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit() and not exited(int(p))]


def kill_all(name: str, grace: float = 10.0) -> List[int]:
    """TERM every process in the namespace, KILL what is left after ``grace`` seconds; the PIDs signalled.

    Repeats until the namespace is empty, because a dying Ray parent may still spawn for a moment.
    """
    signalled: List[int] = []
    deadline = time.monotonic() + grace
    sig = signal.SIGTERM
    while True:
        alive = pids(name)
        if not alive:
            return signalled
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        for pid in alive:
            try:
                os.kill(pid, sig)
                if pid not in signalled:
                    signalled.append(pid)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL and time.monotonic() > deadline + 10:
            raise NetnsError(f"processes {alive} in namespace {name} survive SIGKILL")
        time.sleep(0.3)


def delete(name: str) -> None:
    if exists(name):
        _ip("netns", "del", name)
