"""The processes a stack runs, each started in its namespace and memory cgroup, and the waits on them.

Owns :class:`Service` (one server process: its command, port, log, and how its death is reported), the
list of a generation's services (:func:`services_of`), the ports check before anything starts, the 0.0.1
server's ``pythonpath`` folder (:func:`prepare_python_path`), :func:`wait` (poll until ready, failing early
on a dead service or a memory watch), and reading the services' logs, Ray's start line and its GCS's known
start-up race among them.

Does not own the order of the start or the state (:mod:`.stack`), nor what the processes are told
(:meth:`config.StackConfig.environ`).

Stdlib only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .. import ROOT, channel, envs
from . import config as configuration
from . import memcg, netns, server_env
from .errors import RayStartRace, StackError
from .health import probe


# The logs ---------------------------------------------------------------------------------------------

#: What ``ray start`` prints once the head runs (in the ray service's log).
RAY_STARTED = "Ray runtime started."


#: What Ray 2.50's GCS (the 0.7 server's Ray) logs as it aborts when two of its start-up paths both start its
#: event exporter: a race, seen on a busy machine and gone on the next start; fixed in a later Ray
#: ("Fixed ... should be called only once error (#57917)", ray-project/ray; also #60073).
RAY_START_RACE = "RayEventRecorder::StartExportingEvents() should be called only once"


def check_ray_start(cfg: configuration.StackConfig) -> None:
    """Raise :class:`RayStartRace` when Ray's GCS log shows :data:`RAY_START_RACE`: the stack cannot come up
    on this start, and waiting for it would only time out."""
    # 0.0.1's start script puts Ray's sessions under <temp>/ray, 0.1.2's directly under <temp>.
    logs = [*cfg.ray_temp.glob("session_*/logs/gcs_server.*"), *cfg.ray_temp.glob("ray/session_*/logs/gcs_server.*")]
    for log in sorted(logs):
        if RAY_START_RACE in read_log(log):
            raise RayStartRace(f"Ray's GCS aborted as it started ({RAY_START_RACE}: a race in Ray 2.50, fixed in "
                               f"later Rays; {log}).")


def read_log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def quoted_log(path: Path) -> str:
    return f"Last lines of {path}:\n{log_tail(path)}"


def log_tail(path: Path, lines: int = 12) -> str:
    text = read_log(path).strip().splitlines()
    if not text and not path.exists():
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])




# The services ----------------------------------------------------------------------------------------

class Service:
    def __init__(self, name: str, argv: List[str], port: Optional[int], log: Path,
                 cwd: Optional[Path] = None, role: str = ""):
        self.name, self.argv, self.port, self.log = name, argv, port, log
        #: Where it runs (default: the stack folder), and its part of the server (0.0.1: "ray" or "api").
        self.cwd, self.role = cwd, role
        self.process: Optional[subprocess.Popen] = None

    def start(self, cfg: configuration.StackConfig, env: Dict[str, str], group: Optional[memcg.Cgroup]) -> None:
        argv = netns.command(cfg.netns, self.argv)
        if group:
            # Joined outside the namespace: `ip netns exec` mounts a sysfs of its own, without the cgroup mounts.
            argv = memcg.command(group, argv)
        with open(self.log, "ab") as log:
            # start_new_session: a Ctrl-C in the terminal that ran `up` must not reach the stack;
            # `down` stops it.
            self.process = subprocess.Popen(argv, env=env, cwd=self.cwd or cfg.folder,
                                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)

    def check_alive(self) -> None:
        if self.process is None or self.process.poll() is None:
            return
        tail = log_tail(self.log)
        if "Address already in use" in tail or "address already in use" in tail:
            raise StackError(f"{self.name} could not start: port {self.port} is already taken inside the stack's "
                             f"namespace. Log ({self.log}):\n{tail}")
        raise StackError(f"{self.name} exited with code {self.process.returncode} during start. {quoted_log(self.log)}")


def services_of(cfg: configuration.StackConfig, env: envs.Env) -> List[Service]:
    """Every process of the stack, in the order ``up`` starts them: the stores, then the server's own."""
    redis = server_env.redis_server()
    bin_ = env.path / "venv" / "bin"
    stores = [
        Service("redis", [redis, "--bind", "127.0.0.1", "--port", str(cfg.redis_port), "--save", "",
                          "--appendonly", "no", "--daemonize", "no", "--dir", str(cfg.home)],
                cfg.redis_port, cfg.logs / "redis.log"),
        Service("s3", [str(bin_ / "moto_server"), "-H", "127.0.0.1", "-p", str(cfg.s3_port)],
                cfg.s3_port, cfg.logs / "s3.log"),
    ]
    # The generation's own: Ray (head, then ndif's controller) and the API.
    return stores + [Service(p.name, p.argv, p.port, cfg.logs / f"{p.name}.log", cwd=p.cwd, role=p.role)
                     for p in cfg.generation.processes(bin_, cfg.api_port)]


