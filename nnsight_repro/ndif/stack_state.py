"""A stack's folder as shared state: its state file, the lock that serializes ``up`` and ``down``, and the lease.

Owns who may use a stack folder when. :func:`read_state` / :func:`write_state`: what the running stack
recorded about itself (services, models, timings, its memory cgroup). :func:`exclusive`: one ``up`` or
``down`` at a time per folder, refused at once. :func:`lease`: a process that uses a stack for longer than one
call (a test session, a lane job, a panel batch, the probe script's local stacks) holds it meanwhile, so a
second such process on the same cache waits for the first instead of bringing down or replacing a stack
the first still reads. ``up``, ``down`` and ``status`` themselves take no lease: a stack a developer started
with ``ndif up`` stays theirs to stop.

Does not own what the state says (:mod:`.stack` writes it) or what runs in the stack. Both locks are the
kernel's (``flock``), so a holder that dies, however it dies, frees them.

Stdlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from typing import Callable, Optional

from .. import fsutil
from . import config as configuration
from . import errors, netns
from .errors import StackError


def read_state(cfg: configuration.StackConfig) -> Optional[dict]:
    try:
        return json.loads(cfg.state_file.read_text())
    except (OSError, ValueError):
        return None


def write_state(cfg: configuration.StackConfig, state: dict) -> None:
    fsutil.write_text(cfg.state_file, json.dumps(state, indent=1))


@contextlib.contextmanager
def exclusive(cfg: configuration.StackConfig):
    """One ``up`` or ``down`` at a time per stack folder, across processes."""
    cfg.folder.mkdir(parents=True, exist_ok=True)
    with open(cfg.folder / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackError(f"Another `up` or `down` of the stack in {cfg.folder} is in progress; "
                             f"wait for it, or see `nnsight-repro ndif status`.") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


#: How long :func:`lease` waits for another process using the same stack folder before it gives up: a test
#: session holds the plain 0.8 stack's for all of its 15 minutes or so.
LEASE_WAIT_S = 1800.0


def _ancestry() -> set:
    """This process's pid and its ancestors'."""
    found, pid = set(), os.getpid()
    while pid and pid not in found:  # up to pid 1, which may be the holder (a container's pytest); its parent is 0
        found.add(pid)
        pid = netns.parent(pid)
    return found


def _holder(pid: str) -> str:
    """``pid N (its command line)``, as a lease's messages name its holder."""
    if not pid.isdigit():
        return "a process that has not written its pid yet"
    try:
        return f"pid {pid} ({' '.join(netns.command_line(int(pid)))[:120]})"
    except OSError:
        return f"pid {pid} (gone)"


@contextlib.contextmanager
def lease(cfg: configuration.StackConfig, say: Callable[[str], None] = errors.say, wait_s: float = LEASE_WAIT_S):
    """This process's use of the stack folder of ``cfg`` while the block runs. Another process holding it is
    waited for (said once, with its pid and command line) up to ``wait_s`` seconds, then :class:`StackError`
    names it and the fix. A process the holder started, or the holder itself again, goes on at once: the
    holder's lease covers the probe script a lane job runs on its stack. The lock is the kernel's, so a
    holder that dies, however it dies, frees it."""
    cfg.folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(cfg.folder / ".lease", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        started, ancestry, said = time.monotonic(), _ancestry(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            if holder.isdigit() and int(holder) in ancestry:
                yield
                return
            if holder.isdigit() and not said:
                said = True
                say(f"the {cfg.line} stack's folder {cfg.folder} is in use by {_holder(holder)}; waiting for it, "
                    f"at most {wait_s:.0f} s")
            if time.monotonic() - started > wait_s:
                raise StackError(
                    f"The {cfg.line} stack's folder {cfg.folder} is still in use by {_holder(holder)} after "
                    f"{wait_s:.0f} s: another run on this cache uses that stack. Wait for it to finish, or give "
                    f"this run a cache of its own (NNSIGHT_REPRO_CACHE=<a folder>).")
            time.sleep(0.5)
        # Until this write a waiter reads an empty file (or a killed holder's pid): it reads again.
        mine = str(os.getpid()).encode()
        os.pwrite(fd, mine, 0)
        os.ftruncate(fd, len(mine))  # after the write: a killed holder's longer pid leaves no digits behind
        if said:
            say(f"the {cfg.line} stack's folder is free after {time.monotonic() - started:.0f} s")
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # before the unlock: a reader never takes a pid that no longer holds it
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)

