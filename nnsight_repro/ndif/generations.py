"""The two NDIF server generations a local stack can be, and which client runs against which.

One class per generation, each with everything in which that generation differs: what it serves, the
ports Ray fixes, the environment its processes get, its processes themselves, how models get deployed,
how far its values may be from a client's local ones, and how a command names it. Nothing else in the
project branches on which generation a stack is: it asks the stack's :class:`Generation`.

- ``0.8``: PyPI ``ndif`` 0.1.2, serving nnsight 0.8 clients (:class:`Ndif012`, the default);
- ``0.7``: PyPI ``ndif`` 0.0.1 plus backports, serving nnsight 0.7.0 clients, with the server's nnsight
  either stock 0.7.0 or the project's ``patched`` build (:class:`Ndif001`).

:data:`PAIRINGS` is the one declaration of which client environment runs against which generation and
server build; the panel, the negative control, the probe script, :attr:`Generation.clients` and
:meth:`Generation.client_for` all derive from it.

Does not own where a stack lives, its ports or its checks (:mod:`.config`), nor how the processes are
started (:mod:`.services`). What each adaptation bridges is documented in its generation's adaptations
module (:attr:`Generation.adaptations`).

Stdlib only.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

from .. import ROOT, settings
from . import deploy, server_packages

ADAPTATIONS = "nnsight_repro.ndif.adaptations_0_1_2"

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
#: magnitude get the same five units at their own (:meth:`Ndif001.tolerance`).
BF16_ATOL = 0.08

#: BF16_ATOL is five bfloat16 units in the last place at the tiny models' largest magnitudes
#: (2-4: 5 x 2^-6). AntiBERTy's real weights give logits up to ~34, where one unit is 2^-2: the same five
#: units there are 1.25 (its write's logits came back 0.169 from float32, measured). So on 0.7 a value
#: is within tolerance when it is within five units at its own largest local magnitude, never less than
#: 0.08; a rebuilt-as-another-class model still moves values by O(magnitude).
BF16_UNITS = 5


class ServerProcess(NamedTuple):
    """One of a generation's own server processes, as :mod:`.services` starts it (its log: ``<name>.log``)."""
    name: str
    argv: List[str]
    port: int
    #: Where it runs (None: the stack folder), and its part of the server (0.0.1: "ray" or "api").
    cwd: Optional[Path] = None
    role: str = ""


