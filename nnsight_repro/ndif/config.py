"""Where a local NDIF stack lives and what every one of its processes is told.

Two stack generations, one per nnsight line a client speaks (:data:`GENERATIONS`):

- ``0.8``: PyPI ``ndif`` 0.1.2, serving nnsight 0.8 clients (the default);
- ``0.7``: PyPI ``ndif`` 0.0.1 plus backports, serving nnsight 0.7.0 clients, with the server's
  nnsight either stock 0.7.0 or the project's ``patched`` build (``server``).

One stack per generation per project cache (``NNSIGHT_REPRO_CACHE``): its folder is ``<cache>/ndif``
(0.8) or ``<cache>/ndif-0.7``, and its namespace name carries the generation and a digest of that
folder, so both generations can run at once, two checkouts with separate caches can each run theirs
(each in its own namespace, so even the same ports do not collide), and a second ``up`` of the same
stack finds the first.

The environment is ndif's own settings (``NDIF_*`` for 0.1.2; ``BROKER_URL``, ``OBJECT_STORE_URL``,
``RAY_*`` ports ... for 0.0.1, read by its start scripts and services), set to loopback addresses, plus
the adaptations that let it run on a CPU-only, offline machine; what each adaptation bridges is
documented in its generation's adaptations module (:data:`Generation.adaptations`).

Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

from .. import ROOT, paths
from ..paths import cache_dir
from . import server_packages

class ConfigError(Exception):
    """The stack's settings contradict each other; the message names the setting."""


ADAPTATIONS = "nnsight_repro.ndif.adaptations_0_1_2"

#: Ports Ray takes inside the namespace whatever we configure (ndif's start script fixes them):
#: GCS, object manager, client server, dashboard, dashboard agent gRPC and HTTP, metrics.
RAY_PORTS = {6385: "ray gcs", 8076: "ray object manager", 10001: "ray client server", 8265: "ray dashboard",
             52366: "ray dashboard agent (grpc)", 52365: "ray dashboard agent (http)", 8080: "ray metrics"}

#: The same for ndif 0.0.1: its ray/start.sh takes them from the variables its CLI would set
#: (:func:`StackConfig.environ` sets the CLI's defaults), and Ray's client server and agent HTTP port
#: keep Ray's defaults.
RAY_PORTS_0_0_1 = {6380: "ray gcs", 8076: "ray object manager", 10001: "ray client server", 8265: "ray dashboard",
                   8268: "ray dashboard agent (grpc)", 52365: "ray dashboard agent (http)", 8267: "ray metrics"}


#: Added to the environment of Ray's own processes (head, client server, workers; ``environ(role="ray")``),
#: both generations.
#: ndif's API reaches Ray through Ray's client server (``ray://127.0.0.1:10001``), which forks one
#: server per client while its own gRPC threads are busy. gRPC's fork support is on in these processes
#: (the proxier logs its "Other threads are currently calling into gRPC, skipping fork() handlers"),
#: so the child runs gRPC's after-fork handler before it execs, and about one in six die on the spot
#: with nothing logged (ray-project/ray#63202); the client then waits 30-45 s before it retries, which
#: was the stall some cold starts showed. Measured on the 0.7 stack (ray 2.50, grpcio 1.85.3), Ray
#: clients connecting in two parallel loops (``ray_clients.py``): 18 of 122 connects failed with fork
#: support on, 0 of 160 with it off. The 0.8 stack's Ray (2.60) lost none of 51 with fork support on; it
#: gets the same setting so both generations start Ray alike. Ray starts every process of its own by exec, so
#: nothing in it needs gRPC's state to survive a fork.
RAY_ENV = {"GRPC_ENABLE_FORK_SUPPORT": "false"}

#: The CPUs each stack's Ray node advertises (``RAY_OVERRIDE_RESOURCES``), both generations. Here a CPU is
#: a scheduling slot, not a core: ndif's controller and every model actor reserve one (``num_cpus=1``)
#: and then mostly wait. The whole panel on one stack is the controller, 15 actors, and on 0.7 the ones
#: the stock client's keys deploy beside them. With 8, the eighth model's deployment stayed pending
#: ("Pending Demands: {'CPU': 1.0}") until it timed out (measured, 0.8 stack). What a machine holds is
#: bounded by memory (about 0.7 GiB per tiny-model actor: ``ndif panel``'s ``batches``), not by this.
RAY_CPU_SLOTS = 32

#: Where ndif's API (both generations) reaches Ray: Ray's client server inside the namespace.
RAY_CLIENT_ADDRESS = "ray://127.0.0.1:10001"

