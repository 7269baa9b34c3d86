"""The environments a local NDIF server runs in: a cached venv per generation, plus Debian's ``redis-server``.

Two generations (:data:`SERVERS`): ``ndif-server`` (ndif 0.1.2 + nnsight 0.8.1, for the 0.8 line) and
``ndif-server-0.7`` (ndif 0.0.1 + stock nnsight 0.7.0, for the 0.7 line). Same contract as
:mod:`nnsight_repro.envs` (and built with its lock, stamp and sdist helpers): a venv under
``<cache>/envs/<name>`` with ``env.json`` written last, carrying a digest of every input. A directory
without a stamp, or with another digest, is rebuilt; a half-built one is never used.

How it is built (with uv, by the helpers of :mod:`nnsight_repro.envs`, sharing their uv cache), and why
in this order:

1. ``pins/ndif-server.txt`` and the local CPU torch wheel (by path, so no resolver ever picks a
   multi-GB CUDA build), in one resolution.
2. ``ndif==0.1.2`` without dependencies, from its hash-pinned wheel, with ``--python-version 3.12``: it
   declares Python >= 3.12 but runs on 3.11 (only its metadata says otherwise), and without
   dependencies that override reaches no other package (numpy's 3.12-only releases, say).
3. nnsight 0.8.1 built into a wheel from the same hash-pinned sdist the ``upstream-0.8`` client is
   built from, so server and client run the same nnsight.

The 0.7 server is built by the same steps: ``pins/ndif-server-0.7.txt``, ``ndif==0.0.1`` (same flags, same
reasons, its wheel hash-pinned), and stock nnsight 0.7.0 from the sdist the ``main`` client is built
from. The patched server build installs nothing more: the stack puts the ``patched`` environment's own
nnsight build first on the server's path (:mod:`nnsight_repro.ndif.services`), so it runs exactly that build.
Regenerating its pins: as below, with ``ndif==0.0.1``'s declared and undeclared dependencies (see the pins
file's header) and ``line-0.7.txt`` (less its socket.io pins, which ndif 0.0.1 fixes lower) as constraints.

Regenerating the pins: make a scratch venv, do step 1, then
``pip install -c nnsight_repro/pins/line-0.8.txt pydantic redis click python-dotenv pyyaml boto3 fastapi
'uvicorn[standard]' gunicorn python-multipart 'ray[default]' 'transformers==5.22.2' accelerate numpy
zstandard peft 'moto[server]'`` (ndif's dependencies, and moto as the S3 store), then ``pip freeze``
without pip, setuptools, ndif and nnsight.

Stdlib only: this runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from .. import envs, fsutil, series, uvtool
from ..envs import build as build_steps, sdists
from . import server_packages
from .generations import GENERATIONS


@dataclass(frozen=True)
class ServerSpec:
    name: str
    ndif: str
    wheel_sha256: str
    #: The client environment whose nnsight sdist the server installs too.
    client_env: str
    pins: str
    #: What the built environment must import (0.0.1 installs top-level ``cli`` and ``src``, no ``ndif``).
    imports: str

    @property
    def wheel(self) -> str:
        return f"ndif-{self.ndif}-py3-none-any.whl"


SERVERS: Dict[str, ServerSpec] = {
    "0.8": ServerSpec("ndif-server", "0.1.2", "714cc79f252ebacd5ecf014baaf69eaa6d366c62d9c28b61eda7fa6ccd02d0e6",
                      "upstream-0.8", "ndif-server.txt", "ndif, nnsight, ray, moto, gunicorn"),
    "0.7": ServerSpec("ndif-server-0.7", "0.0.1", "490dec98795eac11173325ea066615b46ee5b782106d31ba54c7fd7f016b1eb4",
                      "main", "ndif-server-0.7.txt", "cli, nnsight, ray, moto, gunicorn, fastapi_socketio, redis"),
}

#: Bump when the build steps change, so existing server environments are rebuilt.
RECIPE = 3


def log(message: str) -> None:
    print(f"[ndif-env] {message}", file=sys.stderr, flush=True)


def env_name(line: str = "0.8", extras: tuple = ()) -> str:
    """The server environment's name: the generation's, plus ``+extra`` for each extra (``ndif-server+multimolecule``)."""
    return "+".join([server_spec(line).name, *(f.name for f in server_packages.extras(extras))])


def server_spec(line: str = "0.8") -> ServerSpec:
    try:
        return SERVERS[line]
    except KeyError:
        raise envs.EnvError(f"No NDIF server environment for nnsight line {line!r}; lines: {', '.join(SERVERS)}.") from None


def ndif_wheel(line: str = "0.8") -> Path:
    """The ndif wheel, downloaded once into the cache and checked against its pinned hash."""
    spec = server_spec(line)
    return sdists.download("ndif", spec.wheel, spec.wheel_sha256)


def inputs(line: str = "0.8", extras: tuple = ()) -> dict:
    spec = server_spec(line)
    client = envs.spec(spec.client_env)
    # The 0.8 server's inputs are exactly what they were before the 0.7 generation existed, so its
    # cached environment keeps its digest; a plain server's are what they were before extras existed.
    chosen = server_packages.extras(extras)
    extra_pins = {f.name: hashlib.sha256((envs.PINS / f.pins).read_bytes()).hexdigest() for f in chosen}
    try:
        fixes = {f.name: series.digest(f.series) for f in chosen if f.series}
    except series.SeriesError as exc:
        raise envs.EnvError(f"The extra(s) {', '.join(f.name for f in chosen)}: {exc}") from None
    return {**({"with_pins_sha256": extra_pins} if extra_pins else {}),
        **({"with_series_digest": fixes} if fixes else {}),
        "recipe": RECIPE,
        "ndif": spec.ndif,
        "ndif_wheel_sha256": spec.wheel_sha256,
        "nnsight": client.nnsight,
        "nnsight_sdist_sha256": client.sdist_sha256,
        "pins_sha256": hashlib.sha256((envs.PINS / spec.pins).read_bytes()).hexdigest(),
        "uv": uvtool.VERSION,
        "build_pins_sha256": hashlib.sha256(envs.BUILD_PINS.read_bytes()).hexdigest(),
        "python": sys.version.split()[0],
        "python_home": sys.base_prefix,
    }


def suite_environments() -> Dict[str, str]:
    """The server environments the test suite's stacks run in, name -> line: each generation's, with the
    suite's extras (:data:`server_packages.SUITE`)."""
    return {env_name(line, server_packages.SUITE): line for line in SERVERS}