@dataclass(frozen=True)
class Generation:
    """One NDIF server generation: what it serves and what it runs in. A subclass per generation says how
    its processes are started and told, and every other way in which it differs."""

    #: The nnsight line its clients speak (a key of :data:`nnsight_repro.lines.LINES`).
    line: str
    ndif: str
    #: The cached server environment (:mod:`nnsight_repro.ndif.server_env`).
    server_env: str
    #: The only project code that runs inside the server.
    adaptations: str
    #: Stack folder under the cache, and the namespace name's prefix.
    folder_name: str
    netns_prefix: str
    #: Ports Ray takes inside the namespace whatever we configure: GCS, object manager, client server,
    #: dashboard, dashboard agent gRPC and HTTP, metrics.
    ray_ports: Dict[int, str]
    #: Fake GPUs advertised by default, and the fewest that work.
    gpus: int
    min_gpus: int
    #: What ``up`` deploys unless told otherwise.
    served: Tuple[str, ...]
    #: Its server builds (which nnsight the server runs): the release first (0.0.1: the project's ``patched``
    #: build too).
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

    #: What a command adds to name this generation's stack (``ndif up``, ``ndif down``): nothing for the default.
    line_option = ""
    #: The ``role`` values :meth:`environ` takes; None: any (only ``"ray"`` adds something).
    roles = None
    #: Whether a model the server was not given at start deploys on its first request, under whatever key the
    #: client sends (else the server serves only what was deployed: ``up``'s models, ``ndif deploy``).
    deploys_on_request = False
    #: Whether ``ndif deploy`` can deploy a model once more on a running stack, reporting per model the
    #: exception it failed with.
    redeploys = True
    #: Whether every server process imports a generated ``sitecustomize.py`` first (:attr:`StackConfig.python_path_dir`).
    needs_python_path = False
    #: Whether the server's ``/status`` fails (every time) without a Hub cache folder to scan.
    status_needs_hub_cache = False
    #: Whether the server answers ``/env`` (its packages), so a client can be told a model's package is
    #: missing before it sends a request.
    answers_env = True
    #: What the reports say the server is.
    note = ""

    # Pairings -------------------------------------------------------------------

    @property
    def pairings(self) -> Tuple["Pairing", ...]:
        return tuple(p for p in PAIRINGS if p.line == self.line)

    @property
    def clients(self) -> Tuple[str, ...]:
        """Client environments that may run against it, as :data:`PAIRINGS` orders them (the first is the default)."""
        return tuple(dict.fromkeys(p.client for p in self.pairings))

    def client_for(self, server: str) -> str:
        """The client environment that speaks for a server running ``server`` nnsight: the one of the same
        build (``upstream-0.8``; on 0.7 ``main`` for stock, ``patched``): ``up`` deploys the keys it mints."""
        return next(p.client for p in self.pairings if p.server == server and p.same_build)

    # What differs ---------------------------------------------------------------

    def minted_file(self, client: str) -> str:
        """Where in the stack folder ``client``'s minted keys are remembered."""
        return f"minted-{client}.json"

    def tolerance(self, max_abs_local: Optional[float]) -> float:
        """How far a remote value whose local float32 values reach ``max_abs_local`` may be from them."""
        return self.atol

    def tolerance_note(self) -> str:
        """The tolerance in words, for a report."""
        raise NotImplementedError

    def processes(self, venv_bin: Path, api_port: int) -> List[ServerProcess]:
        """The server's own processes (Ray with ndif's controller, then the API), besides the stores."""
        raise NotImplementedError

    def environ(self, cfg, venv_bin: Path, role: str) -> Dict[str, str]:
        """What every server process of the stack ``cfg`` (a :class:`config.StackConfig`) gets; see
        :meth:`config.StackConfig.environ`."""
        raise NotImplementedError


class Ndif012(Generation):
    """PyPI ndif 0.1.2, serving nnsight 0.8 clients: the default."""

    note = "PyPI ndif 0.1.2"

    def minted_file(self, client: str) -> str:
        # One client speaks for this stack, so the file needs no client in its name (0.0.1 has two, whose
        # keys differ).
        return "minted.json"

    def tolerance_note(self) -> str:
        return "0, bit-identical: the server computes in float32"

    def processes(self, venv_bin: Path, api_port: int) -> List[ServerProcess]:
        # ndif's own launchers, in the foreground: `ndif start -f ray` runs ndif's Ray start script (Ray
        # head + the controller), `ndif start -f api` runs gunicorn with ndif's config.
        return [ServerProcess("ray", [str(venv_bin / "ndif"), "start", "--foreground", "ray"], 6385),
                ServerProcess("api", [str(venv_bin / "ndif"), "start", "--foreground", "api"], api_port)]

    def environ(self, cfg, venv_bin: Path, role: str) -> Dict[str, str]:
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
            **settings.HF_OFFLINE,
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            # An empty hub cache of our own: /status lists whatever it finds there as COLD models.
            "HF_HOME": str(cfg.folder / "hf_home"),
            "NDIF_HOME": str(cfg.home),
            "NDIF_REDIS_URL": f"redis://127.0.0.1:{cfg.redis_port}",
            "NDIF_OBJECT_STORE_URL": f"http://127.0.0.1:{cfg.s3_port}",
            "NDIF_OBJECT_STORE_ACCESS_KEY": "testing",
            "NDIF_OBJECT_STORE_SECRET_KEY": "testing",
            "NDIF_API_URL": cfg.api_url,
            "NDIF_API_PORT": str(cfg.api_port),
            "NDIF_RAY_ADDRESS": RAY_CLIENT_ADDRESS,
            "NDIF_RAY_HEAD_PORT": "6385",
            "NDIF_RAY_TEMP_DIR": str(cfg.ray_temp),
            # gunicorn_conf binds 0.0.0.0; its control socket would land in ~/.gunicorn.
            "GUNICORN_CMD_ARGS": f"--bind 127.0.0.1:{cfg.api_port} --no-control-socket",
            "NDIF_DEFAULT_DTYPE": self.dtype,
            # /status is served from a Redis cache; the default 60 s would hide a fresh deploy.
            "NDIF_STATUS_TTL_S": "2",
            "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            # Adaptations (each explained in the adaptations module).
            "RAY_OVERRIDE_RESOURCES": json.dumps(
                {"GPU": cfg.gpus, "CPU": RAY_CPU_SLOTS, "cuda_memory_bytes": 8_000_000_000 * cfg.gpus}),
            "NDIF_DEFAULT_MODEL_ACTOR_CLASS": f"{ADAPTATIONS}.CPUModelActor",
            "NDIF_CONTROLLER_IMPORT_PATH": f"{ADAPTATIONS}.ControllerActor",
            # Where the CPU model actor records what it built (built_log).
            settings.variable("NDIF_BUILT_LOG"): str(cfg.built_log),
        }
        if role == "ray":
            env.update(RAY_ENV)
        env.update(server_packages.environ(cfg.extras))
        env.update(cfg.extra_env)
        return env


