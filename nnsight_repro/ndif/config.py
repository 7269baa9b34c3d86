"""Where a local NDIF stack lives, what it is configured with, and the checks on that.

One stack per generation (:mod:`.generations`) per project cache (``NNSIGHT_REPRO_CACHE``): its folder is
``<cache>/ndif`` (0.8) or ``<cache>/ndif-0.7``, and its namespace name carries the generation and a digest
of that folder, so both generations can run at once, two checkouts with separate caches can each run
theirs (each in its own namespace, so even the same ports do not collide), and a second ``up`` of the
same stack finds the first.

Owns :class:`StackConfig` (folders, ports, timeouts, server build, extras, memory cap) and :func:`default`.
Does not own what differs between generations, including the environment each one's processes get
(ndif's own settings, set to loopback addresses, plus the adaptations that let it run on a CPU-only,
offline machine): that is each :class:`~.generations.Generation`'s.

Stdlib only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

from .. import settings
from ..settings import cache_dir
from . import server_packages
from .generations import GENERATIONS, Generation


class ConfigError(Exception):
    """The stack's settings contradict each other; the message names the setting."""


#: Longest temp dir Ray's deepest Unix socket path (70 bytes below it) fits the 107-byte limit with.
RAY_TEMP_MAX = 107 - 70


def generation(line: str) -> Generation:
    """The generation serving nnsight line ``line``; an unknown line is refused, naming the ones there are."""
    try:
        return GENERATIONS[line]
    except KeyError:
        raise ConfigError(f"No local NDIF stack serves nnsight line {line!r}; "
                          f"lines with one: {', '.join(GENERATIONS)}.") from None


