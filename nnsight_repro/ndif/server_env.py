"""The environment a local NDIF 0.1.2 server runs in: a cached venv, plus Debian's ``redis-server``.

Same contract as :mod:`nnsight_repro.envs` (and built with its lock, stamp and sdist helpers): a venv
under ``<cache>/envs/ndif-server`` with ``env.json`` written last, carrying a digest of every input. A
directory without a stamp, or with another digest, is rebuilt; a half-built one is never used.

How it is built, and why in this order:

1. ``torch==2.13.0`` alone, by exact version, so pip takes the CPU wheel on local disk and never a
   multi-GB CUDA build.
2. ``pins/ndif-server.txt``: every other package, pinned.
3. ``ndif==0.1.2`` with ``--ignore-requires-python --no-deps``. It declares Python >= 3.12 but runs on
   3.11 (only its metadata says otherwise); ``--no-deps`` because that flag would also let pip pick
   sdists that really need 3.12 (numpy's). The wheel is checked against a pinned hash.
4. nnsight 0.8.1 from the same hash-pinned sdist the ``upstream-0.8`` client is built from, so server and
   client run the same nnsight.

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
from pathlib import Path
from typing import Optional

from .. import envs

NAME = "ndif-server"
NDIF_VERSION = "0.1.2"
NDIF_WHEEL = f"ndif-{NDIF_VERSION}-py3-none-any.whl"
NDIF_WHEEL_SHA256 = "714cc79f252ebacd5ecf014baaf69eaa6d366c62d9c28b61eda7fa6ccd02d0e6"
#: The client environment whose nnsight sdist the server installs too.
CLIENT_ENV = "upstream-0.8"
PINS = envs.PINS / "ndif-server.txt"
#: Bump when the build steps change, so existing server environments are rebuilt.
RECIPE = 1


def log(message: str) -> None:
    print(f"[ndif-env] {message}", file=sys.stderr, flush=True)


def ndif_wheel() -> Path:
    """The ndif wheel, downloaded once into the cache and checked against its pinned hash."""
    return envs.download(NDIF_WHEEL, NDIF_WHEEL_SHA256, ["--ignore-requires-python", f"ndif=={NDIF_VERSION}"])


def inputs() -> dict:
    client = envs.spec(CLIENT_ENV)
    return {
        "recipe": RECIPE,
        "ndif": NDIF_VERSION,
        "ndif_wheel_sha256": NDIF_WHEEL_SHA256,
        "nnsight": client.nnsight,
        "nnsight_sdist_sha256": client.sdist_sha256,
        "pins_sha256": hashlib.sha256(PINS.read_bytes()).hexdigest(),
        "python": sys.version.split()[0],
        "python_home": sys.base_prefix,
    }


def path() -> Path:
    return envs.env_dir(NAME)


def ensure(build: bool = True) -> envs.Env:
    """The server environment, built if missing, half-built or built from other inputs."""
    return envs.cached(NAME, path(), inputs, _build, build=build, how_to_build="python3 -m nnsight_repro ndif up")


def _build(where: Path, wanted: dict, digest: str) -> None:
    step = envs.stepper(NAME, where / "build.log")
    client = envs.spec(CLIENT_ENV)
    wheel = ndif_wheel()
    nnsight_sdist = envs.sdist(client.nnsight, client.sdist_sha256)
    venv = where / "venv"
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    step("creating the venv", [sys.executable, "-m", "venv", str(venv)])
    torch_pin = next(line for line in PINS.read_text().splitlines() if line.startswith("torch=="))
    step("installing torch", [*pip, "install", "--quiet", torch_pin])
    step("installing the pinned requirements", [*pip, "install", "--quiet", "-r", str(PINS)])
    step(f"installing ndif {NDIF_VERSION}",
         [*pip, "install", "--quiet", "--no-deps", "--ignore-requires-python", str(wheel)])
    step(f"installing nnsight {client.nnsight}", [*pip, "install", "--quiet", "--no-deps", str(nnsight_sdist)])
    installed = step("checking the install", [python, "-c", (
        "import importlib.metadata as m, ndif, nnsight, ray, moto, gunicorn\n"
        "print(m.version('ndif'), m.version('nnsight'))")]).split()
    if installed != [NDIF_VERSION, client.nnsight]:
        raise envs.EnvError(f"Building {NAME!r}: installed ndif/nnsight report {installed}, "
                            f"expected {[NDIF_VERSION, client.nnsight]}.")
    freeze = step("recording the installed packages", [*pip, "freeze", "--all"]).splitlines()
    envs.write_stamp(where, NAME, digest, wanted, freeze)


def status() -> dict:
    where = path()
    return {"name": NAME, "state": envs.state(NAME, where, envs.digest_of(inputs())), "path": str(where),
            "ndif": NDIF_VERSION}


# System packages ------------------------------------------------------------

def redis_server() -> str:
    """The ``redis-server`` binary, installed from Debian's packages if missing (we run as root)."""
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0:
        raise envs.EnvError("redis-server is not installed, and installing it needs root: "
                            "`apt-get update && apt-get install -y --no-install-recommends redis-server`.")
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


def binary(env: envs.Env, name: str) -> Optional[str]:
    """A console script of the server venv (``ndif``, ``moto_server``, ...)."""
    candidate = env.path / "venv" / "bin" / name
    return str(candidate) if candidate.exists() else None