class Ndif001(Generation):
    """PyPI ndif 0.0.1 plus backports, serving nnsight 0.7.0 clients, stock or patched nnsight on the server."""

    line_option = " --line 0.7"
    # Its two halves import different `src` packages.
    roles = ("ray", "api")
    deploys_on_request = True
    # Its `ndif deploy` asks the Hub for the key: there is no second way in to report through.
    redeploys = False
    needs_python_path = True
    status_needs_hub_cache = True
    # It predates /env and answers it 404.
    answers_env = False
    note = ("PyPI ndif 0.0.1 plus the backports in nnsight_repro/ndif/adaptations_0_0_1.py; not the server "
            "production ran for nnsight 0.7.0")

    def tolerance(self, max_abs_local: Optional[float]) -> float:
        if not max_abs_local:
            return self.atol
        # bfloat16 keeps 8 significant bits: one unit in the last place at magnitude m is 2^(floor(log2 m) - 7).
        return max(self.atol, BF16_UNITS * 2.0 ** (math.floor(math.log2(max_abs_local)) - 7))

    def tolerance_note(self) -> str:
        return (f"the server computes in bfloat16: {BF16_UNITS} bfloat16 units at each value's largest local "
                f"magnitude, at least {self.atol} (nnsight_repro/ndif/generations.py Ndif001.tolerance(), "
                f"BF16_ATOL)")

    def processes(self, venv_bin: Path, api_port: int) -> List[ServerProcess]:
        # ndif 0.0.1's start scripts, from their own folders (they run `python -m src...` and gunicorn
        # with `src/gunicorn.conf.py` relative to it), not through its CLI: the CLI only sets their
        # environment (environ sets the same), and on Ctrl-C it runs `ray stop`, which stops
        # every Ray process on the host.
        services = service_root(venv_bin)
        return [ServerProcess("ray", ["bash", str(services / "ray" / "start.sh")], 6380, services / "ray", "ray"),
                ServerProcess("api", ["bash", str(services / "api" / "start.sh")], api_port, services / "api", "api")]

    def environ(self, cfg, venv_bin: Path, role: str) -> Dict[str, str]:
        """ndif 0.0.1's settings: what its CLI would hand its start scripts, pointed at loopback."""
        site = service_root(venv_bin)
        base = {k: v for k, v in os.environ.items()
                if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RAY_ADDRESS", "API_URL", "BROKER_URL",
                              "PYTHONDONTWRITEBYTECODE"}
                and not k.startswith(("NDIF_", "RAY_", "GUNICORN_", "OBJECT_STORE_", "COORDINATOR_"))}
        # The generated sitecustomize (and the patched nnsight) first; the project, so it imports the
        # adaptations; for the Ray half, ndif's ray service folder, so Ray workers import its `src`
        # (the API half gets its own `src` from gunicorn's working directory).
        path = [str(cfg.python_path_dir), str(ROOT)] + ([str(site / "ray")] if role == "ray" else [])
        env = {
            **base,
            "PATH": f"{venv_bin}{os.pathsep}{base.get('PATH', '/usr/bin:/bin')}",
            "PYTHONPATH": os.pathsep.join(path),
            "HOME": str(cfg.home),
            **settings.HF_OFFLINE,
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HOME": str(cfg.folder / "hf_home"),
            # What `ndif start api` sets (DEV_MODE: no API keys, no version checks, no Postgres).
            "BROKER_URL": f"redis://127.0.0.1:{cfg.redis_port}/",
            "OBJECT_STORE_URL": f"http://127.0.0.1:{cfg.s3_port}",
            "OBJECT_STORE_ACCESS_KEY": "testing",
            "OBJECT_STORE_SECRET_KEY": "testing",
            "API_URL": cfg.api_url,
            "API_INTERNAL_PORT": str(cfg.api_port),
            "WORKERS": "1",
            "DEV_MODE": "true",
            # What `ndif start ray` sets; the dashboard on loopback instead of its 0.0.0.0.
            "RAY_HEAD_INTERNAL_PORT": "6380",
            "OBJECT_MANAGER_PORT": "8076",
            "RAY_DASHBOARD_HOST": "127.0.0.1",
            "RAY_DASHBOARD_INTERNAL_PORT": "8265",
            "RAY_DASHBOARD_GRPC_PORT": "8268",
            "RAY_SERVE_INTERNAL_PORT": "8267",
            "NDIF_CONTROLLER_IMPORT_PATH": self.adaptations,
            "NDIF_MINIMUM_DEPLOYMENT_TIME_SECONDS": "0",
            "RAY_METRICS_GAUGE_EXPORT_INTERVAL_MS": "1000",
            "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "10",
            # The Ray session (and its Unix sockets) in the stack folder, not /tmp/ray.
            "RAY_TMPDIR": str(cfg.ray_temp),
            # /status is served from a Redis cache; the default 120 s would hide a fresh deploy.
            "COORDINATOR_STATUS_CACHE_FREQ_S": "2",
            "RAY_USAGE_STATS_ENABLED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            # Adaptations (each explained in the adaptations module): fake GPUs, and where the CPU
            # model actor records what it built.
            "RAY_OVERRIDE_RESOURCES": json.dumps(
                {"GPU": cfg.gpus, "CPU": RAY_CPU_SLOTS, "cuda_memory_bytes": 8_000_000_000 * cfg.gpus}),
            settings.variable("NDIF_BUILT_LOG"): str(cfg.built_log),
        }
        if role == "api":
            env["RAY_ADDRESS"] = RAY_CLIENT_ADDRESS
        else:
            env.update(RAY_ENV)
        env.update(server_packages.environ(cfg.extras))
        env.update(cfg.extra_env)
        return env


