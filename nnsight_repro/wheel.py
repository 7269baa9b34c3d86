"""The fixed client as a wheel a researcher pip-installs: nnsight 0.7.0 plus our series (and its extras).

    python3 -m nnsight_repro wheel [--out dist] [--no-extras] [--python PATH]

Built from the same hash-pinned 0.7.0 sdist as the ``main`` and ``patched`` environments, with each
series that ``patches/`` lists applied in order (``nnsight-v0.7.0``, then ``nnsight-v0.7.0-extras``
unless ``--no-extras``), by ``uv build`` with the pinned build requirements. The wheel holds nnsight's
compiled C extension, so it is for the interpreter it is built with (``--python``: the researcher's).

The version. nnsight's client sends ``importlib.metadata.version("nnsight")`` as the ``nnsight-version``
header of every request. ndif 0.0.1 (today's NDIF, serving stock 0.7.0) rejects a request whose
``packaging.version.Version(header)`` is below its ``MIN_NNSIGHT_VERSION``, which defaults to the
server's own nnsight (0.7.0); ndif 0.1.x does the same against ``NDIF_MIN_NNSIGHT_VERSION`` (unset: no
check). A malformed string fails to parse there. So the wheel is ``0.7.0+encoders.<digest>``: a PEP 440
local version of 0.7.0, which ``Version`` parses and orders above 0.7.0 (accepted by both), and which
names the series it carries (the first 8 hex digits of a digest of their digests) so nobody mistakes it
for the release.

Stdlib only.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from . import ROOT, envs, series
from .envs import build as env_build, sdists

BASE_ENV = "patched"
EXTRAS = "nnsight-v0.7.0-extras"


def applied_series(extras: bool = True) -> List[str]:
    names = [envs.spec(BASE_ENV).series]
    if extras and series.directory(EXTRAS).is_dir():
        names.append(EXTRAS)
    return names


def version(names: List[str]) -> str:
    joined = ",".join(f"{name}:{series.digest(name)}" for name in names)
    return f"{envs.spec(BASE_ENV).nnsight}+encoders.{hashlib.sha256(joined.encode()).hexdigest()[:8]}"


def build(out: Path, extras: bool = True, python: Optional[str] = None) -> Path:
    """The wheel, written into ``out``; its build log beside it."""
    spec = envs.spec(BASE_ENV)
    names = applied_series(extras)
    wanted = version(names)
    for name in names:
        series.base(name)  # a series listing another base stops here, before anything is fetched
    sdists.sdist(spec.nnsight, spec.sdist_sha256)  # fetched before anything is written
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    step = env_build.stepper("client wheel", out / f"nnsight-{wanted}.build.log")
    with tempfile.TemporaryDirectory(prefix="nnsight-wheel-") as scratch:
        source = sdists.unpack(spec.nnsight, spec.sdist_sha256, Path(scratch) / f"nnsight-{spec.nnsight}")
        for name in names:
            envs.log(f"client wheel: applying the series {name}")
            try:
                # The wheel holds src/ alone. Its base check is per file, and both series add to CI's list
                # in .github/, so only src/ of a later series would still pass it.
                series.apply(name, source, only="src")
            except series.SeriesError as exc:
                raise envs.EnvError(f"Building the client wheel: {exc}") from None
        built = env_build.build_wheel(step, source, Path(scratch) / "dist", wanted, " + ".join(names), python=python)
        target = out / built.name
        target.write_bytes(built.read_bytes())
    return target


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nnsight-repro wheel", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.splitlines()[0] + "\nIt compiles nnsight's C extension, so the wheel is for one "
                    "interpreter (--python) and building it needs a C compiler.",
        epilog="exit status:\n  0  the wheel was built (its path is printed)\n"
               "  2  usage error, or the build failed (a series that does not apply, the compiler; the message "
               "and the build log beside the wheel say why)\n")
    parser.add_argument("--out", default=str(ROOT / "dist"), help="directory for the wheel (default: dist/)")
    parser.add_argument("--no-extras", action="store_true", help=f"only the main series, without {EXTRAS}")
    parser.add_argument("--python", default=None,
                        help="the interpreter the wheel is for (default: this one); its C extension is built for it")
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    started = time.monotonic()
    path = build(Path(args.out), extras=not args.no_extras, python=args.python)
    print(f"built {path} in {time.monotonic() - started:.0f} s (series: {', '.join(applied_series(not args.no_extras))})",
          file=sys.stderr)
    print(path)
    print(f"install it with: python -m pip install '{path}'", file=sys.stderr)
    return 0
