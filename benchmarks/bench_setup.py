"""Set-up from an empty cache: the wall time of each environment build, serial and side by side, and of the README commands.

    python3 benchmarks/bench_setup.py                         # builds, serial then parallel 2, pip's main beside
    python3 benchmarks/bench_setup.py --readme                # also `verify` then `test` from an empty cache
    python3 benchmarks/bench_setup.py --json results/benchmarks/setup.json

Every measurement gets its own empty scratch cache (``NNSIGHT_REPRO_CACHE``, on the same file system as the
default cache so uv can hard-link): nothing is shared between them but this machine's find-links directory
(the local CPU torch wheel) and the operating system's page cache. Builds are run as the project runs them
(``cli.setup``, as the test command builds them: the two NDIF server environments with the suite's extras)
and timed per environment from its own "built ... in N s" line.

- ``serial``: one environment after another (``NNSIGHT_REPRO_BUILD_PARALLEL=1``), in the order the test
  command builds them; the first fills the uv cache and the shared .pyc store.
- ``parallel``: the first alone, then two at a time (NNSIGHT_REPRO_BUILD_PARALLEL=2).
- ``pip``: the recipe this project used before uv (``python -m venv``, ``pip install torch``, ``pip install
  -r pins``, ``pip install --no-deps`` of the sdist), for ``main`` only, in its own empty pip cache: the
  figure the uv build replaces, measured in the same run.
- ``--readme``: ``python3 -m nnsight_repro verify`` and then ``python3 -m nnsight_repro test`` (with
  ``CI=true``), from one empty cache, as a new user types them.

It ends with the ratios the run allows (uv's ``main`` over pip's; two builds at a time over one).
Not a test: two shared cores make every number move with load, so the load average is printed with each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nnsight_repro import envs, provenance, settings, uvtool  # noqa: E402
from nnsight_repro.cli import TEST_ENVS, TOOL_ENVS  # noqa: E402
from nnsight_repro.ndif import server_env  # noqa: E402

#: The server environments the test command builds.
SERVERS = list(server_env.suite_environments())
BUILT = re.compile(r"\[(?:envs|ndif-env)\] built '([^']+)' in (\d+) s")

SETUP = ("import sys; sys.path.insert(0, {root!r})\n"
         "from nnsight_repro import cli\n"
         "cli.setup()\n")


def load() -> float:
    return round(os.getloadavg()[0], 2)


def scratch_cache(base: Path) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="bench-setup-", dir=base))


def run(command, cache: Path, extra_env=None, log: Path = None) -> dict:
    env = {**os.environ, "NNSIGHT_REPRO_CACHE": str(cache), **(extra_env or {})}
    load_before = load()
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = round(time.monotonic() - started, 1)
    if log:
        log.write_text(result.stdout + result.stderr)
    if result.returncode:
        raise SystemExit(f"{' '.join(map(str, command))} exited {result.returncode}:\n{result.stderr[-3000:]}")
    builds = {name: int(seconds) for name, seconds in BUILT.findall(result.stderr)}
    return {"wall_s": wall, "builds_s": builds, "load": [load_before, load()]}


def setup_run(cache: Path, parallel: int, log: Path) -> dict:
    return run([sys.executable, "-c", SETUP.format(root=str(ROOT))], cache,
               {"NNSIGHT_REPRO_BUILD_PARALLEL": str(parallel)}, log)


def pip_main(cache: Path) -> dict:
    """The pre-uv recipe for ``main`` (venv, torch, pins, sdist), each step timed, with its own empty pip cache."""
    spec = envs.spec("main")
    os.environ["NNSIGHT_REPRO_CACHE"] = str(cache)
    archive = envs.sdists.sdist(spec.nnsight, spec.sdist_sha256)  # downloaded before timing, as the uv run has it too
    source = cache / "src"
    shutil.unpack_archive(str(archive), str(source))
    venv = cache / "pip-venv"
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "--no-input",
           "--cache-dir", str(cache / "pip-cache")]
    pins = envs.PINS / spec.pins
    torch_pin = next(line for line in pins.read_text().splitlines() if line.startswith("torch=="))
    steps = [("venv", [sys.executable, "-m", "venv", str(venv)]),
             ("torch", [*pip, "install", "--quiet", torch_pin]),
             ("pins", [*pip, "install", "--quiet", "-r", str(pins)]),
             ("nnsight", [*pip, "install", "--quiet", "--no-deps", str(source / f"nnsight-{spec.nnsight}")])]
    timed, load_before = {}, load()
    for name, command in steps:
        started = time.monotonic()
        result = subprocess.run(command, capture_output=True, text=True,
                                env={**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION_FOR_NNSIGHT": spec.nnsight})
        if result.returncode:
            raise SystemExit(f"pip step {name} failed:\n{result.stderr[-3000:]}")
        timed[name] = round(time.monotonic() - started, 1)
    return {"wall_s": round(sum(timed.values()), 1), "steps_s": timed, "load": [load_before, load()]}


def built_versions(cache: Path) -> dict:
    """The versions every environment built in ``cache`` reports (``envs.built_versions``), read before the
    cache is removed: the sides of the record's ``versions``. Every measurement builds from the commit's pins,
    so a later one only confirms an earlier one's."""
    os.environ["NNSIGHT_REPRO_CACHE"] = str(cache)
    return envs.built_versions()


