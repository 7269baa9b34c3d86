"""Where the project keeps what it builds: one cache shared by every checkout.

``NNSIGHT_REPRO_CACHE`` overrides the location (CI and tests may point it at a
scratch directory). Stdlib only: environments are built before anything else
is installed.
"""

import os
from pathlib import Path


def cache_dir() -> Path:
    configured = os.environ.get("NNSIGHT_REPRO_CACHE")
    if configured:
        return Path(configured).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nnsight-repro"