GENERATIONS: Dict[str, Generation] = {
    g.line: g for g in [
        Ndif012("0.8", ndif="0.1.2", server_env="ndif-server", adaptations=ADAPTATIONS, folder_name="ndif",
                netns_prefix="nnsr-ndif-", gpus=1, min_gpus=1, served=tuple(deploy.SERVED),
                # ndif's start script fixes them.
                ray_ports={6385: "ray gcs", 8076: "ray object manager", 10001: "ray client server",
                           8265: "ray dashboard", 52366: "ray dashboard agent (grpc)",
                           52365: "ray dashboard agent (http)", 8080: "ray metrics"}),
        # 0.0.1 gives every deployment a GPU of its own; with fewer than four, a second model hot-swaps
        # the first to "cache" and the next request for the first fails ("Failed to look up actor").
        # One session of the negative control deploys up to four keys, so eight leave room.
        # What it deploys as it starts is the decoder control, whose key every 0.7 client sends alike. A
        # masked LM's key differs between stock and patched clients (that is the negative control), so each
        # deploys on its first request, under the key that client sent (ndif 0.0.1 deploys any key it is sent).
        Ndif001("0.7", ndif="0.0.1", server_env="ndif-server-0.7", adaptations="nnsight_repro.ndif.adaptations_0_0_1",
                folder_name="ndif-0.7", netns_prefix="nnsr-ndif07-", gpus=8, min_gpus=4, served=("gpt2",),
                servers=("stock", "patched"), atol=BF16_ATOL, dtype="bfloat16",
                # Its ray/start.sh takes them from the variables its CLI would set (environ sets the CLI's
                # defaults); Ray's client server and agent HTTP port keep Ray's defaults.
                ray_ports={6380: "ray gcs", 8076: "ray object manager", 10001: "ray client server",
                           8265: "ray dashboard", 8268: "ray dashboard agent (grpc)",
                           52365: "ray dashboard agent (http)", 8267: "ray metrics"}),
    ]
}