def path(line: str = "0.8", extras: tuple = ()) -> Path:
    return envs.env_dir(env_name(line, extras))


def ensure(build: bool = True, line: str = "0.8", extras: tuple = ()) -> envs.Env:
    """The server environment of ``line`` (with the packages of the extras in ``extras``), built if
    missing, half-built or built from other inputs."""
    spec = server_spec(line)
    name = env_name(line, extras)
    how = ("python3 -m nnsight_repro ndif up" + GENERATIONS[line].line_option
           + "".join(f" --with {f.name}" for f in server_packages.extras(extras)))
    return envs.cached(name, path(line, extras), lambda: inputs(line, extras),
                       lambda where, wanted, digest: _build(spec, name, extras, where, wanted, digest),
                       build=build, how_to_build=how)


def _build(spec: ServerSpec, name: str, extras: tuple, where: Path, wanted: dict, digest: str) -> None:
    step = build_steps.stepper(name, where / "build.log")
    client = envs.spec(spec.client_env)
    pins = envs.PINS / spec.pins
    wheel = ndif_wheel("0.8" if spec is SERVERS["0.8"] else "0.7")
    chosen = server_packages.extras(extras)
    python = build_steps.make_venv(step, where)
    # An extra's packages in the same resolution as the generation's pins: one consistent environment,
    # as a serving image built with them would be.
    build_steps.install_pins(step, python, pins, extra=[a for f in chosen for a in ("-r", str(envs.PINS / f.pins))])
    # --python-version only moves ndif's declared Requires-Python check (>= 3.12) out of the way, for this
    # one pure-Python wheel installed without dependencies.
    build_steps.uv_step(step, f"installing ndif {spec.ndif}", "pip", "install", "--python", python, "--no-deps",
                 "--python-version", "3.12", str(wheel))
    built = build_steps.release_wheel(step, client.nnsight, client.sdist_sha256)
    build_steps.uv_step(step, f"installing nnsight {client.nnsight}", "pip", "install", "--python", python,
                 "--no-deps", "--reinstall-package", "nnsight", str(built))
    for extra in chosen:
        if extra.series:
            envs.log(f"{name}: applying the series {extra.series} to the installed {extra.imports[0]}")
            apply_series(extra, Path(python))
    imports = ", ".join([spec.imports, *(module for f in chosen for module in f.imports)])
    installed = build_steps.checked(step, python, f"checking the install (importing {imports})", (
        f"import importlib.metadata as m, {imports}\n"
        "print(m.version('ndif'), m.version('nnsight'))")).split()
    if installed != [spec.ndif, client.nnsight]:
        raise envs.EnvError(f"Building {name!r}: installed ndif/nnsight report {installed}, "
                            f"expected {[spec.ndif, client.nnsight]}.")
    envs.write_stamp(where, name, digest, wanted, build_steps.freeze(step, python))


def apply_series(extra: server_packages.Extra, python: Path) -> None:
    """The extra's fix series applied to its package as installed for ``python``.

    uv installs a file as a hard link to its cache, which every other venv with that release links too;
    ``git apply`` writes each file it changes anew rather than in place, so the fix reaches this venv only
    (tests/test_remote_ndif.py checks that it stays so).
    """
    package = extra.imports[0]
    site = next(python.parent.parent.glob("lib/python*/site-packages"))
    try:
        series.apply(extra.series, site, only=package)
    except series.SeriesError as exc:
        raise envs.EnvError(f"The extra {extra.name!r}: {exc}") from None


def status(line: str = "0.8") -> dict:
    spec = server_spec(line)
    where = path(line)
    return {"name": spec.name, "state": envs.state(spec.name, where, envs.digest_of(inputs(line))),
            "path": str(where), "ndif": spec.ndif}


# System packages ------------------------------------------------------------

def redis_server() -> str:
    """The ``redis-server`` binary, installed from Debian's packages if missing (we run as root)."""
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0:
        raise envs.EnvError("redis-server is not installed, and installing it needs root: "
                            "`apt-get update && apt-get install -y --no-install-recommends redis-server`.")
    # Two stacks may start at once (the test session's lane beside its own tests): one installs, the other
    # waits for it instead of failing on dpkg's lock.
    with fsutil.locked(envs.cache_dir() / ".redis-server-install.lock"):
        found = shutil.which("redis-server")
        if found:
            return found
        log("installing redis-server from Debian's packages")
        apt_env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (["apt-get", "update"],
                        ["apt-get", "install", "-y", "--no-install-recommends", "redis-server"]):
            result = subprocess.run(command, capture_output=True, text=True, env=apt_env)
            if result.returncode:
                tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-8:])
                raise envs.EnvError(f"`{' '.join(command)}` failed:\n{tail}")
    found = shutil.which("redis-server")
    if not found:
        raise envs.EnvError("apt-get installed redis-server, but it is not on PATH.")
    return found
