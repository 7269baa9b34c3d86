"""The project's settings: one table of every ``NNSIGHT_REPRO_*`` variable it reads, among them where it keeps
what it builds (one cache shared by every checkout, :func:`cache_dir`); and the variables that keep Hugging
Face's libraries off the network (:data:`HF_OFFLINE`).

Every module reads a setting through :func:`setting` (and names a variable it sets for a child through
:func:`variable`), so the table below is the whole list.

Stdlib only, though ``platformdirs`` would find the cache folder: the README's first command runs this
package with a bare system ``python3`` on a fresh machine, before any environment exists.
"""

import os
from pathlib import Path
from types import MappingProxyType

#: Each setting (its variable is ``NNSIGHT_REPRO_<NAME>``) and what it does.
SETTINGS = {
    "CACHE": "the project cache (default ~/.cache/nnsight-repro); CI and tests may point it at a scratch folder",
    "ENV": "set by the project in every process of an environment: that environment's name",
    "TEST_ENV": "tests/nnsight_env.py: the environment a plain pytest runs the suite in (default patched)",
    "RESULT_FILE": "set by a parent for its child: the file the child's result channel appends to",
    "BUILD_PARALLEL": "how many environments are built side by side after the first (default 1)",
    "OFFLINE": "build environments from the uv cache alone, never touching the network",
    "UV": "a uv binary to use instead of the pinned release the first build installs",
    "PATCHES": "the patches folder (default <repo>/patches); a test points it at an emptied series",
    "STACK_LANE": "nnsight_repro/lane.py: `ahead` (default) starts the session's live-stack jobs before the first test "
                  "and runs the tests that read them last; `on-demand` starts each when a test first asks for it, "
                  "in test order (benchmarks/bench_suite.py's baseline)",
    "ZOO_INJECT": "zoo tests: segfault=<unit>,hang=<unit> makes a worker die or hang at that unit",
    "NDIF_BUILT_LOG": "set by a stack for its server processes: where each model actor records what it built",
    "NDIF_SERVER_IMPORTS": "set by a stack with extras (--with) for its server processes: the packages imported "
                           "before a model is built (nnsight_repro/ndif/server_packages.py)",
    "NDIF_<SERVICE>_PORT": "a local NDIF stack's port for <SERVICE> (API, REDIS, S3, ...)",
}


#: Set for every process that may load a model: an environment's children (``envs.Env.environ``), the suite
#: (tests/conftest.py), a stack's servers. Nothing here may reach the hub; a missing file is an error, not a
#: download.
HF_OFFLINE = MappingProxyType({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def variable(name: str) -> str:
    """The environment variable of the setting ``name``."""
    known = name in SETTINGS or (name.startswith("NDIF_") and name.endswith("_PORT"))
    if not known:
        raise KeyError(f"{name!r} is not a setting of nnsight_repro.settings.SETTINGS")
    return f"NNSIGHT_REPRO_{name}"


def setting(name: str, default=None):
    """The value of the setting ``name`` in this process's environment, or ``default``."""
    return os.environ.get(variable(name)) or default


def cache_dir() -> Path:
    configured = setting("CACHE")
    if configured:
        return Path(configured).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nnsight-repro"
