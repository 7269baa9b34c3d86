"""What an environment of :mod:`nnsight_repro.envs` is made from, and the stamp that says it was: the specs
(``main``, ``patched``, ``upstream-0.8``, ``tools``), the inputs whose digest names a build, and the stamp
(``env.json``) a finished build writes last.

Does not own when an environment is built or used (:mod:`nnsight_repro.envs`) or how
(:mod:`nnsight_repro.envs.build`). Stdlib only: this runs before anything is installed.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from .. import fsutil, series, uvtool

#: Bump when the build steps change, so existing environments are rebuilt.
RECIPE = 6

PINS = Path(__file__).resolve().parent.parent / "pins"
BUILD_PINS = PINS / "build.txt"


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


def pins_file(s: Union[Spec, ToolSpec]) -> Path:
    """The pinned requirements ``s`` is built from (read at each call: a test points :data:`PINS` elsewhere)."""
    return PINS / s.pins


def inputs(s: Union[Spec, ToolSpec]) -> dict:
    """Everything an environment is built from; its digest names the build."""
    series_name = getattr(s, "series", None)
    return {
        "recipe": RECIPE,
        "spec": asdict(s),
        "pins_sha256": hashlib.sha256(pins_file(s).read_bytes()).hexdigest(),
        "series_digest": series.digest(series_name) if series_name else None,
        "uv": uvtool.VERSION,
        "build_pins_sha256": (hashlib.sha256(BUILD_PINS.read_bytes()).hexdigest()
                              if isinstance(s, Spec) else None),
        # The interpreter venvs are made from; the same from inside any of our venvs.
        "python": sys.version.split()[0],
        "python_home": sys.base_prefix,
    }


def digest_of(values: dict) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def read_stamp(path: Path, filename: str = "env.json") -> Optional[dict]:
    """The stamp in the folder ``path`` (or another JSON file of it), None where it is missing or unreadable."""
    try:
        return json.loads((path / filename).read_text())
    except (OSError, ValueError):
        return None


def write_stamp(path: Path, name: str, digest: str, wanted: dict, freeze: List[str]) -> None:
    """Written last and renamed into place: its presence means the build finished."""
    stamp = {"name": name, "digest": digest, "inputs": wanted, "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "packages": freeze}
    fsutil.write_text(path / "env.json", json.dumps(stamp, indent=1))
