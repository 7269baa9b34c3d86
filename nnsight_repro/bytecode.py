"""Byte-compiles a venv's site-packages, sharing each ``.pyc`` between every venv that has the same source file.

Run by the venv's own interpreter at the end of a build: ``python bytecode.py <site-packages> <store>``.

Why: the environments run with ``PYTHONDONTWRITEBYTECODE``, so a venv without ``.pyc`` files compiles
torch and transformers from source in every process (measured: ``import torch, transformers, nnsight``
24-29 s instead of 12-14 s on the loaded 2-core machine). Compiling all of a venv's 15,000 files costs
about 58 CPU-seconds, more than the rest of its build, and main, patched and both NDIF servers hold
mostly the same files.

uv installs every file as a hard link into its cache, so the same release of a package is the same
inode in every venv. A compiled file is kept in ``<store>`` under that inode (with the source's mtime
and size, which the ``.pyc`` header records and Python checks on import) and hard-linked into each
venv's ``__pycache__``; only files no venv has compiled yet are compiled. A source that was copied
rather than linked has its own inode and is simply compiled. The stored code is not tied to a path:
the import system rewrites a code object's file name to the source it was loaded for.

Stdlib only; prints one summary line.
"""

import importlib.util
import os
import py_compile
import sys
from concurrent.futures import ProcessPoolExecutor


def key(stat) -> str:
    return f"{stat.st_dev}-{stat.st_ino}-{stat.st_mtime_ns}-{stat.st_size}.pyc"


def publish(source: str, target: str, store: str, name: str) -> bool:
    """Puts ``target`` (compiled from ``source``) into the store; False if it could not be compiled."""
    try:
        py_compile.compile(source, cfile=target, doraise=True)
    except (py_compile.PyCompileError, SyntaxError, ValueError, OSError):
        return False  # what compileall skips too (test data, Python 2 files)
    staging = os.path.join(store, f".{name}.{os.getpid()}")
    try:
        os.link(target, staging)
        os.replace(staging, os.path.join(store, name))
    except OSError:
        pass  # the store is an optimisation; a venv with its own .pyc is complete
    return True


def link_into(stored: str, target: str) -> bool:
    staging = f"{target}.{os.getpid()}.tmp"
    try:
        os.link(stored, staging)
        os.replace(staging, target)
        return True
    except OSError:
        return False


def _publish(args):
    return publish(*args)


def main(site_packages: str, store: str) -> int:
    os.makedirs(store, exist_ok=True)
    linked, todo = 0, []
    for folder, dirs, files in os.walk(site_packages):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for filename in files:
            if not filename.endswith(".py"):
                continue
            source = os.path.join(folder, filename)
            target = importlib.util.cache_from_source(source)
            name = key(os.stat(source))
            stored = os.path.join(store, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.exists(stored) and link_into(stored, target):
                linked += 1
            else:
                todo.append((source, target, store, name))
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        compiled = sum(pool.map(_publish, todo, chunksize=64))
    print(f"{linked} linked from the store, {compiled} compiled, {len(todo) - compiled} not compilable")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