@dataclass(frozen=True)
class StackConfig:
    folder: Path
    redis_port: int = 6379
    s3_port: int = 9000
    api_port: int = 8001
    #: Fake GPUs advertised to the controller (it only places models on nodes that have some).
    gpus: int = 1
    #: Seconds to wait for the services, then for each deploy, before calling it failed.
    start_timeout: float = 180.0
    deploy_timeout: float = 300.0
    extra_env: Dict[str, str] = field(default_factory=dict)
    #: Which generation (by the nnsight line it serves), and its server build: which nnsight the server runs
    #: (``stock``; for 0.7 also ``patched``).
    line: str = "0.8"
    server: str = "stock"
    #: Extras: packages added to the server (``--with multimolecule``; :mod:`server_packages`), sorted, no repeats.
    extras: tuple = ()
    #: A cap on the memory of every process of the stack, in MiB (its memory cgroup, :mod:`memcg`); None:
    #: no cap of its own (the cgroup still counts and reports OOM kills).
    memory_limit_mib: Optional[int] = None

    @property
    def generation(self) -> Generation:
        return generation(self.line)

    @property
    def client(self) -> str:
        """The client environment that speaks for this server (:meth:`Generation.client_for`): the keys
        ``up`` deploys at start are the ones it mints."""
        return self.generation.client_for(self.server)

    # Folders ---------------------------------------------------------------

    @property
    def netns(self) -> str:
        # Namespace names are file names under /var/run/netns; keep them short and stable.
        return self.generation.netns_prefix + hashlib.sha256(str(self.folder).encode()).hexdigest()[:8]

    @property
    def logs(self) -> Path:
        return self.folder / "logs"

    @property
    def state_file(self) -> Path:
        return self.folder / "state.json"

    @property
    def ray_temp(self) -> Path:
        # Ray puts Unix sockets deep under its temp dir (0.0.1's Ray adds
        # "ray/session_<date>_<pid>/sockets/dash_MetricsHead", 70 bytes), and a socket path may not
        # exceed 107 bytes: under the default cache (~/.cache/nnsight-repro/ndif-0.7) the dashboard
        # failed to start. So Ray's temp dir gets a short path of its own, named after the stack
        # folder; ``<folder>/ray`` links to it, so a failed run's Ray logs are found from the folder.
        return Path("/tmp") / ("nnsr-ray-" + hashlib.sha256(str(self.folder).encode()).hexdigest()[:8])

    @property
    def ray_temp_link(self) -> Path:
        return self.folder / "ray"

    @property
    def home(self) -> Path:
        return self.folder / "home"

    @property
    def deploy_file(self) -> Path:
        return self.folder / "models.yaml"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def python_path_dir(self) -> Path:
        """0.0.1 only: first on every server process's path: the generated ``sitecustomize.py`` that
        loads the adaptations, and for ``server="patched"`` the patched build's nnsight."""
        return self.folder / "pythonpath"

    @property
    def built_log(self) -> Path:
        """One JSON line per model a model actor built (key, wrapper, class, nnsight; :mod:`built_log`)."""
        return self.logs / "built.jsonl"

    # Checks ------------------------------------------------------------------

    def validate(self) -> None:
        """Every port distinct and none of Ray's: otherwise a service would find its port taken."""
        gen = self.generation
        try:
            canonical = tuple(f.name for f in server_packages.extras(self.extras))
        except server_packages.ExtraError as exc:
            raise ConfigError(str(exc)) from None
        if canonical != tuple(self.extras):
            raise ConfigError(f"extras {self.extras!r} must be sorted and without repeats ({canonical!r}); "
                              f"config.default() canonicalizes them.")
        if self.server not in gen.servers:
            raise ConfigError(f"server {self.server!r} is not a server build of the {gen.line} stack; "
                              f"it has: {', '.join(gen.servers)}.")
        ours = {"redis": self.redis_port, "s3": self.s3_port, "api": self.api_port}
        seen: Dict[int, str] = {}
        for service, port in ours.items():
            if not 1 <= port <= 65535:
                raise ConfigError(f"{service} port {port} is not a TCP port.")
            if port in gen.ray_ports:
                raise ConfigError(f"{service} port {port} is already taken inside the stack by "
                                  f"{gen.ray_ports[port]} (ndif's Ray start script fixes it); choose another.")
            if port in seen:
                raise ConfigError(f"port {port} is configured for both {seen[port]} and {service}; "
                                  f"each service needs its own.")
            seen[port] = service
        if self.gpus < gen.min_gpus:
            raise ConfigError(f"gpus must be at least {gen.min_gpus} for the {gen.line} stack: ndif's controller "
                              f"places models only on GPU nodes"
                              + (", one per deployment (fewer hot-swap each other out)." if gen.min_gpus > 1 else "."))
        if self.memory_limit_mib is not None and (not isinstance(self.memory_limit_mib, int) or self.memory_limit_mib < 1):
            raise ConfigError(f"memory limit {self.memory_limit_mib!r} is not a positive number of MiB.")
        if len(str(self.ray_temp)) > RAY_TEMP_MAX:
            raise ConfigError(f"Ray's temp dir {self.ray_temp} is too long a path for its Unix sockets "
                              f"(at most {RAY_TEMP_MAX} characters).")

    # The environment ---------------------------------------------------------

    def environ(self, venv_bin: Path, role: str = "") -> Dict[str, str]:
        """What every server process gets: ndif's settings on loopback, offline, with our adaptations
        (the generation's own: :meth:`Generation.environ`).

        ``role``: ``"ray"`` for Ray's own processes (``generations.RAY_ENV`` added), ``"api"`` for the API and
        the stores; 0.0.1 requires one (its two halves import different ``src`` packages), 0.1.2 also
        takes none (a deploy client).
        """
        if self.generation.roles is not None and role not in self.generation.roles:
            raise ConfigError(f"role must be {' or '.join(repr(r) for r in self.generation.roles)} for the "
                              f"{self.generation.ndif} stack, not {role!r}.")
        return self.generation.environ(self, venv_bin, role)


def default(folder: Optional[Path] = None, line: str = "0.8", extras=(), **overrides) -> StackConfig:
    """The project's stack of ``line``: ``<cache>/ndif`` (0.8) or ``<cache>/ndif-0.7``, ports overridable
    through ``NNSIGHT_REPRO_NDIF_*_PORT``.

    A stack with extras (``extras``, e.g. ``("multimolecule",)``) has a folder of its own
    (``<cache>/ndif+multimolecule``), so its own namespace, state and minted keys: asking for one never
    finds, reuses or stops a plain stack of the same line, and the other way round.
    """
    gen = generation(line)
    try:
        extras = tuple(f.name for f in server_packages.extras(extras))
    except server_packages.ExtraError as exc:
        raise ConfigError(str(exc)) from None
    overrides.setdefault("gpus", gen.gpus)
    for service in ("redis", "s3", "api"):
        value = settings.setting(f"NDIF_{service.upper()}_PORT")
        if value and f"{service}_port" not in overrides:
            try:
                overrides[f"{service}_port"] = int(value)
            except ValueError:
                raise ConfigError(f"{settings.variable(f'NDIF_{service.upper()}_PORT')}={value!r} is not a port number.") from None
    name = "+".join([gen.folder_name, *extras])
    return StackConfig(folder=folder or cache_dir() / name, line=line, extras=extras, **overrides)