# Which client runs against which server -------------------------------------------------------------

@dataclass(frozen=True)
class Pairing:
    """A client environment against a local stack generation whose server runs one nnsight build."""

    #: Its one name: the probe script's ``--pairing``, and how results name it.
    name: str
    #: The client's environment (its nnsight).
    client: str
    #: The generation that serves it (by the nnsight line it speaks), and the nnsight its server runs:
    #: ``stock`` (the release) or ``patched`` (the project's build of the series).
    line: str
    server: str
    #: What the pairing shows, for the results.
    shows: str
    #: Client and server run the same nnsight build: the client speaks for that server (its keys are
    #: the ones ``up`` deploys; :meth:`Generation.client_for`).
    same_build: bool = False
    #: Its role in ``ndif panel`` ("required" or "negative control"; None: not in the panel, whose server
    #: is always the generation's stock one).
    panel_role: Optional[str] = None
    #: Whether the probe script runs it (a pairing of ``probes.toml``'s expectations).
    probed: bool = True

    @property
    def generation(self) -> Generation:
        return GENERATIONS[self.line]


#: Every pairing, once. The negative control runs all of the 0.7 generation's (client {stock, patched} x
#: server {stock, patched}); the one that matters most is the patched client against the stock server,
#: because that is what the public NDIF runs. The order is the probe script's and each generation's
#: client order (its first client is its default).
PAIRINGS: Tuple[Pairing, ...] = (
    Pairing("main", "main", "0.7", "stock", "nnsight 0.7.0 as released on both sides (what NDIF users run)",
            same_build=True, panel_role="negative control"),
    Pairing("patched-server-only", "main", "0.7", "patched",
            "the series on the server only, against a stock nnsight 0.7.0 client", probed=False),
    Pairing("patched", "patched", "0.7", "patched", "the series on both sides", same_build=True),
    # What a researcher gets today: the fixed client against the stock server the public NDIF runs
    # (the series keeps the synthesized class loadable there: it travels by value).
    Pairing("patched-client-only", "patched", "0.7", "stock",
            "the series on the client only, against a stock nnsight 0.7.0 server", panel_role="required"),
    Pairing("upstream-0.8", "upstream-0.8", "0.8", "stock", "nnsight 0.8.1 against ndif 0.1.2", same_build=True,
            panel_role="required"),
)


def service_root(venv_bin: Path) -> Path:
    """ndif 0.0.1's ``site-packages/src/services`` (its wheel installs a top-level ``src``)."""
    lib = Path(venv_bin).parent / "lib"
    for site in sorted(lib.glob("python3*/site-packages")):
        return site / "src" / "services"
    return lib / "python3" / "site-packages" / "src" / "services"
