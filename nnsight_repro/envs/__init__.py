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

Owns: which environments exist, their inputs and digest, the stamp, when one is built (ready, stale,
half-built, missing; one builder at a time) and how a child runs in one. Does not own how one is built
(:mod:`nnsight_repro.envs.build`), where its released files come from (:mod:`nnsight_repro.envs.sdists`), or
what it is made from (:mod:`nnsight_repro.envs.specs`).

Stdlib only: this runs before anything is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .. import ROOT, channel, fsutil, series, settings
from ..settings import cache_dir
from . import build as build_steps
from .specs import (BUILD_PINS, PINS, RECIPE, SPECS, TOOLS, EnvError, Spec, ToolSpec, digest_of,  # noqa: F401
                    inputs, log, read_stamp, spec, write_stamp)


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
            settings.variable("ENV"): self.name,
            settings.variable("CACHE"): str(cache_dir()),
            **settings.HF_OFFLINE,
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
        stamp = read_stamp(path)
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


def _differences(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(keys) or "digest"


def ensure(name: str, build: bool = True) -> Env:
    """The environment, built if missing, half-built or built from other inputs.

    With ``build=False`` a missing or stale environment is an error naming the
    command that builds it, instead of a build.
    """
    s = spec(name)
    return cached(name, env_dir(name), lambda: inputs(s),
                  lambda path, wanted, digest: build_steps.build(s, path, wanted, digest),
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
        stamp = read_stamp(path)
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
        return Env(name, path, read_stamp(path))


def state(name: str, path: Path, current_digest: str) -> str:
    """ready, building, stale, half-built or missing."""
    stamp = read_stamp(path)
    return ("ready" if stamp and stamp.get("digest") == current_digest else
            "building" if _building(name) else
            "stale" if stamp else "half-built" if path.exists() else "missing")


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
        parallel = int(settings.setting("BUILD_PARALLEL", "1"))
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
