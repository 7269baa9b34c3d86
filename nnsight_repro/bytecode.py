"""Shares the ``.pyc`` files of a venv's site-packages with every venv that has the same source file.

Run by the venv's own interpreter around a build's import check (:func:`nnsight_repro.envs.build.checked`):

    python bytecode.py link <site-packages> <store>      # before: every .pyc the store has, linked in
    python bytecode.py publish <site-packages> <store>   # after: every .pyc the check wrote, into the store

Why only what is imported: ``main`` holds 15,005 ``.py`` files, and its import check (torch, transformers,
nnsight) compiles 2,908 of them. Compiling all of them took 48 s of a 78 s build on the idle 2-core
machine, for files no process loads. A process that imports another module later has Python write its
``.pyc`` once, into its own venv (the environments do not set ``PYTHONDONTWRITEBYTECODE``).

uv installs every file as a hard link into its cache, so the same release of a package is the same inode
in every venv. A ``.pyc`` is kept in ``<store>`` under that inode, the source's mtime and size (which the
``.pyc`` header records and Python checks on import) and the interpreter's magic number, and hard-linked
into each venv's ``__pycache__``, so ``patched``, ``upstream-0.8`` and the NDIF servers compile only what
``main``'s check did not. A source with a single link (copied, or rewritten by ``git apply``) can be shared
with no other venv and is not stored. The stored code is not tied to a path: the import system rewrites a
code object's file name to the source it was loaded for. Python never writes a ``.pyc`` in place (it
writes a new file and renames it over the old one), so a venv cannot change a stored file.

Stdlib only; prints one summary line. It never compiles anything itself. Its link-then-rename
(:func:`replace_with_link`) is its own rather than :mod:`nnsight_repro.fsutil`'s: it runs as a script by the
venv's interpreter, where the project is not importable.
"""

import importlib.util
import os
import struct
import sys


MAGIC = importlib.util.MAGIC_NUMBER.hex()


def key(stat) -> str:
    return f"{stat.st_dev}-{stat.st_ino}-{stat.st_mtime_ns}-{stat.st_size}-{MAGIC}.pyc"


def sources(site_packages: str):
    """``(its stat, its .pyc path)`` for every ``.py`` under ``site_packages``."""
    for folder, dirs, files in os.walk(site_packages):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for filename in files:
            if filename.endswith(".py"):
                source = os.path.join(folder, filename)
                yield os.stat(source), importlib.util.cache_from_source(source)


def replace_with_link(existing: str, target: str) -> bool:
    staging = f"{target}.{os.getpid()}.tmp"
    try:
        os.link(existing, staging)
        os.replace(staging, target)
        return True
    except OSError:
        try:
            os.unlink(staging)
        except OSError:
            pass
        return False


def written_for(pyc: str, source_stat) -> bool:
    """Whether ``pyc`` is this interpreter's, compiled from a source of this mtime and size (its header),
    i.e. one Python loads rather than recompiles. Hash-based ``.pyc`` are never taken."""
    try:
        with open(pyc, "rb") as fh:
            header = fh.read(16)
    except OSError:
        return False
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags, mtime, size = struct.unpack("<III", header[4:16])
    return flags == 0 and mtime == int(source_stat.st_mtime) & 0xFFFFFFFF and size == source_stat.st_size & 0xFFFFFFFF


def link(site_packages: str, store: str) -> str:
    linked = 0
    for stat, pyc in sources(site_packages):
        stored = os.path.join(store, key(stat))
        if written_for(stored, stat):
            os.makedirs(os.path.dirname(pyc), exist_ok=True)
            linked += replace_with_link(stored, pyc)
    return f"{linked} .pyc linked from the store"


def publish(site_packages: str, store: str) -> str:
    published = 0
    for stat, pyc in sources(site_packages):
        stored = os.path.join(store, key(stat))
        if stat.st_nlink < 2 or written_for(stored, stat) or not written_for(pyc, stat):
            continue
        # Two builds side by side may both publish a file: either .pyc is valid for that source.
        published += replace_with_link(pyc, stored)
    return f"{published} .pyc published to the store"


def main(argv) -> int:
    if len(argv) != 3 or argv[0] not in ("link", "publish"):
        print("usage: bytecode.py link|publish <site-packages> <store>", file=sys.stderr)
        return 2
    action, site_packages, store = argv
    os.makedirs(store, exist_ok=True)
    print(link(site_packages, store) if action == "link" else publish(site_packages, store))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
