"""The file-system idioms the project relies on, written once: an exclusive lock across processes, and a
file or a folder that appears whole or not at all.

Owns: how a lock is taken (waiting, refused at once, or polled for a while, with the holder's pid written
into the lock file when asked) and how a finished file or folder is renamed into place. Does not own what
a caller says to a user about a busy lock, nor which paths are locked.

Stdlib only, though ``filelock`` would do the lock: the README's first command runs this package with a bare
system ``python3`` on a fresh machine, before any environment (and so any third-party package) exists.
``bytecode.py`` keeps its own link-then-rename: it runs as a script in a venv where this package is not
importable.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Union

#: How often a lock taken with a time limit is tried again.
POLL_S = 0.5


class Busy(Exception):
    """The lock at ``path`` is held by another process; ``holder`` is what that holder wrote into the lock
    file (its pid, with ``locked(..., holder=True)``; else an empty string)."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is locked by {('pid ' + holder) if holder else 'another process'}")
        self.path, self.holder = path, holder


@contextlib.contextmanager
def locked(path: Path, wait: Union[bool, float] = True, *, holder: bool = False,
           waiting: Optional[Callable[[str], None]] = None):
    """Holds an exclusive lock on ``path`` (created if missing) while the block runs.

    ``wait``: True waits for any other holder; False raises :class:`Busy` at once; a number of seconds tries
    every :data:`POLL_S`, calling ``waiting(holder)`` after each refusal (it may raise to stop waiting), and
    raises :class:`Busy` after that long. :class:`Busy` comes only from taking the lock, never from the block.
    ``holder``: write this process's pid into the lock file while it holds it, for a waiter to name.
    The lock is the kernel's, so a holder that dies, however it dies, frees it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        _take(fd, path, wait, waiting)
        if holder:
            mine = str(os.getpid()).encode()
            os.pwrite(fd, mine, 0)
            os.ftruncate(fd, len(mine))  # after the write: a killed holder's longer pid leaves no digits behind
        try:
            yield
        finally:
            if holder:
                os.ftruncate(fd, 0)  # before the unlock: a waiter never takes a pid that no longer holds it
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _take(fd: int, path: Path, wait: Union[bool, float], waiting: Optional[Callable[[str], None]]) -> None:
    if wait is True:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    started = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            # Until the holder writes its pid a waiter reads an empty file (or a killed holder's): it reads again.
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if wait is False:
            raise Busy(path, holder)
        if waiting is not None:
            waiting(holder)
        if time.monotonic() - started > wait:
            raise Busy(path, holder)
        time.sleep(POLL_S)


def is_locked(path: Path) -> bool:
    """Whether another process holds the lock on ``path`` right now (a missing lock file is free)."""
    if not path.exists():
        return False
    try:
        with locked(path, wait=False):
            return False
    except Busy:
        return True


@contextlib.contextmanager
def staged_file(path: Path):
    """Yields a staging path beside ``path`` (same suffix, so a writer that goes by it still can), renamed over
    ``path`` when the block ends without an error, removed otherwise: a reader sees the old file or the new
    one, never half of one (also when two writers race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield staging
        os.replace(staging, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)


def write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` through :func:`staged_file`."""
    with staged_file(path) as staging:
        staging.write_text(text)


@contextlib.contextmanager
def staged_directory(target: Path):
    """Yields an empty staging folder beside ``target``, renamed to ``target`` when the block ends without an
    error, removed otherwise: a reader sees no ``target`` or a whole one. ``target`` must not exist; hold a
    :func:`locked` lock around the check and the block where two builders may race."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield staging
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