#: Longest temp dir Ray's deepest Unix socket path (70 bytes below it) fits the 107-byte limit with.
RAY_TEMP_MAX = 107 - 70


@dataclass(frozen=True)
class Generation:
    """One NDIF server generation: what it serves and what it runs in."""

    #: The nnsight line its clients speak (a key of :data:`nnsight_repro.lines.LINES`).
    line: str
    ndif: str
    #: The cached server environment (:mod:`nnsight_repro.ndif.server_env`).
    server_env: str
    #: The only project code that runs inside the server.
    adaptations: str
    #: Client environments that may run against it (the first is the default).
    clients: tuple
    #: Stack folder under the cache, and the namespace name's prefix.
    folder_name: str
    netns_prefix: str
    ray_ports: Dict[int, str]
    #: Fake GPUs advertised by default, and the fewest that work.
    gpus: int
    min_gpus: int
    #: nnsight flavours the server can run (0.0.1: the project's ``patched`` build too).
    servers: tuple = ("stock",)
    #: How far a remote value may be from the client's local float32 one (see :data:`BF16_ATOL`).
    atol: float = 0.0
    #: The dtype the server loads every model in. NDIF's own default is bfloat16 on both generations:
    #: ndif 0.0.1 sets it unconditionally (``BaseModelDeploymentArgs.dtype`` and
    #: ``torch.set_default_dtype(torch.bfloat16)`` in every model actor); ndif 0.1.2 reads
    #: ``NDIF_DEFAULT_DTYPE`` (default ``bfloat16``) and a deploy file's ``dtype``, which the 0.8 stack sets
    #: to float32 so its traces compare bit for bit. A model that cannot run in bfloat16
    #: (``PanelModel.fails_in_bfloat16``) fails on the 0.7 stack as it would on NDIF's default.
    dtype: str = "float32"


#: The dtype NDIF loads a model in unless told otherwise (see :attr:`Generation.dtype`): what ``preflight``
#: assumes of a server it cannot ask.
NDIF_DEFAULT_DTYPE = "bfloat16"

#: The 0.7 server's tolerance. ndif 0.0.1 loads every model in bfloat16 and makes it torch's default dtype
#: (ndif 0.1.2 computes in float32, as set here, on the same CPU torch: bit-identical, 0). bfloat16 keeps 8
#: significant bits: between 2 and 4, where the tiny panel models' largest layer-normed hidden values lie,
#: one unit in the last place is 2^-6 = 0.0156, and two layers of bf16 weights, matmuls and norms leave the
#: tiny BERT's final hidden state 0.037 (2.4 of those units) from float32 (GPT-2: 5e-4). 0.08 is five units
#: at the largest magnitude: above bf16 noise, far below what a different model gives (BERT rebuilt as
#: BertLMHeadModel attends causally, which moves every position but the last by O(1)). Values of larger
#: magnitude get the same five units at their own (``ndif.panel.tolerance``).
BF16_ATOL = 0.08


GENERATIONS: Dict[str, Generation] = {
    g.line: g for g in [
        Generation("0.8", ndif="0.1.2", server_env="ndif-server", adaptations=ADAPTATIONS,
                   clients=("upstream-0.8",), folder_name="ndif", netns_prefix="nnsr-ndif-",
                   ray_ports=RAY_PORTS, gpus=1, min_gpus=1),
        # 0.0.1 gives every deployment a GPU of its own; with fewer than four, a second model hot-swaps
        # the first to "cache" and the next request for the first fails ("Failed to look up actor").
        # One session of the negative control deploys up to four keys, so eight leave room.
        Generation("0.7", ndif="0.0.1", server_env="ndif-server-0.7", adaptations="nnsight_repro.ndif.adaptations_0_0_1",
                   clients=("main", "patched"), folder_name="ndif-0.7", netns_prefix="nnsr-ndif07-",
                   ray_ports=RAY_PORTS_0_0_1, gpus=8, min_gpus=4, servers=("stock", "patched"), atol=BF16_ATOL,
                   dtype="bfloat16"),
    ]
}


