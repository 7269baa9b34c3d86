"""A memory cgroup per local NDIF stack: where its memory is counted, optionally capped, and where running out
of it shows.

Why: a model actor the kernel kills for want of memory leaves no trace a client or ``ndif deploy`` can read —
Ray reports "worker died ... unexpected system error", a deploy only times out, a trace gets "Error starting
model". The kernel counts every OOM kill against the victim's memory cgroup (``oom_kill``; a whole-machine
OOM kill as well as one at the cgroup's own limit), so with the stack's processes in a cgroup of their own,
"the stack ran out of memory" is a number to read, not a guess.

What it does: :func:`create` makes the cgroup as a child of the one the calling process is in (the stack stays
accounted where it was started), optionally with a limit; :func:`command` wraps an argv so that the process
joins it before it execs (so nothing it forks escapes); :func:`counters` reads OOM kills, usage, peak and
limit; :func:`remove` deletes it once its processes are gone. cgroup v1 (the ``memory`` hierarchy: this
machine's) and v2 where the calling process's cgroup delegates ``memory`` (in practice the root: a non-root v2
cgroup with processes in it cannot).

What it does not do: kill anything (the stack's network namespace is what ``down`` empties, and every
process of the cgroup is in it), or say which process the kernel chose (only the kernel log does).

Stdlib only; needs root, as the namespace does.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from .. import procfs

MIB = 1024 * 1024

#: v1 reports "no limit" as the largest page-aligned signed 64-bit number, v2 as "max".
_UNLIMITED_V1 = 1 << 62


class MemcgError(Exception):
    """The cgroup cannot be created, capped or removed; the message says why."""


#: The same facts under each version's names: (v1, v2). Anonymous memory (memory.stat) is what the processes
#: themselves hold, unlike the reclaimable page cache that usage also counts.
_NAMES = {
    "limit": ("memory.limit_in_bytes", "memory.max"),
    "usage": ("memory.usage_in_bytes", "memory.current"),
    "peak": ("memory.max_usage_in_bytes", "memory.peak"),
    "oom_kill": ("memory.oom_control", "memory.events"),
    "anon": ("rss", "anon"),
}


@dataclass(frozen=True)
class Cgroup:
    path: Path
    version: int

    def name(self, fact: str) -> str:
        return _NAMES[fact][self.version - 1]

    def file(self, fact: str) -> Path:
        return self.path / self.name(fact)

    def limit_hits(self) -> int:
        """How often usage reached the limit (v1 ``memory.failcnt``, v2 ``memory.events``' ``max``)."""
        if self.version == 1:
            text = _read(self.path / "memory.failcnt").strip()
            return int(text) if text.isdigit() else 0
        return int(_keyed(self.path / "memory.events").get("max", "0"))


def _mounts() -> Dict[str, Path]:
    """``{"v1": <memory hierarchy mount>, "v2": <unified mount>}`` for what is mounted."""
    found: Dict[str, Path] = {}
    for line in procfs.own_mounts():
        # "<id> <parent> <dev> <root> <mount point> <options> ... - <type> <source> <super options>"
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if not kind:
            continue
        if kind[0] == "cgroup" and "memory" in kind[-1].split(","):
            found.setdefault("v1", Path(fields[4]))
        elif kind[0] == "cgroup2":
            found.setdefault("v2", Path(fields[4]))
    return found


def _own_cgroup() -> Cgroup:
    """The memory cgroup this process is in."""
    mounts = _mounts()
    relative = {}
    for line in procfs.own_cgroups():
        number, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            relative["v1"] = path
        elif number == "0" and controllers == "":
            relative["v2"] = path
    if "v1" in mounts and "v1" in relative:
        return Cgroup(mounts["v1"] / relative["v1"].lstrip("/"), 1)
    if "v2" in mounts and "v2" in relative:
        parent = mounts["v2"] / relative["v2"].lstrip("/")
        if "memory" not in _read(parent / "cgroup.subtree_control").split():
            raise MemcgError(f"the cgroup v2 group {parent} does not delegate the memory controller to its "
                             f"children (cgroup.subtree_control)")
        return Cgroup(parent, 2)
    raise MemcgError("no memory cgroup controller is mounted (neither a v1 `memory` hierarchy nor cgroup v2)")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _keyed(path: Path) -> Dict[str, str]:
    """A flat-keyed cgroup file ("<key> <value>" per line) as a dict."""
    return {key: value.strip() for key, _, value in
            (line.partition(" ") for line in _read(path).splitlines()) if value.strip()}


def create(name: str, limit_mib: Optional[int] = None) -> Cgroup:
    """A fresh, empty memory cgroup ``name`` beside this process's own, capped at ``limit_mib`` if given.

    A leftover of that name (a stack that died without ``down``) is removed first; one that still has
    processes is refused.
    """
    if os.geteuid() != 0:
        raise MemcgError("creating a memory cgroup needs root")
    parent = _own_cgroup()
    group = Cgroup(parent.path / name, parent.version)
    if group.path.exists():
        remove(group)
    try:
        group.path.mkdir()
    except OSError as exc:
        raise MemcgError(f"cannot create the memory cgroup {group.path}: {exc.strerror}") from None
    if limit_mib is not None:
        try:
            set_limit(group, limit_mib)
        except MemcgError:
            remove(group)
            raise
    return group


def set_limit(group: Cgroup, limit_mib: int) -> None:
    """Cap the cgroup at ``limit_mib`` (memory, not swap: this machine has none). Below the current usage the
    kernel reclaims first; what it cannot reclaim, v1 refuses (EBUSY) and v2 OOM-kills."""
    try:
        group.file("limit").write_text(str(limit_mib * MIB))
    except OSError as exc:
        raise MemcgError(f"cannot set the memory limit of {group.path} to {limit_mib} MiB: {exc.strerror}") from None


def find(name: str) -> Optional[Cgroup]:
    """The cgroup :func:`create` makes for ``name`` from this process, if it exists."""
    try:
        parent = _own_cgroup()
    except MemcgError:
        return None
    group = Cgroup(parent.path / name, parent.version)
    return group if group.path.is_dir() else None


def command(group: Cgroup, argv: List[str]) -> List[str]:
    """``argv`` run as a member of ``group``: a shell writes its own pid into the cgroup, then execs ``argv``
    (same pid), so the program and everything it forks are in it from their first instruction."""
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group.path), *argv]


