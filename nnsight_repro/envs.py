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

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from . import ROOT, channel, series
from .paths import cache_dir

#: Bump when the build steps change, so existing environments are rebuilt.
RECIPE = 3

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
    """The nnsight sdist, downloaded once by pip into the cache and checked against its pinned hash."""
    return download(f"nnsight-{version}.tar.gz", sha256, ["--no-binary", ":all:", f"nnsight=={version}"])


def download(filename: str, sha256: str, pip_args: List[str]) -> Path:
    """``filename`` from the package index (``pip download --no-deps`` with ``pip_args``), cached and hash-checked."""
    folder = cache_dir() / "sdists"
    path = folder / filename
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            result = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *pip_args, "-d", scratch],
                capture_output=True, text=True,
            )
            found = Path(scratch) / filename
            if result.returncode or not found.is_file():
                last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no file"
                raise EnvError(f"Could not get {filename} from the package index (pip: {last}). "
                               f"Check access to PyPI, or put {filename} into {folder}.")
            os.replace(found, path)
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
            "NNSIGHT_REPRO_ENV": self.name,
            "NNSIGHT_REPRO_CACHE": str(cache_dir()),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONDONTWRITEBYTECODE": "1",
        })
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


def env_dir(name: str) -> Path:
    return cache_dir() / "envs" / name


@contextlib.contextmanager
def _locked(name: str):
    """One builder per environment at a time, across processes."""
    lock_path = cache_dir() / "envs" / f".{name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _building(name: str) -> bool:
    """Whether another process holds the build lock right now."""
    lock_path = cache_dir() / "envs" / f".{name}.lock"
    if not lock_path.exists():
        return False
    with open(lock_path) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


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
        shutil.rmtree(path, ignore_errors=True)
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
    """Runs one build command, logging it; a failure raises with the log's tail and where the full log is."""
    def step(description: str, command: List[str], env: Optional[dict] = None) -> str:
        with open(build_log, "a") as fh:
            fh.write(f"\n$ {' '.join(command)}\n")
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        with open(build_log, "a") as fh:
            fh.write(result.stdout + result.stderr)
        if result.returncode:
            tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
            raise EnvError(f"Building {name!r} failed while {description} (full log: {build_log}):\n{tail}")
        return result.stdout

    return step


def write_stamp(path: Path, name: str, digest: str, wanted: dict, freeze: List[str]) -> None:
    """Written last and renamed into place: its presence means the build finished."""
    stamp = {"name": name, "digest": digest, "inputs": wanted, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "packages": freeze}
    staging = path / "env.json.tmp"
    staging.write_text(json.dumps(stamp, indent=1))
    os.replace(staging, path / "env.json")


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
        try:
            series.apply(s.series, source)
        except series.SeriesError as exc:
            raise EnvError(f"Building {s.name!r}: {exc}") from None

    venv = path / "venv"
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    step("creating the venv", [sys.executable, "-m", "venv", str(venv)])
    # torch first and alone, by exact version: that takes the CPU wheel on
    # local disk instead of letting a resolver pick a multi-GB CUDA build.
    torch_pin = next(line for line in (PINS / s.pins).read_text().splitlines() if line.startswith("torch=="))
    step("installing torch", [*pip, "install", "--quiet", torch_pin])
    step("installing the pinned requirements", [*pip, "install", "--quiet", "-r", str(PINS / s.pins)])
    # Same version string for main and patched: the sdist's PKG-INFO gives it;
    # the override only guards against a setuptools-scm that looks elsewhere.
    build_env = {**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION_FOR_NNSIGHT": s.nnsight}
    step("building and installing nnsight from the sdist",
         [*pip, "install", "--quiet", "--no-deps", str(source)], env=build_env)
    installed = step("checking the install", [python, "-c",
                     "import importlib.metadata as m, nnsight; print(m.version('nnsight'))"]).strip()
    if installed != s.nnsight:
        raise EnvError(f"Building {s.name!r}: installed nnsight reports {installed}, expected {s.nnsight}.")
    freeze = step("recording the installed packages", [*pip, "freeze", "--all"]).splitlines()
    write_stamp(path, s.name, digest, wanted, freeze)


def _build_tool(s: ToolSpec, path: Path, wanted: dict, digest: str, step) -> None:
    venv = path / "venv"
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    step("creating the venv", [sys.executable, "-m", "venv", str(venv)])
    step("installing the pinned requirements", [*pip, "install", "--quiet", "-r", str(PINS / s.pins)])
    if s.imports:
        step(f"importing {', '.join(s.imports)}", [python, "-c", "import " + ", ".join(s.imports)])
    freeze = step("recording the installed packages", [*pip, "freeze", "--all"]).splitlines()
    write_stamp(path, s.name, digest, wanted, freeze)


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