def prepare_python_path(cfg: configuration.StackConfig, env: envs.Env) -> dict:
    """0.0.1: the folder first on every server process's path: the generated ``sitecustomize.py`` and,
    for the patched server build, links to the ``patched`` environment's installed nnsight (package and
    metadata), so the server imports exactly that build; what it imports is checked, not assumed."""
    folder = cfg.python_path_dir
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    module = cfg.generation.adaptations
    (folder / "sitecustomize.py").write_text(
        "# Generated by nnsight_repro.ndif.services: loads the ndif 0.0.1 adaptations in every server process.\n"
        f"import {module} as _adaptations\n"
        "_adaptations.install()\n")
    expected = env.path
    if cfg.server == "patched":
        patched = envs.ensure("patched")
        site = next((patched.path / "venv" / "lib").glob("python3*/site-packages"))
        links = [site / "nnsight", *site.glob("nnsight-*.dist-info")]
        for target in links:
            os.symlink(target, folder / target.name)
        expected = patched.path
    try:
        found = channel.run_one([str(env.python), "-m", "nnsight_repro.ndif.server_facts", "nnsight"],
                                env=cfg.environ(env.path / "venv" / "bin", role="ray"), cwd=ROOT, timeout=120,
                                what=f"the {cfg.server} server's environment {env.name!r} (where nnsight imports from)")
    except channel.ChannelError as exc:
        raise StackError(f"The {cfg.server} server's Python cannot import nnsight: {exc}") from None
    if not found["file"].startswith(str(expected) + os.sep) or not found["adaptations"]:
        raise StackError(f"The {cfg.server} server would import nnsight from {found['file']} (expected under "
                         f"{expected}), adaptations loaded: {found['adaptations']}.")
    return found


def ensure_ports_free(cfg: configuration.StackConfig, services: List[Service]) -> None:
    ports = [str(s.port) for s in services if s.port]
    taken = [p for p, state in probe(cfg, "ports", *ports).items() if state == "listening"]
    if taken:
        owners = {str(s.port): s.name for s in services}
        raise StackError(f"Port(s) {', '.join(taken)} (for {', '.join(owners[p] for p in taken)}) are already "
                         f"taken inside namespace {cfg.netns}; something else runs there. "
                         f"`nnsight-repro ndif down` clears the namespace.")


def wait(what: str, ready: Callable[[], object], services: List[Service], timeout: float,
          interval: float = 0.5, watch: Callable[[], None] = lambda: None, logs: Sequence[Path] = ()):
    """Poll ``ready`` until it returns something truthy; fail early if a service dies or ``watch`` raises.

    A timeout quotes the end of each of ``logs``: the next ``up`` clears the logs, so the error is where
    what the services were doing survives.
    """
    deadline = time.monotonic() + timeout
    while True:
        # Memory first: a service the kernel killed for want of memory is reported as that, not as a crash.
        watch()
        for service in services:
            service.check_alive()
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise StackError(f"Timed out after {timeout:.0f} s waiting for {what}."
                             + "".join(f" {quoted_log(log)}" for log in logs))
        time.sleep(interval)

