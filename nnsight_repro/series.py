"""Our patch series for upstream projects (nnsight; multimolecule): list one, check its base, apply it.

A series lives in ``patches/<name>/``: ``git format-patch`` files and a
``series`` file that lists them in order, headed by the base they were cut
from (``# base: <repo> <tag> <commit>``). The base is checked two ways:

- in a git checkout, ``HEAD`` must be the base commit;
- in any tree (an sdist has no git), every file the series modifies must hash
  to the blob the patches name as their pre-image (``index <old>..<new>``).

Stdlib only, plus the ``git`` command.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from . import ROOT, settings

#: ``NNSIGHT_REPRO_PATCHES`` points elsewhere, e.g. at an emptied series to
#: show that the negative control then fails.
PATCHES = Path(settings.setting("PATCHES") or ROOT / "patches").resolve()


class SeriesError(Exception):
    """The series cannot be used on this tree; the message says why and what to do."""


@dataclass(frozen=True)
class Base:
    repo: str
    tag: str
    commit: str

    def describe(self) -> str:
        return f"{self.repo} {self.tag} ({self.commit})"


def directory(name: str) -> Path:
    path = PATCHES / name
    if not (path / "series").is_file():
        known = sorted(p.name for p in PATCHES.iterdir() if (p / "series").is_file()) if PATCHES.is_dir() else []
        raise SeriesError(f"No patch series {name!r} (expected {path}/series); known series: {', '.join(known) or 'none'}.")
    return path


def base(name: str) -> Base:
    for line in (directory(name) / "series").read_text().splitlines():
        match = re.match(r"#\s*base:\s*(\S+)\s+(\S+)\s+([0-9a-f]{40})\s*$", line)
        if match:
            return Base(*match.groups())
    raise SeriesError(f"patches/{name}/series has no '# base: <repo> <tag> <40-hex commit>' line.")


def patches(name: str) -> List[Path]:
    folder = directory(name)
    listed = [line.strip() for line in (folder / "series").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    missing = [p for p in listed if not (folder / p).is_file()]
    if missing:
        raise SeriesError(f"patches/{name}/series lists files that do not exist: {', '.join(missing)}.")
    return [folder / p for p in listed]


def digest(name: str) -> str:
    """Changes whenever the series file or any patch changes."""
    h = hashlib.sha256()
    for path in [directory(name) / "series", *patches(name)]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def touched(name: str) -> List[str]:
    """Every path the series changes, adds or deletes, once each, in the order the patches first touch them."""
    found: Dict[str, None] = {}
    for patch in patches(name):
        for line in patch.read_text().splitlines():
            header = re.match(r"diff --git a/(\S+) b/(\S+)$", line)
            if header:
                found.setdefault(header.group(1))  # a rename's old path too: it is gone afterwards
                found.setdefault(header.group(2))
    return list(found)


def preimages(name: str) -> Dict[str, str]:
    """Path -> abbreviated blob id each modified file must have at the base."""
    wanted: Dict[str, str] = {}
    touched = set()
    for patch in patches(name):
        current = None
        for line in patch.read_text().splitlines():
            header = re.match(r"diff --git a/(\S+) b/(\S+)$", line)
            if header:
                current = header.group(1)
                continue
            index = re.match(r"index ([0-9a-f]+)\.\.[0-9a-f]+", line)
            if index and current and current not in touched:
                if set(index.group(1)) != {"0"}:  # all zeros: the file is new
                    wanted[current] = index.group(1)
                touched.add(current)
    return wanted


def git_blob(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _under(rel: str, only: str | None) -> bool:
    return only is None or rel.startswith(only.rstrip("/") + "/")


def check_tree(name: str, tree: Path, only: str | None = None) -> None:
    """Raise SeriesError unless ``tree`` holds the series' base versions of every file it modifies
    (with ``only``, a folder: of every file it modifies under that folder, and there must be one)."""
    tree = Path(tree)
    b = base(name)
    wanted = {rel: blob for rel, blob in preimages(name).items() if _under(rel, only)}
    if only and not wanted:
        raise SeriesError(f"patches/{name} modifies no existing file under {only}/, so a tree cannot be checked "
                          f"against {b.describe()} there.")
    for rel, blob in wanted.items():
        path = tree / rel
        actual = git_blob(path) if path.is_file() else None
        if actual is None or not actual.startswith(blob):
            found = "is missing" if actual is None else f"is blob {actual[:10]}, not {blob}"
            raise SeriesError(
                f"patches/{name} applies to {b.describe()}, but {tree} is not that base: {rel} {found}. "
                f"Point it at a checkout of {b.tag} or at the released files patches/{name}/series names."
            )


def _git(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)


def apply(name: str, tree: Path, only: str | None = None) -> None:
    """Apply the series to a plain source tree (e.g. an extracted sdist), after checking its base.

    ``only`` (a folder of the repository, e.g. ``multimolecule``) applies and checks just the changes under
    it, for a tree that holds only that part: an installed package whose repository keeps it at the top
    level is laid out as the repository there, but its wheel has no ``tests/``.
    """
    tree = Path(tree).resolve()
    check_tree(name, tree, only)
    # Keep git from discovering a repository that happens to contain the tree.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}
    include = [f"--include={only.rstrip('/')}/*"] if only else []
    for patch in patches(name):
        result = _git("apply", "--whitespace=nowarn", *include, str(patch), cwd=tree, env=env)
        if result.returncode:
            raise SeriesError(f"{patch.name} does not apply to {tree}:\n{result.stderr.strip()}")


def check_repo(name: str, repo: Path) -> str:
    """``git am`` the series onto the base in a scratch clone of ``repo``; return the resulting commit."""
    repo = Path(repo).resolve()
    b = base(name)
    head = _git("rev-parse", "HEAD", cwd=repo)
    if head.returncode:
        raise SeriesError(f"{repo} is not a git checkout ({head.stderr.strip()}). Clone {b.repo} and check out {b.tag}.")
    if head.stdout.strip() != b.commit:
        raise SeriesError(
            f"patches/{name} applies to {b.describe()}, but {repo} is at {head.stdout.strip()}. "
            f"Run `git -C {repo} checkout {b.tag}` (or pass a checkout of {b.commit})."
        )
    scratch = Path(tempfile.mkdtemp(prefix="series-check-"))
    try:
        clone = scratch / "repo"
        for args, cwd in [
            (("clone", "--quiet", "--shared", "--no-checkout", str(repo), str(clone)), scratch),
            (("checkout", "--quiet", "--detach", b.commit), clone),
            (("-c", "user.name=series-check", "-c", "user.email=series-check@localhost",
              "am", "--quiet", *map(str, patches(name))), clone),
        ]:
            result = _git(*args, cwd=cwd)
            if result.returncode:
                raise SeriesError(f"`git {' '.join(args[:2])} ...` failed on {b.describe()}:\n"
                                  f"{(result.stderr or result.stdout).strip()}")
        return _git("rev-parse", "HEAD", cwd=clone).stdout.strip()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def repo_from_tree(tree: Path, destination: Path) -> Path:
    """A one-commit git repository holding ``tree``'s files, for ``git am`` where no clone exists."""
    # Without the bytecode Python and pytest may have written into the tree: the base is its sources.
    shutil.copytree(tree, destination, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for args in [("init", "--quiet"), ("add", "--all", "--force"),
                 ("-c", "user.name=base", "-c", "user.email=base@localhost", "commit", "--quiet", "-m", "base")]:
        result = _git(*args, cwd=destination)
        if result.returncode:
            raise SeriesError(f"git {args[0]} failed in {destination}: {result.stderr.strip()}")
    return destination


def am_onto_tree(name: str, tree: Path) -> None:
    """Check the base by blob, then ``git am`` the whole series onto a repository made from ``tree``."""
    check_tree(name, tree)
    scratch = Path(tempfile.mkdtemp(prefix="series-am-"))
    try:
        repo = repo_from_tree(tree, scratch / "repo")
        result = _git("-c", "user.name=series-check", "-c", "user.email=series-check@localhost",
                      "am", "--quiet", *map(str, patches(name)), cwd=repo)
        if result.returncode:
            raise SeriesError(f"git am of patches/{name} failed:\n{(result.stderr or result.stdout).strip()}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
