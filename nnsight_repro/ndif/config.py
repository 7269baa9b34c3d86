"""Where a local NDIF stack lives and what every one of its processes is told.

One stack per project cache (``NNSIGHT_REPRO_CACHE``): its folder is ``<cache>/ndif`` and its
namespace name carries a digest of that folder, so two checkouts with separate caches can each run a
stack (each in its own namespace, so even the same ports do not collide), while a second ``up`` on the
same cache finds the first.

The environment is ndif's own settings (``NDIF_*``, read by its services and CLI), set to loopback
addresses, plus the few adaptations that let it run on a CPU-only, offline machine; what each
adaptation bridges is documented in :mod:`nnsight_repro.ndif.adaptations_0_1_2`.

Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

from .. import ROOT
from ..paths import cache_dir

ADAPTATIONS = "nnsight_repro.ndif.adaptations_0_1_2"

#: Ports Ray takes inside the namespace whatever we configure (ndif's start script fixes them):
#: GCS, object manager, client server, dashboard, dashboard agent gRPC and HTTP, metrics.
RAY_PORTS = {6385: "ray gcs", 8076: "ray object manager", 10001: "ray client server", 8265: "ray dashboard",
             52366: "ray dashboard agent (grpc)", 52365: "ray dashboard agent (http)", 8080: "ray metrics"}


class ConfigError(Exception):
    """The stack's settings contradict each other; the message names the setting."""


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

    # Folders ---------------------------------------------------------------

    @property
    def netns(self) -> str:
        # Namespace names are file names under /var/run/netns; keep them short and stable.
        return "nnsr-ndif-" + hashlib.sha256(str(self.folder).encode()).hexdigest()[:8]

    @property
    def logs(self) -> Path:
        return self.folder / "logs"

    @property
    def state_file(self) -> Path:
        return self.folder / "state.json"

    @property
    def ray_temp(self) -> Path:
        # Ray puts Unix sockets under its temp dir, and socket paths are limited to 107 bytes.
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

    # Checks ------------------------------------------------------------------

    def validate(self) -> None:
        """Every port distinct and none of Ray's: otherwise a service would find its port taken."""
        ours = {"redis": self.redis_port, "s3": self.s3_port, "api": self.api_port}
        seen: Dict[int, str] = {}
        for service, port in ours.items():
            if not 1 <= port <= 65535:
                raise ConfigError(f"{service} port {port} is not a TCP port.")
            if port in RAY_PORTS:
                raise ConfigError(f"{service} port {port} is already taken inside the stack by "
                                  f"{RAY_PORTS[port]} (ndif's Ray start script fixes it); choose another.")
            if port in seen:
                raise ConfigError(f"port {port} is configured for both {seen[port]} and {service}; "
                                  f"each service needs its own.")
            seen[port] = service
        if self.gpus < 1:
            raise ConfigError("gpus must be at least 1: ndif's controller places models only on GPU nodes.")
        if len(str(self.ray_temp)) > 60:
            raise ConfigError(f"the stack folder {self.folder} is too long a path for Ray's Unix sockets "
                              f"(its temp dir must stay under 60 characters); set NNSIGHT_REPRO_CACHE shorter.")

    # The environment ---------------------------------------------------------

    def environ(self, venv_bin: Path) -> Dict[str, str]:
        """What every server process gets: ndif's settings on loopback, offline, with our adaptations."""
        base = {k: v for k, v in os.environ.items()
                if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RAY_ADDRESS"}
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
            "NDIF_RAY_ADDRESS": "ray://127.0.0.1:10001",
            "NDIF_RAY_HEAD_PORT": "6385",
            "NDIF_RAY_TEMP_DIR": str(self.ray_temp),
            # gunicorn_conf binds 0.0.0.0; its control socket would land in ~/.gunicorn.
            "GUNICORN_CMD_ARGS": f"--bind 127.0.0.1:{self.api_port} --no-control-socket",
            "NDIF_DEFAULT_DTYPE": "float32",
            # /status is served from a Redis cache; the default 60 s would hide a fresh deploy.
            "NDIF_STATUS_TTL_S": "2",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # Adaptations (each explained in the adaptations module).
            "RAY_OVERRIDE_RESOURCES": json.dumps(
                {"GPU": self.gpus, "CPU": 8, "cuda_memory_bytes": 8_000_000_000 * self.gpus}),
            "NDIF_DEFAULT_MODEL_ACTOR_CLASS": f"{ADAPTATIONS}.CPUModelActor",
            "NDIF_CONTROLLER_IMPORT_PATH": f"{ADAPTATIONS}.ControllerActor",
        }
        env.update(self.extra_env)
        return env


def default(folder: Optional[Path] = None, **overrides) -> StackConfig:
    """The project's stack: ``<cache>/ndif``, ports overridable through ``NNSIGHT_REPRO_NDIF_*_PORT``."""
    for service in ("redis", "s3", "api"):
        value = os.environ.get(f"NNSIGHT_REPRO_NDIF_{service.upper()}_PORT")
        if value and f"{service}_port" not in overrides:
            try:
                overrides[f"{service}_port"] = int(value)
            except ValueError:
                raise ConfigError(f"NNSIGHT_REPRO_NDIF_{service.upper()}_PORT={value!r} is not a port number.") from None
    return StackConfig(folder=folder or cache_dir() / "ndif", **overrides)
