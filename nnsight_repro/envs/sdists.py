"""The released files the environments are built from: nnsight's sdists (and any file a package index lists),
downloaded once into the project cache, checked against a pinned sha256, and unpacked.

Owns: where a download is cached, which index it comes from (the first one pip is configured with that lists
it, through its simple API: one page, one file, nothing built) and what a missing or altered file tells the
user. Does not own which releases are pinned (:data:`nnsight_repro.envs.specs.SPECS`) or what is built from them
(:mod:`nnsight_repro.envs.build`).

Stdlib only: this runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import List

from .. import fsutil, uvtool
from ..settings import cache_dir
from .specs import EnvError, log


def sdist(version: str, sha256: str) -> Path:
    """The nnsight sdist, downloaded once into the cache and checked against its pinned hash."""
    return download("nnsight", f"nnsight-{version}.tar.gz", sha256)


def download(project: str, filename: str, sha256: str) -> Path:
    """``filename`` of ``project`` from the first package index pip is configured with that lists it, cached
    and hash-checked."""
    folder = cache_dir() / "sdists"
    path = folder / filename
    if not path.is_file():
        with fsutil.locked(folder / f".{filename}.lock"):
            if path.is_file():  # another build fetched it while this one waited
                return download(project, filename, sha256)
            log(f"downloading {filename}")
            with fsutil.staged_file(path) as fetched:
                problems = _fetch(project, filename, fetched)
                if not fetched.is_file():
                    raise EnvError(f"Could not get {filename} from the package index ({'; '.join(problems)}). "
                                        f"Fix: restore access to PyPI, or put {filename} into {folder}.")
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != sha256:
        raise EnvError(
            f"{path} has sha256 {actual}, not the pinned {sha256}. "
            f"Delete it so it is downloaded again, or update the pin if the release changed."
        )
    return path


def _fetch(project: str, filename: str, into: Path) -> List[str]:
    """Writes ``filename`` into ``into`` from the first index that lists it; what each index before it lacked."""
    problems = []
    for index in uvtool.pip_indexes():
        page = f"{index.rstrip('/')}/{project}/"
        if page.startswith("file:"):  # a local mirror is a folder per project, its page index.html
            page += "index.html"
        try:
            with urllib.request.urlopen(page, timeout=60) as response:
                links = re.findall(r'href="([^"]+)"', response.read().decode("utf-8", "replace"))
            url = next((urllib.parse.urljoin(page, link) for link in links
                        if urllib.parse.urlsplit(link).path.rsplit("/", 1)[-1] == filename), None)
            if url is None:
                problems.append(f"{page} does not list it")
                continue
            with urllib.request.urlopen(url, timeout=300) as response, open(into, "wb") as fh:
                shutil.copyfileobj(response, fh)
            break
        except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
            problems.append(f"{page}: {getattr(exc, 'reason', exc)}")
    return problems


def unpack(version: str, sha256: str, target: Path) -> Path:
    """nnsight ``version``'s sdist unpacked as ``target``: its top folder, whole or not at all."""
    archive = sdist(version, sha256)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        # Not fsutil.staged_directory: what moves is the archive's top folder, not the staging folder, and a
        # process that unpacked the same archive first (a target already there) wins the race harmlessly.
        try:
            os.rename(scratch / f"nnsight-{version}", target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def tree(version: str, sha256: str) -> Path:
    """nnsight ``version``'s sdist unpacked once into the cache, for reading (a build unpacks its own copy)."""
    target = cache_dir() / "sdists" / f"nnsight-{version}"
    return target if target.is_dir() else unpack(version, sha256, target)