def generation(line: str) -> Generation:
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
    #: Which generation (by the nnsight line it serves), and for 0.7 which nnsight the server runs.
    line: str = "0.8"
    server: str = "stock"
    #: Server flavours adding packages (``--with multimolecule``; :mod:`server_packages`), sorted, no repeats.
    extras: tuple = ()
    #: A cap on the memory of every process of the stack, in MiB (its memory cgroup, :mod:`memcg`); None:
    #: no cap of its own (the cgroup still counts and reports OOM kills).
    memory_limit_mib: Optional[int] = None

    @property
    def generation(self) -> Generation:
        return generation(self.line)

    @property
    def client(self) -> str:
        """The client environment that speaks for this server: the generation's first (``upstream-0.8``),
        or on 0.7 the build the server runs (``main`` for stock, ``patched``): the keys ``up`` deploys
        at start are the ones it mints."""
        if self.line == "0.7":
            return {"stock": "main", "patched": "patched"}[self.server]
        return self.generation.clients[0]

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
            canonical = tuple(f.name for f in server_packages.flavours(self.extras))
        except server_packages.FlavourError as exc:
            raise ConfigError(str(exc)) from None
        if canonical != tuple(self.extras):
            raise ConfigError(f"extras {self.extras!r} must be sorted and without repeats ({canonical!r}); "
                              f"config.default() canonicalizes them.")
        if self.server not in gen.servers:
            raise ConfigError(f"server {self.server!r} is not a flavour of the {gen.line} stack; "
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
        """What every server process gets: ndif's settings on loopback, offline, with our adaptations.

        ``role``: ``"ray"`` for Ray's own processes (:data:`RAY_ENV` added), ``"api"`` for the API and
        the stores; 0.0.1 requires one (its two halves import different ``src`` packages), 0.1.2 also
        takes none (a deploy client).
        """
        if self.line == "0.7":
            return self._environ_0_0_1(venv_bin, role)
        # Without PYTHONDONTWRITEBYTECODE, as every environment's process (envs.Env.environ says why).
        base = {k: v for k, v in os.environ.items()
                if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RAY_ADDRESS", "PYTHONDONTWRITEBYTECODE"}
                and not k.startswith(("NDIF_", "RAY_", "GUNICORN_"))}
        env = {
            **base,
            # ndif's start scripts call `python`, `ray`, `gunicorn` by name.
            "PATH": f"{venv_bin}{os.pathsep}{base.get('PATH', '/usr/bin:/bin')}",
            # Ray workers inherit this, so they can import the adaptations module.
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            # An empty hub cache of our own: /status lists whatever it finds there as COLD models.
            "HF_HOME": str(self.folder / "hf_home"),
            "NDIF_HOME": str(self.home),
            "NDIF_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}",
            "NDIF_OBJECT_STORE_URL": f"http://127.0.0.1:{self.s3_port}",
            "NDIF_OBJECT_STORE_ACCESS_KEY": "testing",
            "NDIF_OBJECT_STORE_SECRET_KEY": "testing",
            "NDIF_API_URL": self.api_url,
            "NDIF_API_PORT": str(self.api_port),
            "NDIF_RAY_ADDRESS": RAY_CLIENT_ADDRESS,
            "NDIF_RAY_HEAD_PORT": "6385",
            "NDIF_RAY_TEMP_DIR": str(self.ray_temp),
            # gunicorn_conf binds 0.0.0.0; its control socket would land in ~/.gunicorn.
            "GUNICORN_CMD_ARGS": f"--bind 127.0.0.1:{self.api_port} --no-control-socket",
            "NDIF_DEFAULT_DTYPE": self.generation.dtype,
            # /status is served from a Redis cache; the default 60 s would hide a fresh deploy.
            "NDIF_STATUS_TTL_S": "2",
            "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            # Adaptations (each explained in the adaptations module).
            "RAY_OVERRIDE_RESOURCES": json.dumps(
                {"GPU": self.gpus, "CPU": RAY_CPU_SLOTS, "cuda_memory_bytes": 8_000_000_000 * self.gpus}),
            "NDIF_DEFAULT_MODEL_ACTOR_CLASS": f"{ADAPTATIONS}.CPUModelActor",
            "NDIF_CONTROLLER_IMPORT_PATH": f"{ADAPTATIONS}.ControllerActor",
            # Where the CPU model actor records what it built (built_log).
            paths.variable("NDIF_BUILT_LOG"): str(self.built_log),
        }
        if role == "ray":
            env.update(RAY_ENV)
        env.update(server_packages.environ(self.extras))
        env.update(self.extra_env)
        return env

    def _environ_0_0_1(self, venv_bin: Path, role: str) -> Dict[str, str]:
        """ndif 0.0.1's settings: what its CLI would hand its start scripts, pointed at loopback."""
        if role not in ("ray", "api"):
            raise ConfigError(f"role must be 'ray' or 'api' for the 0.0.1 stack, not {role!r}.")
        site = service_root(venv_bin)
        base = {k: v for k, v in os.environ.items()
                if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RAY_ADDRESS", "API_URL", "BROKER_URL",
                              "PYTHONDONTWRITEBYTECODE"}
                and not k.startswith(("NDIF_", "RAY_", "GUNICORN_", "OBJECT_STORE_", "COORDINATOR_"))}
        # The generated sitecustomize (and the patched nnsight) first; the project, so it imports the
        # adaptations; for the Ray half, ndif's ray service folder, so Ray workers import its `src`
        # (the API half gets its own `src` from gunicorn's working directory).
        path = [str(self.python_path_dir), str(ROOT)] + ([str(site / "ray")] if role == "ray" else [])
        env = {
            **base,
            "PATH": f"{venv_bin}{os.pathsep}{base.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": os.pathsep.join(path),
            "HOME": str(self.home),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HOME": str(self.folder / "hf_home"),
            # What `ndif start api` sets (DEV_MODE: no API keys, no version checks, no Postgres).
            "BROKER_URL": f"redis://127.0.0.1:{self.redis_port}/",
            "OBJECT_STORE_URL": f"http://127.0.0.1:{self.s3_port}",
            "OBJECT_STORE_ACCESS_KEY": "testing",
            "OBJECT_STORE_SECRET_KEY": "testing",
            "API_URL": self.api_url,
            "API_INTERNAL_PORT": str(self.api_port),
            "WORKERS": "1",
            "DEV_MODE": "true",
            # What `ndif start ray` sets; the dashboard on loopback instead of its 0.0.0.0.
            "RAY_HEAD_INTERNAL_PORT": "6380",
            "OBJECT_MANAGER_PORT": "8076",
            "RAY_DASHBOARD_HOST": "127.0.0.1",
            "RAY_DASHBOARD_INTERNAL_PORT": "8265",
            "RAY_DASHBOARD_GRPC_PORT": "8268",
            "RAY_SERVE_INTERNAL_PORT": "8267",
            "NDIF_CONTROLLER_IMPORT_PATH": self.generation.adaptations,
            "NDIF_MINIMUM_DEPLOYMENT_TIME_SECONDS": "0",
            "RAY_METRICS_GAUGE_EXPORT_INTERVAL_MS": "1000",
            "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "10",
            # The Ray session (and its Unix sockets) in the stack folder, not /tmp/ray.
            "RAY_TMPDIR": str(self.ray_temp),
            # /status is served from a Redis cache; the default 120 s would hide a fresh deploy.
            "COORDINATOR_STATUS_CACHE_FREQ_S": "2",
            "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            # Adaptations (each explained in the adaptations module): fake GPUs, and where the CPU
            # model actor records what it built.
            "RAY_OVERRIDE_RESOURCES": json.dumps(
                {"GPU": self.gpus, "CPU": RAY_CPU_SLOTS, "cuda_memory_bytes": 8_000_000_000 * self.gpus}),
            paths.variable("NDIF_BUILT_LOG"): str(self.built_log),
        }
        if role == "api":
            env["RAY_ADDRESS"] = RAY_CLIENT_ADDRESS
        else:
            env.update(RAY_ENV)
        env.update(server_packages.environ(self.extras))
        env.update(self.extra_env)
        return env


