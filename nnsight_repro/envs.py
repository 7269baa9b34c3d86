"""The environments the project builds and caches: ``main``, ``patched``, ``upstream-0.8``, and ``tools``.

``main`` and ``patched`` are built by the same steps from the same nnsight
0.7.0 sdist; ``patched`` additionally has our series applied to the extracted
source. So the two differ only by the series. ``upstream-0.8`` is nnsight 0.8.1
built the same way.

``tools`` is different in kind: it holds the drivers' own dependencies (Modal's
client for ``modal_verify_patch.py``, matplotlib for the verify report's plots)
and no nnsight. It is never a subject of the checks, so those tools never sit
in an environment under test, and adding one never rebuilds the three above.

Each environment is a venv under the project cache with a stamp (``env.json``)
written last, carrying a digest of everything that went into it: the recipe,
the pinned requirements, the sdist's hash, the series' digest and the Python.
A directory without a stamp is a half-built environment and is never used; a
stamp with another digest is an environment from other inputs. A warm start
reads one small file and hashes a few more.

Stdlib only: this runs before anything is installed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

from . import ROOT, channel, fsutil, paths, series, uvtool
from .paths import cache_dir

#: Bump when the build steps change, so existing environments are rebuilt.
RECIPE = 6

PINS = Path(__file__).resolve().parent / "pins"


@dataclass(frozen=True)
class Spec:
    name: str
    line: str
    nnsight: str
    sdist_sha256: str
    pins: str
    series: Optional[str] = None


SPECS: Dict[str, Spec] = {
    s.name: s
    for s in [
        Spec("main", "0.7", "0.7.0", "5bc6678d567ecc5590b823b7bbab2c310c69f8dda6f4064684c6d488563eebee", "line-0.7.txt"),
        Spec("patched", "0.7", "0.7.0", "5bc6678d567ecc5590b823b7bbab2c310c69f8dda6f4064684c6d488563eebee",
             "line-0.7.txt", series="nnsight-v0.7.0"),
        Spec("upstream-0.8", "0.8", "0.8.1", "0fd9bd354b202d39f1d1ae90cdd02c1112e628325878b49a600876994b210867",
             "line-0.8.txt"),
    ]
}


@dataclass(frozen=True)
class ToolSpec:
    name: str
    pins: str
    #: Imported once built, so an install that cannot import is a failed build, not a later surprise.
    imports: Tuple[str, ...] = ()


TOOLS: Dict[str, ToolSpec] = {
    t.name: t for t in [ToolSpec("tools", "tools.txt", imports=("modal", "matplotlib"))]
}


class EnvError(Exception):
    """An environment cannot be built or used; the message names the fix."""


def spec(name: str) -> Union[Spec, ToolSpec]:
    found = SPECS.get(name) or TOOLS.get(name)
    if found is None:
        raise EnvError(f"Unknown environment {name!r}; known: {', '.join([*SPECS, *TOOLS])}.")
    return found


def log(message: str) -> None:
    print(f"[envs] {message}", file=sys.stderr, flush=True)


# Inputs --------------------------------------------------------------------

def sdist(version: str, sha256: str) -> Path:
    """The nnsight sdist, downloaded once into the cache and checked against its pinned hash."""
    return download("nnsight", f"nnsight-{version}.tar.gz", sha256)


def download(project: str, filename: str, sha256: str) -> Path:
    """``filename`` of ``project`` from the first package index pip is configured with that lists it (its
    simple API: one page, one file, nothing built), cached and hash-checked."""
    folder = cache_dir() / "sdists"
    path = folder / filename
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with fsutil.locked(folder / f".{filename}.lock"), tempfile.TemporaryDirectory(dir=folder) as scratch:
            if path.is_file():  # another build fetched it while this one waited
                return download(project, filename, sha256)
            log(f"downloading {filename}")
            fetched = Path(scratch) / filename
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
                    with urllib.request.urlopen(url, timeout=300) as response, open(fetched, "wb") as fh:
                        shutil.copyfileobj(response, fh)
                    break
                except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
                    problems.append(f"{page}: {getattr(exc, 'reason', exc)}")
            if not fetched.is_file():
                raise EnvError(f"Could not get {filename} from the package index ({'; '.join(problems)}). "
                               f"Fix: restore access to PyPI, or put {filename} into {folder}.")
            os.replace(fetched, path)
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != sha256:
        raise EnvError(
            f"{path} has sha256 {actual}, not the pinned {sha256}. "
            f"Delete it so it is downloaded again, or update the pin if the release changed."
        )
    return path


def inputs(s: Union[Spec, ToolSpec]) -> dict:
    """Everything an environment is built from; its digest names the build."""
    series_name = getattr(s, "series", None)
    return {
        "recipe": RECIPE,
        "spec": asdict(s),
        "pins_sha256": hashlib.sha256((PINS / s.pins).read_bytes()).hexdigest(),
        "series_digest": series.digest(series_name) if series_name else None,
        "uv": uvtool.VERSION,
        "build_pins_sha256": (hashlib.sha256((PINS / "build.txt").read_bytes()).hexdigest()
                              if isinstance(s, Spec) else None),
        # The interpreter venvs are made from; the same from inside any of our venvs.
        "python": sys.version.split()[0],
        "python_home": sys.base_prefix,
    }


def digest_of(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


# Environments --------------------------------------------------------------

@dataclass
class Env:
    name: str
    path: Path
    stamp: dict

    @property
    def python(self) -> Path:
        return self.path / "venv" / "bin" / "python"

    @property
    def source(self) -> Path:
        """The nnsight source tree this environment was installed from (with the series, for ``patched``)."""
        return self.path / "src"

    def environ(self, extra: Optional[dict] = None) -> dict:
        """Offline, deterministic, with the project importable and nothing leaking from the caller."""
        env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}}
        env.update({
            "PYTHONPATH": str(ROOT),
            paths.variable("ENV"): self.name,
            paths.variable("CACHE"): str(cache_dir()),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false",
        })
        # Python writes the .pyc of a module no build's import check loaded when a process first imports it,
        # once per venv, instead of every process compiling it again (bytecode.py).
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.update(extra or {})
        return env

    def run(self, args: List[str], *, cwd: Optional[Path] = None, extra_env: Optional[dict] = None,
            timeout: Optional[float] = None, capture: bool = True) -> subprocess.CompletedProcess:
        """``args`` under this interpreter, for its exit status and log text; a result comes back through
        :meth:`run_one` / :meth:`start` instead (:mod:`nnsight_repro.channel`)."""
        return subprocess.run([str(self.python), *args], cwd=cwd or ROOT, env=self.environ(extra_env),
                              capture_output=capture, text=True, timeout=timeout)

    def what(self, doing: str) -> str:
        """How an error names a child of this environment: ``the 'patched' environment (the check routine)``."""
        return f"the {self.name!r} environment ({doing})"

    def run_one(self, args: List[str], *, doing: str, timeout: Optional[float] = None, cwd: Optional[Path] = None,
                extra_env: Optional[dict] = None, input: Optional[str] = None) -> dict:
        """The one record ``args`` (under this interpreter) sends through :func:`nnsight_repro.channel.send`."""
        return channel.run_one([str(self.python), *args], env=self.environ(extra_env), cwd=cwd or ROOT,
                               timeout=timeout, what=self.what(doing), input=input)

    def start(self, args: List[str], *, doing: str, cwd: Optional[Path] = None, extra_env: Optional[dict] = None,
              input: Optional[str] = None, stderr: Optional[Path] = None,
              new_session: bool = False) -> "channel.Stream":
        """``args`` under this interpreter, its records read one by one (:func:`nnsight_repro.channel.start`)."""
        return channel.start([str(self.python), *args], env=self.environ(extra_env), cwd=cwd or ROOT,
                             what=self.what(doing), input=input, stderr=stderr, new_session=new_session)


def reported_versions(env: Env) -> dict:
    """What the environment's interpreter reports (pip's freeze names sdist and wheel installs by path)."""
    found = env.run_one(["-m", "nnsight_repro.env_versions"], doing="reporting its versions", timeout=300)
    return {"env": env.name, **found, "series_digest": env.stamp.get("inputs", {}).get("series_digest")}


def built_versions() -> Dict[str, dict]:
    """What each finished environment of this cache reports (:func:`reported_versions`), by name: the test
    environments and the NDIF server ones alike, the tool environments aside (no nnsight to report)."""
    found = {}
    for path in sorted(p.parent for p in (cache_dir() / "envs").glob("*/env.json")):
        stamp = _read_stamp(path)
        if stamp is not None and path.name not in TOOLS:
            found[path.name] = reported_versions(Env(path.name, path, stamp))
    return found


def env_dir(name: str) -> Path:
    return cache_dir() / "envs" / name


def _locked(name: str):
    """One builder per environment at a time, across processes."""
    return fsutil.locked(cache_dir() / "envs" / f".{name}.lock")


def _building(name: str) -> bool:
    """Whether another process holds the build lock right now."""
    return fsutil.is_locked(cache_dir() / "envs" / f".{name}.lock")


def _read_stamp(path: Path, filename: str = "env.json") -> Optional[dict]:
    try:
        return json.loads((path / filename).read_text())
    except (OSError, ValueError):
        return None


def _differences(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(keys) or "digest"


def ensure(name: str, build: bool = True) -> Env:
    """The environment, built if missing, half-built or built from other inputs.

    With ``build=False`` a missing or stale environment is an error naming the
    command that builds it, instead of a build.
    """
    s = spec(name)
    return cached(name, env_dir(name), lambda: inputs(s), lambda path, wanted, digest: _build(s, path, wanted, digest),
                  build=build, how_to_build=f"python3 -m nnsight_repro envs build {name}")


def cached(name: str, path: Path, wanted_inputs, builder, *, build: bool, how_to_build: str) -> Env:
    """The stamped venv at ``path``: reused when its stamp matches ``wanted_inputs()``, else rebuilt by ``builder``.

    Shared by every environment the project caches (the test environments here,
    the NDIF server's in ``ndif.server_env``), so they all mean the same by
    ready, stale and half-built.
    """
    with _locked(name):
        wanted = wanted_inputs()
        digest = digest_of(wanted)
        stamp = _read_stamp(path)
        if stamp and stamp.get("digest") == digest and Path(path / "venv" / "bin" / "python").exists():
            return Env(name, path, stamp)
        if stamp:
            reason = f"it was built from other inputs (changed: {_differences(stamp.get('inputs', {}), wanted)})"
        elif path.exists():
            reason = "a previous build did not finish"
        else:
            reason = "it does not exist yet"
        if not build:
            raise EnvError(f"Environment {name!r} at {path} cannot be used: {reason}. "
                           f"Build it with `{how_to_build}`.")
        log(f"building {name!r} ({reason}) in {path}")
        if path.exists():
            # Moved aside first: a process still running from the old build (a stack left up) may write a
            # .pyc into it while it is deleted, which would leave the folder behind.
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            shutil.rmtree(old, ignore_errors=True)
        started = time.monotonic()
        path.mkdir(parents=True)
        builder(path, wanted, digest)
        log(f"built {name!r} in {time.monotonic() - started:.0f} s")
        return Env(name, path, _read_stamp(path))


def state(name: str, path: Path, current_digest: str) -> str:
    """ready, building, stale, half-built or missing."""
    stamp = _read_stamp(path)
    return ("ready" if stamp and stamp.get("digest") == current_digest else
            "building" if _building(name) else
            "stale" if stamp else "half-built" if path.exists() else "missing")


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


def write_stamp(path: Path, name: str, digest: str, wanted: dict, freeze: List[str]) -> None:
    """Written last and renamed into place: its presence means the build finished."""
    stamp = {"name": name, "digest": digest, "inputs": wanted, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "packages": freeze}
    fsutil.write_text(path / "env.json", json.dumps(stamp, indent=1))


# The build ------------------------------------------------------------------
#
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

BUILD_PINS = PINS / "build.txt"


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
        with tempfile.TemporaryDirectory(dir=folder.parent) as scratch, tarfile.open(sdist(version, sha256)) as tar:
            tar.extractall(scratch, filter="data")
            built = build_wheel(step, Path(scratch) / f"nnsight-{version}", Path(scratch) / "dist", version, "the sdist")
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
    share = [python, str(Path(__file__).with_name("bytecode.py"))]
    store = str(cache_dir() / "pyc")
    linked = step("linking the .pyc other venvs compiled", [*share, "link", site, store]).strip()
    writing = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    output = step(description, [python, "-c", code], env=writing)
    published = step("sharing the .pyc it compiled", [*share, "publish", site, store]).strip()
    log(f"{Path(python).parent.parent.parent.name}: bytecode: {linked}; {published}")
    return output


def freeze(step, python: str) -> List[str]:
    return uv_step(step, "recording the installed packages", "pip", "freeze", "--python", python).splitlines()


def _build(s: Union[Spec, ToolSpec], path: Path, wanted: dict, digest: str) -> None:
    step = stepper(s.name, path / "build.log")
    if isinstance(s, ToolSpec):
        _build_tool(s, path, wanted, digest, step)
        return

    archive = sdist(s.nnsight, s.sdist_sha256)
    source = path / "src"
    with tempfile.TemporaryDirectory(dir=path) as scratch, tarfile.open(archive) as tar:
        tar.extractall(scratch, filter="data")
        os.replace(Path(scratch) / f"nnsight-{s.nnsight}", source)
    if s.series:
        log(f"{s.name}: applying the series {s.series}")
        try:
            series.apply(s.series, source)
        except series.SeriesError as exc:
            raise EnvError(f"Building {s.name!r}: {exc}") from None

    python = make_venv(step, path)
    install_pins(step, python, PINS / s.pins)
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


def _build_tool(s: ToolSpec, path: Path, wanted: dict, digest: str, step) -> None:
    python = make_venv(step, path)
    install_pins(step, python, PINS / s.pins, torch=False)
    if s.imports:
        checked(step, python, f"checking the install (importing {', '.join(s.imports)})",
                "import " + ", ".join(s.imports))
    write_stamp(path, s.name, digest, wanted, freeze(step, python))


def build_all(jobs: Dict[str, Callable[[], "Env"]], parallel: Optional[int] = None) -> Dict[str, Env]:
    """Runs ``jobs`` (name -> ensure call): the first alone, then the rest ``parallel`` at a time.

    The first goes alone because it fills the shared uv cache and .pyc store that the others then link
    from; built side by side, each would download and compile the same files. ``parallel`` defaults to
    ``NNSIGHT_REPRO_BUILD_PARALLEL`` or 1: on two cores, side by side was slower (benchmarks/bench_setup.py:
    all six from an empty cache 276 s one at a time, 386 s two at a time after the first), since what
    is left after uv's downloads is CPU-bound (the import checks, which compile what they import). Warm environments
    cost a stamp read either way.
    """
    from concurrent.futures import ThreadPoolExecutor

    if parallel is None:
        parallel = int(paths.setting("BUILD_PARALLEL", "1"))
    names = list(jobs)
    done: Dict[str, Env] = {}
    if names:
        done[names[0]] = jobs[names[0]]()
    rest = names[1:]
    if parallel <= 1:
        done.update({name: jobs[name]() for name in rest})
    elif rest:
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            futures = {name: pool.submit(jobs[name]) for name in rest}
            done.update({name: future.result() for name, future in futures.items()})
    return {name: done[name] for name in names}


def ensure_all(names: List[str], build: bool = True, parallel: Optional[int] = None) -> Dict[str, Env]:
    """Several environments, built as :func:`build_all` does when missing."""
    return build_all({name: (lambda n=name: ensure(n, build=build)) for name in names}, parallel)


def status() -> List[dict]:
    rows = []
    for name, s in [*SPECS.items(), *TOOLS.items()]:
        path = env_dir(name)
        try:
            current = digest_of(inputs(s))
        except series.SeriesError as exc:
            current = f"error: {exc}"
        rows.append({"name": name, "state": state(name, path, current), "path": str(path),
                     "nnsight": getattr(s, "nnsight", "-"),
                     "series": getattr(s, "series", None)})
    return rows
