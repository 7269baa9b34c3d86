"""How an environment of :mod:`nnsight_repro.envs` is built: its venv made and filled by uv, nnsight's wheel
built (once per release, into the cache) and installed, the install checked, the stamp written last.

Owns: the build's steps and their order, what each step logs and what its failure says. Does not own which
environments exist, what their inputs are, or when a build is needed (:mod:`nnsight_repro.envs`), nor where
the released files come from (:mod:`nnsight_repro.envs.sdists`).

Stdlib only: this runs before anything is installed.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import List, Optional, Union

from .. import fsutil, series, uvtool
from ..settings import cache_dir
from .sdists import unpack
from .specs import BUILD_PINS, EnvError, Spec, ToolSpec, digest_of, log, pins_file, write_stamp

# Every venv is made and filled by uv (:mod:`nnsight_repro.uvtool`), all sharing one uv cache, in this order:
#
# 1. ``uv venv`` from the interpreter the inputs name.
# 2. The pinned requirements and torch in one resolution. torch comes as the CPU wheel file from a
#    find-links directory, named by path, so no resolver can pick a multi-GB CUDA build from PyPI; the
#    pins file's ``torch==`` line then only checks its version.
# 3. nnsight built into a wheel from the (patched) source with ``uv build`` and pinned build
#    requirements (``pins/build.txt``), then installed without dependencies, every one of which step 2
#    pinned; ``uv pip check`` then proves none is missing. Building the wheel explicitly (instead of
#    installing the source directory) keeps uv's cache out of it: uv keys a directory's build by its
#    pyproject's mtime, which the sdist fixes, so a rebuilt ``patched`` could get the previous series'
#    wheel back. Compiling nnsight's C extension is most of that step, and one release's wheel is the
#    same in every environment that installs it, so it is built once into the cache (``release_wheel``);
#    a series that changes only Python files (each of ours) goes into a copy of it (``series_wheel``).
# 4. The import check, which compiles what it imports; each of those .pyc is shared through a store with
#    every venv that installs the same file (``bytecode.py``). Anything else is compiled by the first
#    process that imports it, once per venv.



def uv_step(step, description: str, *args: str, env: Optional[dict] = None) -> str:
    try:
        command = uvtool.command(*args)
    except uvtool.UvError as exc:
        raise EnvError(str(exc)) from None
    return step(description, command, env=uvtool.environ(env))


def torch_wheel(pins: Path) -> Path:
    """The local CPU torch wheel of the version ``pins`` names; a clear error when this machine has none."""
    torch_pin = next(line for line in pins.read_text().splitlines() if line.startswith("torch=="))
    version = torch_pin.split("==", 1)[1].strip()
    found = uvtool.find_wheel("torch", version)
    if found is None:
        looked = ", ".join(uvtool.pip_find_links()) or "none configured"
        raise EnvError(f"No local CPU wheel of torch {version} in pip's find-links directories ({looked}). "
                       f"Fix: put torch-{version}+cpu-<tags>.whl (from https://download.pytorch.org/whl/cpu) into "
                       f"one of them, or name its directory in PIP_FIND_LINKS; the project never lets a resolver "
                       f"choose torch, since PyPI's Linux wheel is the CUDA build.")
    return found


def make_venv(step, path: Path) -> str:
    venv = path / "venv"
    base = getattr(sys, "_base_executable", None) or sys.executable
    uv_step(step, "creating the venv", "venv", "--quiet", "--python", base, str(venv))
    return str(venv / "bin" / "python")


def install_pins(step, python: str, pins: Path, *, torch: bool = True, extra: List[str] = ()) -> None:
    """Step 2: the pinned requirements (and the local CPU torch wheel) in one resolution."""
    wheel = [str(torch_wheel(pins))] if torch else []
    count = sum(1 for line in pins.read_text().splitlines() if line.strip() and not line.startswith("#"))
    uv_step(step, f"resolving and installing {count} pinned packages ({pins.name})",
            "pip", "install", "--python", python, "-r", str(pins), *wheel, *extra)


def build_wheel(step, source: Path, out: Path, version: str, what: str, python: Optional[str] = None) -> Path:
    """Step 3a: a wheel of ``source`` (compiling nnsight's C extension), with pinned build requirements."""
    # Same version string for main and patched: the sdist's PKG-INFO gives it; the override only guards
    # against a setuptools-scm that looks elsewhere (a git checkout around the tree).
    env = {**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION_FOR_NNSIGHT": version}
    uv_step(step, f"building the nnsight {version} wheel from {what} (compiling its C extension)",
            "build", "--quiet", "--wheel", "--python", python or sys.executable, "--build-constraints", str(BUILD_PINS),
            "--out-dir", str(out), str(source), env=env)
    wheels = sorted(out.glob(f"nnsight-{version}-*.whl"))
    if len(wheels) != 1:
        raise EnvError(f"Building the nnsight wheel from {source} left {len(wheels)} wheels in {out}.")
    return wheels[0]


def release_wheel(step, version: str, sha256: str) -> Path:
    """Step 3a: the wheel of nnsight ``version``'s sdist, built once per sdist, build pins and interpreter into
    the cache and shared by every environment that installs the release (``main`` and the line's NDIF servers).

    Built under a lock and moved into place whole, so a build that fails or is killed leaves no wheel behind.
    """
    key = digest_of({"sdist_sha256": sha256, "build_pins_sha256": hashlib.sha256(BUILD_PINS.read_bytes()).hexdigest(),
                     "uv": uvtool.VERSION, "python": sys.version.split()[0], "python_home": sys.base_prefix})
    folder = cache_dir() / "wheels" / f"nnsight-{version}-{key}"
    with fsutil.locked(folder.with_name(f".{folder.name}.lock")):
        found = sorted(folder.glob(f"nnsight-{version}-*.whl"))
        if found:
            log(f"nnsight {version}: its wheel was built before ({found[0].name}), not compiled again")
            return found[0]
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
            source = unpack(version, sha256, Path(scratch) / f"nnsight-{version}")
            built = build_wheel(step, source, Path(scratch) / "dist", version, "the sdist")
            # A file moved in whole from the build's scratch tree (the lock above keeps out a second builder), so
            # not fsutil.staged_file: uv names the wheel, and only once it is built.
            folder.mkdir(exist_ok=True)
            os.replace(built, folder / built.name)
            return folder / built.name


def series_wheel(release: Path, name: str, source: Path, out: Path) -> Optional[Path]:
    """``release`` with every file of nnsight the series ``name`` changes taken from ``source`` (the tree it
    was applied to), written into ``out``: the wheel a build of ``source`` would give, without compiling
    the C extension again. None when the series touches anything else a build reads (C sources, build
    configuration), which then needs a build of its own."""
    changed = series.touched(name)
    # CI configuration (.github/: a series adds its tests to the workflow's list) is not read by a build.
    if not all((p.startswith("src/nnsight/") and p.endswith(".py")) or p.startswith(("tests/", "docs/", ".github/"))
               for p in changed):
        return None
    replaced = {p[len("src/"):]: source / p for p in changed if p.startswith("src/")}

    def record_line(path: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(data)}"

    out.mkdir(parents=True, exist_ok=True)
    target = out / release.name
    with zipfile.ZipFile(release) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as new:
        record = next(n for n in old.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for line in old.read(record).decode().splitlines():
            path = line.rsplit(",", 2)[0]
            if path not in replaced:
                lines.append(line)
        for info in old.infolist():
            if info.filename != record and info.filename not in replaced:
                new.writestr(info, old.read(info))
        for path, file in replaced.items():
            if file.is_file():  # a file the series deletes is simply left out
                data = file.read_bytes()
                new.writestr(path, data)
                lines.append(record_line(path, data))
        new.writestr(record, "\n".join(lines) + "\n")
    return target


def checked(step, python: str, description: str, code: str) -> str:
    """Step 4: the build's import check, ``code`` run by the new venv; its output.

    Its bytecode is shared (``bytecode.py``): first every ``.pyc`` another venv compiled for the same
    installed file is linked in, then the check runs with bytecode writing on, compiling what it imports
    and nothing else, and what it compiled goes into the store for the next venv.
    """
    site = str(next(Path(python).parent.parent.glob("lib/python*/site-packages")))
    share = [python, str(Path(__file__).parent.parent / "bytecode.py")]
    store = str(cache_dir() / "pyc")
    linked = step("linking the .pyc other venvs compiled", [*share, "link", site, store]).strip()
    writing = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    output = step(description, [python, "-c", code], env=writing)
    published = step("sharing the .pyc it compiled", [*share, "publish", site, store]).strip()
    log(f"{Path(python).parent.parent.parent.name}: bytecode: {linked}; {published}")
    return output


def freeze(step, python: str) -> List[str]:
    return uv_step(step, "recording the installed packages", "pip", "freeze", "--python", python).splitlines()


def build(s: Union[Spec, ToolSpec], path: Path, wanted: dict, digest: str) -> None:
    """Builds the environment ``s`` into the empty folder ``path``; its stamp, written last, says it finished."""
    step = stepper(s.name, path / "build.log")
    if isinstance(s, ToolSpec):
        build_tool(s, path, wanted, digest, step)
        return

    source = unpack(s.nnsight, s.sdist_sha256, path / "src")
    if s.series:
        log(f"{s.name}: applying the series {s.series}")
        try:
            series.apply(s.series, source)
        except series.SeriesError as exc:
            raise EnvError(f"Building {s.name!r}: {exc}") from None

    python = make_venv(step, path)
    install_pins(step, python, pins_file(s))
    release = release_wheel(step, s.nnsight, s.sdist_sha256)
    with tempfile.TemporaryDirectory(dir=path) as out:
        wheel = release
        if s.series:
            wheel = series_wheel(release, s.series, source, Path(out))
            if wheel:
                log(f"{s.name}: the release's wheel with the series' files (it changes Python files only)")
            else:
                wheel = build_wheel(step, source, Path(out), s.nnsight, "the series-patched sdist")
        uv_step(step, f"installing nnsight {s.nnsight}", "pip", "install", "--python", python, "--no-deps",
                "--reinstall-package", "nnsight", str(wheel))
    uv_step(step, "checking that every requirement is installed", "pip", "check", "--python", python)
    installed = checked(step, python, "checking the install (importing nnsight)",
                        "import importlib.metadata as m, nnsight; print(m.version('nnsight'))").strip()
    if installed != s.nnsight:
        raise EnvError(f"Building {s.name!r}: installed nnsight reports {installed}, expected {s.nnsight}.")
    write_stamp(path, s.name, digest, wanted, freeze(step, python))


def build_tool(s: ToolSpec, path: Path, wanted: dict, digest: str, step) -> None:
    python = make_venv(step, path)
    install_pins(step, python, pins_file(s), torch=False)
    if s.imports:
        checked(step, python, f"checking the install (importing {', '.join(s.imports)})",
                "import " + ", ".join(s.imports))
    write_stamp(path, s.name, digest, wanted, freeze(step, python))


def stepper(name: str, build_log: Path):
    """Runs one build command, logging it; a failure raises with the log's tail and where the full log is.

    Each step announces itself on one line (environment, phase, seconds since the build began), so a long
    build is never silent; its output goes to ``build_log``.
    """
    started = time.monotonic()

    def step(description: str, command: List[str], env: Optional[dict] = None) -> str:
        log(f"{name}: {description} (+{time.monotonic() - started:.1f} s)")
        with open(build_log, "a") as fh:
            fh.write(f"\n$ {' '.join(command)}\n")
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        with open(build_log, "a") as fh:
            fh.write(result.stdout + result.stderr)
        if result.returncode:
            output = (result.stderr or result.stdout).strip()
            tail = "\n".join(output.splitlines()[-15:])
            why = uvtool.explain(output) if command and command[0] == str(uvtool.binary()) else ""
            raise EnvError(f"Building {name!r} failed while {description}"
                           f"{': ' + why if why else ''} (full log: {build_log}):\n{tail}")
        return result.stdout

    return step