def service_root(venv_bin: Path) -> Path:
    """ndif 0.0.1's ``site-packages/src/services`` (its wheel installs a top-level ``src``)."""
    lib = Path(venv_bin).parent / "lib"
    for site in sorted(lib.glob("python3*/site-packages")):
        return site / "src" / "services"
    return lib / "python3" / "site-packages" / "src" / "services"


def default(folder: Optional[Path] = None, line: str = "0.8", extras=(), **overrides) -> StackConfig:
    """The project's stack of ``line``: ``<cache>/ndif`` (0.8) or ``<cache>/ndif-0.7``, ports overridable
    through ``NNSIGHT_REPRO_NDIF_*_PORT``.

    A flavoured stack (``extras``, e.g. ``("multimolecule",)``) has a folder of its own
    (``<cache>/ndif+multimolecule``), so its own namespace, state and minted keys: asking for one never
    finds, reuses or stops a plain stack of the same line, and the other way round.
    """
    gen = generation(line)
    try:
        extras = tuple(f.name for f in server_packages.flavours(extras))
    except server_packages.FlavourError as exc:
        raise ConfigError(str(exc)) from None
    overrides.setdefault("gpus", gen.gpus)
    for service in ("redis", "s3", "api"):
        value = paths.setting(f"NDIF_{service.upper()}_PORT")
        if value and f"{service}_port" not in overrides:
            try:
                overrides[f"{service}_port"] = int(value)
            except ValueError:
                raise ConfigError(f"{paths.variable(f'NDIF_{service.upper()}_PORT')}={value!r} is not a port number.") from None
    name = "+".join([gen.folder_name, *extras])
    return StackConfig(folder=folder or cache_dir() / name, line=line, extras=extras, **overrides)