def counters(group: Cgroup) -> dict:
    """OOM kills counted against the cgroup, its usage (page cache included), its processes' own anonymous
    memory, peak usage and limit (MiB; limit None when uncapped; peak None where the kernel keeps none), how
    often usage hit the limit, and how many evicted pages its processes read back in."""
    events, stat = _keyed(group.file("oom_kill")), _keyed(group.path / "memory.stat")

    def mib(path: Path) -> Optional[int]:
        text = _read(path).strip()
        if not text or text == "max" or (text.isdigit() and int(text) >= _UNLIMITED_V1):
            return None
        return int(text) // MIB if text.isdigit() else None

    return {"oom_kills": int(events.get("oom_kill", "0")), "usage_mib": mib(group.file("usage")),
            "anon_mib": int(stat.get(group.name("anon"), "0")) // MIB, "limit_hits": group.limit_hits(),
            # Pages read back in after the cgroup evicted them (older kernels: one workingset_refault).
            "refaults": sum(int(v) for k, v in stat.items() if k.startswith("workingset_refault") and v.isdigit()),
            "peak_mib": mib(group.file("peak")), "limit_mib": mib(group.file("limit")), "cgroup": str(group.path)}


def members(group: Cgroup) -> List[int]:
    return [int(pid) for pid in _read(group.path / "cgroup.procs").split()]


def remove(group: Cgroup, wait: float = 10.0) -> None:
    """Delete the cgroup; it must be (or become within ``wait`` seconds: exiting processes leave it
    asynchronously) empty. Idempotent."""
    deadline = time.monotonic() + wait
    while True:
        try:
            group.path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise MemcgError(f"cannot remove the memory cgroup {group.path}: {exc.strerror} "
                                 f"(processes still in it: {members(group) or 'none listed'})") from None
            time.sleep(0.2)
