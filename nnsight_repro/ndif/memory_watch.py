"""Whether a stack ran out of memory: its cgroup found from its state, and the watch every wait of ``up`` runs.

Every service runs in the stack's memory cgroup (:mod:`memcg`; capped by ``--memory-limit``, uncapped by
default), and every wait of ``up`` and of a deploy watches it (:class:`MemoryWatch`): when the kernel kills
a process of the stack for want of memory, or the stack thrashes at its limit, the wait ends at once with
:class:`~.errors.OutOfMemory`, which says so, instead of timing out on a model actor that is gone or stuck.

Owns that judgement and its message. Does not own the cgroup itself (:mod:`memcg`: making, counting,
removing) nor the waits that call the watch (:mod:`.services`, :mod:`.stack`).

Stdlib only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from . import config as configuration
from . import memcg
from .errors import OutOfMemory
from .stack_state import read_state


def memory_group(cfg: configuration.StackConfig) -> Optional[memcg.Cgroup]:
    """The running stack's memory cgroup (from its state), or None when it runs without one."""
    info = (read_state(cfg) or {}).get("memory") or {}
    return memcg.Cgroup(Path(info["cgroup"]), info["version"]) if info.get("cgroup") else None


def out_of_memory_message(counters: dict, what: str, how: str) -> str:
    """What to tell a user whose stack ran out of memory ``what`` (while ...), ``how`` (what the kernel did)."""
    peak = f", its peak {counters['peak_mib']} MiB" if counters.get("peak_mib") is not None else ""
    if counters.get("limit_mib") is not None:
        cap = f"its memory limit is {counters['limit_mib']} MiB{peak}"
        fix = "deploy fewer models at once, or give the stack a higher --memory-limit"
    else:
        cap = f"it has no memory limit of its own: the machine ran out{peak}"
        fix = "deploy fewer models at once, or stop what else uses the machine's memory"
    return (f"The stack ran out of memory {what}: {how} ({cap}; memory cgroup {counters.get('cgroup')}). To run "
            f"it: {fix} (`ndif up --models`, `ndif panel --batch`).")


class MemoryWatch:
    """A check for :func:`.services.wait`: raises :class:`OutOfMemory` as soon as the stack has run out of memory
    since the watch was made, instead of letting the wait time out on a model actor that is gone or stuck.

    Out of memory is either of what the kernel does at a memory cgroup's limit: it kills a process (counted
    in ``oom_kill``; :meth:`check_kills`), or, while evicted code and data pages can still be read back in,
    it keeps evicting them and nothing makes progress (thrashing). Thrashing was measured once, with a
    model actor loading under a limit of the services' own memory plus 300 MiB: no kill in 300 s, 180
    major faults a second, system memory pressure 97%, against some 450 major faults for a whole cold
    start. The watch calls it thrashing when, every time it looks for :attr:`THRASH_S` seconds, the limit
    was hit since the last look and at least :attr:`THRASH_REFAULTS_PER_S` pages a second were refaults
    (pages read back in after the cgroup evicted them: ``workingset_refault_*``, the part of the major
    faults that reading new files does not make).
    """

    THRASH_REFAULTS_PER_S = 50
    THRASH_S = 20.0

    def __init__(self, group: Optional[memcg.Cgroup], what: str, clock: Callable[[], float] = time.monotonic):
        self.group, self.what, self.clock = group, what, clock
        self.first = self.last = memcg.counters(group) if group else None
        self.last_time, self.thrashing_since = clock(), None

    def check_kills(self, now: Optional[dict] = None) -> None:
        """Raise :class:`~.errors.OutOfMemory` if the kernel has killed a process of the stack since the watch was made."""
        if self.group is None:
            return
        now = now or memcg.counters(self.group)
        kills = now["oom_kills"] - self.first["oom_kills"]
        if kills > 0:
            raise OutOfMemory(out_of_memory_message(
                now, self.what, f"the kernel killed {kills} of its processes for want of memory"))

    def __call__(self) -> None:
        if self.group is None:
            return
        now, at = memcg.counters(self.group), self.clock()
        self.check_kills(now)
        refaults = now["refaults"] - self.last["refaults"]
        if now["limit_hits"] > self.last["limit_hits"] and refaults >= self.THRASH_REFAULTS_PER_S * (at - self.last_time):
            # From this look on: one look over a long interval is not "every time it looks".
            self.thrashing_since = self.thrashing_since or at
            if at - self.thrashing_since >= self.THRASH_S:
                raise OutOfMemory(out_of_memory_message(
                    now, self.what, f"for {at - self.thrashing_since:.0f} s it was at its limit and reading evicted "
                                    f"pages back in ({now['refaults'] - self.first['refaults']} since the start of "
                                    f"the wait) instead of making progress"))
        else:
            self.thrashing_since = None
        self.last, self.last_time = now, at

