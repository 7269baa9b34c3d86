"""Package overlays: one other version of a package, put in front of an environment's own.

Some upstream incompatibilities only show with another release of a
dependency (nnsight 0.8.1 with transformers 5.23). Building a whole
environment for each would cost minutes and a gigabyte; an overlay is just
that one distribution, installed with ``uv pip install --no-deps --target`` into
the project cache and put first on ``PYTHONPATH``. Everything else — torch,
tokenizers, huggingface_hub, nnsight — stays the environment's own, so a
difference in behaviour is the overlaid package's doing.

``--no-deps`` is deliberate: the overlay must not drag in a second copy of
anything the environment already pins. An overlay whose requirements the
environment does not meet fails at import, which a repro notices.

Like an environment, an overlay is built into a staging directory, stamped
last and renamed into place, under a lock: a half-built one is never used.
Stdlib only.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from . import envs, fsutil, uvtool
from .settings import cache_dir


class OverlayError(Exception):
    """An overlay cannot be built; the message says why."""


def overlay_dir(requirement: str) -> Path:
    # One directory per exact pin, e.g. transformers==5.23.0 -> transformers-5.23.0.
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", requirement):
        raise OverlayError(f"An overlay needs an exact pin like 'transformers==5.23.0', not {requirement!r}.")
    return cache_dir() / "overlays" / requirement.replace("==", "-")


def _stamp(path: Path) -> Optional[dict]:
    return envs.read_stamp(path, "overlay.json")


def ensure(requirement: str, python: Path) -> Path:
    """The directory to put first on ``PYTHONPATH`` for ``requirement``, built once for ``python``."""
    target = overlay_dir(requirement)
    stamp = _stamp(target)
    if stamp and stamp.get("requirement") == requirement:
        return target / "site"
    target.parent.mkdir(parents=True, exist_ok=True)
    with fsutil.locked(target.parent / f".{target.name}.lock"):
        stamp = _stamp(target)
        if stamp and stamp.get("requirement") == requirement:
            return target / "site"
        shutil.rmtree(target, ignore_errors=True)
        with fsutil.staged_directory(target) as staging:
            try:
                command = uvtool.command("pip", "install", "--quiet", "--python", str(python), "--no-deps",
                                         "--target", str(staging / "site"), requirement)
            except uvtool.UvError as exc:
                raise OverlayError(str(exc)) from None
            result = subprocess.run(command, capture_output=True, text=True, env=uvtool.environ())
            if result.returncode:
                output = (result.stderr or result.stdout).strip()
                tail = "\n".join(output.splitlines()[-10:])
                why = uvtool.explain(output)
                raise OverlayError(f"uv could not install {requirement} as an overlay"
                                   f"{': ' + why if why else ''}:\n{tail}")
            (staging / "overlay.json").write_text(json.dumps({"requirement": requirement, "python": str(python)}))
    return target / "site"


def with_series(env, series_name: str, destination: Path) -> Path:
    """A copy of ``env``'s installed nnsight with a fix series applied; put the result first on ``PYTHONPATH``.

    The installed package, not the source tree, because only the installed
    copy carries the compiled ``.save()`` extension. Its ``.py`` files are
    the sdist's byte for byte, so the series' base check holds for them; what
    else a series touches comes from the environment's source tree: ``tests``,
    ``docs`` (a fix updates the page it invalidates) and ``.github`` (a series
    adds its test files to CI's list there). The copy is laid out as that tree
    so the series applies with the project's own ``series.apply``.
    """
    from . import series

    destination = Path(destination)
    shutil.copytree(site_packages(env, "nnsight") / "nnsight", destination / "src" / "nnsight",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(env.source / "tests", destination / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("docs", ".github"):
        if (env.source / folder).is_dir():
            shutil.copytree(env.source / folder, destination / folder)
    series.apply(series_name, destination)
    return destination / "src"


def with_package_series(env, package: str, series_name: str, destination: Path) -> Path:
    """A copy of ``env``'s installed ``package`` with a fix series applied; put the result first on ``PYTHONPATH``.

    For a package its repository keeps at the top level (multimolecule: ``multimolecule/`` in the repository
    is ``multimolecule/`` in site-packages), so the copy is laid out as the repository and the series' paths
    hold as they are. Its wheel has no ``tests/``: only the series' changes under ``package/`` are applied,
    and the base check covers just those files (``series.apply(..., only=package)``). The copy carries no
    ``.dist-info``, so ``importlib.metadata`` still reports the environment's own release.
    """
    from . import series

    destination = Path(destination)
    shutil.copytree(site_packages(env, package) / package, destination / package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    series.apply(series_name, destination, only=package)
    return destination


def site_packages(env, package: str) -> Path:
    """The site-packages folder of ``env`` that holds ``package`` (raises unless exactly one does)."""
    installed = sorted(env.path.glob(f"venv/lib/python*/site-packages/{package}"))
    if len(installed) != 1:
        raise OverlayError(f"Expected one installed {package} under {env.path}/venv, found {len(installed)}.")
    return installed[0].parent
