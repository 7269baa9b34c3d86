"""Three file-system idioms the project relies on, written once: an exclusive lock across processes, and a
text file or a folder that appears whole or not at all.

Stdlib only. Not here: the stack's non-blocking lock (``ndif.stack_state``), which refuses a second ``up``
instead of waiting, and ``bytecode.py``'s links, which run as a script in a venv before the project is
importable there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def locked(path: Path):
    """Holds an exclusive lock on ``path`` (created if missing), waiting for any other holder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_text(path: Path, text: str) -> None:
    """``text`` into ``path`` through a staging file in the same folder, renamed into place: a reader
    sees the old file or the new one, never half of one (also when two writers race)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staging.write_text(text)
    os.replace(staging, path)


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
