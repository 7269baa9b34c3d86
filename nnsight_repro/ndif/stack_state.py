"""A stack's folder as shared state: its state file, the lock that serializes ``up`` and ``down``, and the lease.

Owns who may use a stack folder when. :func:`read_state` / :func:`write_state`: what the running stack
recorded about itself (services, models, timings, its memory cgroup). :func:`exclusive`: one ``up`` or
``down`` at a time per folder, refused at once. :func:`lease`: a process that uses a stack for longer than one
call (a test session, a lane job, a panel batch, the probe script's local stacks) holds it meanwhile, so a
second such process on the same cache waits for the first instead of bringing down or replacing a stack
the first still reads. ``up``, ``down`` and ``status`` themselves take no lease: a stack a developer started
with ``ndif up`` stays theirs to stop.

Does not own what the state says (:mod:`.stack` writes it) or what runs in the stack, nor how a lock is
taken (:func:`nnsight_repro.fsutil.locked`: the kernel's, so a holder that dies, however it dies, frees it).

Stdlib only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Callable, Optional

from .. import fsutil, procfs
from . import config as configuration
from . import errors
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
    """One ``up`` or ``down`` at a time per stack folder, across processes: a second is refused at once."""
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(fsutil.locked(cfg.folder / ".lock", wait=False))
        except fsutil.Busy:
            raise StackError(f"Another `up` or `down` of the stack in {cfg.folder} is in progress; "
                             f"wait for it, or see `nnsight-repro ndif status`.") from None
        yield


#: How long :func:`lease` waits for another process using the same stack folder before it gives up: a test
#: session holds the plain 0.8 stack's for all of its 15 minutes or so.
LEASE_WAIT_S = 1800.0


def _ancestry() -> set:
    """This process's pid and its ancestors'."""
    found, pid = set(), os.getpid()
    while pid and pid not in found:  # up to pid 1, which may be the holder (a container's pytest); its parent is 0
        found.add(pid)
        pid = procfs.parent(pid)
    return found


def _holder(pid: str) -> str:
    """``pid N (its command line)``, as a lease's messages name its holder."""
    if not pid.isdigit():
        return "a process that has not written its pid yet"
    try:
        return f"pid {pid} ({' '.join(procfs.command_line(int(pid)))[:120]})"
    except OSError:
        return f"pid {pid} (gone)"


class _Covered(Exception):
    """The lease's holder is this process or one of its ancestors, whose lease covers this one."""


@contextlib.contextmanager
def lease(cfg: configuration.StackConfig, say: Callable[[str], None] = errors.say, wait_s: float = LEASE_WAIT_S):
    """This process's use of the stack folder of ``cfg`` while the block runs. Another process holding it is
    waited for (said once, with its pid and command line) up to ``wait_s`` seconds, then :class:`StackError`
    names it and the fix. A process the holder started, or the holder itself again, goes on at once: the
    holder's lease covers the probe script a lane job runs on its stack."""
    started, ancestry, said = time.monotonic(), _ancestry(), []

    def waiting(holder: str) -> None:
        if holder.isdigit() and int(holder) in ancestry:
            raise _Covered
        if holder.isdigit() and not said:
            said.append(holder)
            say(f"the {cfg.line} stack's folder {cfg.folder} is in use by {_holder(holder)}; waiting for it, "
                f"at most {wait_s:.0f} s")

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(fsutil.locked(cfg.folder / ".lease", wait=wait_s, holder=True, waiting=waiting))
        except _Covered:
            pass
        except fsutil.Busy as busy:
            raise StackError(
                f"The {cfg.line} stack's folder {cfg.folder} is still in use by {_holder(busy.holder)} after "
                f"{wait_s:.0f} s: another run on this cache uses that stack. Wait for it to finish, or give "
                f"this run a cache of its own (NNSIGHT_REPRO_CACHE=<a folder>).") from None
        else:
            if said:
                say(f"the {cfg.line} stack's folder is free after {time.monotonic() - started:.0f} s")
        yield