def ratios(results: dict) -> dict:
    """The comparisons a run makes possible, each new / old (below 1: faster)."""
    found = {}
    serial, parallel, pip = (results.get(k) for k in ("serial", "parallel", "pip"))
    if serial and pip and "main" in serial["builds_s"]:
        found["main, uv / pip"] = round(serial["builds_s"]["main"] / pip["wall_s"], 2)
    if serial and parallel:
        found["all builds, parallel 2 / serial"] = round(parallel["wall_s"] / serial["wall_s"], 2)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(settings.cache_dir().parent / "nnsight-repro-bench"),
                        help="where the scratch caches go (same file system as the cache)")
    parser.add_argument("--only", default="serial,parallel,pip", help="comma-separated: serial,parallel,pip")
    parser.add_argument("--readme", action="store_true", help="also time the two README commands from nothing")
    parser.add_argument("--readme-commands", default="verify,test",
                        help="with --readme: which of them (verify alone still starts from an empty cache)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch caches")
    parser.add_argument("--json", help="also write the record here")
    args = parser.parse_args(argv)
    base = Path(args.base)
    # What builds the environments; what they contain is the commit's pins.
    builder = {"python": platform.python_version(), "uv": uvtool.VERSION}
    record = {"provenance": provenance.record(provenance.command_line(), versions={"builder": builder},
                                              details={"commit": provenance.commit(ROOT)}),
              "environments": [*TEST_ENVS, *TOOL_ENVS, *SERVERS], "results": {}}
    caches = []
    for what in [w for w in args.only.split(",") if w]:
        cache = scratch_cache(base)
        caches.append(cache)
        if what == "serial":
            result = setup_run(cache, 1, cache.parent / f"{cache.name}.serial.log")
        elif what == "parallel":
            result = setup_run(cache, 2,
                               cache.parent / f"{cache.name}.parallel.log")
        elif what == "pip":
            result = pip_main(cache)
        else:
            raise SystemExit(f"unknown measurement {what!r}")
        record["results"][what] = result
        print(f"{what:8}: {json.dumps(result)}", flush=True)
        if what != "pip":  # pip's venv is not an environment of the project's
            record["provenance"]["versions"].update(built_versions(cache))
        if not args.keep:
            shutil.rmtree(cache, ignore_errors=True)
    if args.readme:
        cache = scratch_cache(base)
        commands = args.readme_commands.split(",")
        readme = {}
        if "verify" in commands:
            with tempfile.TemporaryDirectory() as out:
                readme["verify"] = run([sys.executable, "-m", "nnsight_repro", "verify", "--out", out], cache,
                                       log=cache.parent / f"{cache.name}.verify.log")
            print(f"verify  : {json.dumps(readme['verify'])}", flush=True)
        if "test" in commands:
            readme["test"] = run([sys.executable, "-m", "nnsight_repro", "test"], cache, {"CI": "true"},
                                 log=cache.parent / f"{cache.name}.test.log")
            print(f"test    : {json.dumps(readme['test'])}", flush=True)
        readme["total_s"] = round(sum(r["wall_s"] for r in readme.values()), 1)
        record["results"]["readme"] = readme
        record["provenance"]["versions"].update(built_versions(cache))
        print(f"README commands ({', '.join(commands)}) from an empty cache: {readme['total_s']} s", flush=True)
        if not args.keep:
            shutil.rmtree(cache, ignore_errors=True)
    record["ratios"] = ratios(record["results"])
    for name, value in record["ratios"].items():
        print(f"{name}: {value}x", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
