"""A local NDIF stack: ``up``, ``down``, ``status``, and running a client against it.

Two generations (:mod:`config`): ndif 0.1.2 for nnsight 0.8 clients (the default, described first),
and ndif 0.0.1 for nnsight 0.7.0 clients (``line="0.7"``, described at the end).

``up`` brings the whole stack up from nothing (building its environment if needed) inside a private
network namespace: Redis (queue, small results), moto as the S3 store (large results), ndif's Ray head
and controller (``ndif start --foreground ray``) and ndif's API (``ndif start --foreground api``). The
controller deploys the panel models as it starts (``NDIF_DEPLOYMENTS``, under the keys the client mints;
see :mod:`deploy`), and ``up`` returns once ``/status`` shows every one HOT; a model that never shows up
is deployed once more through ``ndif deploy``, which names the exception it failed with.
Foreground starts, because then each service is a process this module started and watches: one that
exits during ``up`` is reported with the end of its log instead of being waited on.

Every service runs in the stack's memory cgroup (:mod:`memcg`; capped by ``--memory-limit``, uncapped by
default), and every wait of ``up`` and of a deploy watches it (:class:`MemoryWatch`): when the kernel kills a
process of the stack for want of memory, or the stack thrashes at its limit, the wait ends at once with
:class:`OutOfMemory`, which says so, instead of timing out on a model actor that is gone or stuck. A start on
which Ray's GCS aborts on its known race (:data:`RAY_START_RACE`) ends as soon as its log shows it, and ``up``
starts once more.

A process that uses a stack for longer than one call (a test session, a lane job, a panel batch, the probe
script's local stacks) holds its folder's :func:`lease` meanwhile, so a second such process on the same cache
waits for the first instead of bringing down or replacing a stack the first still reads. ``up``, ``down`` and
``status`` themselves take no lease: a stack a developer started with ``ndif up`` stays theirs to stop.

``down`` kills exactly the processes in the namespace (TERM, then KILL), deletes it and removes the cgroup;
it never runs ``ray stop`` or ``ndif stop``, which kill every Ray process on the host. It is safe to call at
any time, also after a failed or half-finished ``up``, and ``up`` calls it itself when it fails.

Logs stay in ``<cache>/ndif/logs`` until the next ``up`` (Ray's own are under ``<cache>/ndif/ray``).

The 0.7 generation differs in what runs, not in how: Redis and moto as above; ndif 0.0.1's own
``ray/start.sh`` (Ray head, then the controller, which is :mod:`adaptations_0_0_1`) and ``api/start.sh``
(gunicorn and its queue dispatcher), run directly with the environment ndif's CLI would give them. Every
server process first imports a generated ``sitecustomize.py`` that loads the adaptations; for the
``patched`` server flavour the ``patched`` environment's own nnsight build is linked in front of the
server's stock one. The controller deploys GPT-2 as it starts (:data:`deploy.SERVED_07`, under the key
the server flavour's own client mints) and ``up`` waits until it is HOT; any other key deploys on its
first request, under whatever key the client sends (which is what the negative control is about). Each
model actor records what it built in ``logs/built.jsonl``.

Stdlib only: this runs in the test process (a 0.7 client) and in the CLI; server code runs in the server
environment, client code in a client environment (``upstream-0.8``; ``main`` or ``patched`` for the 0.7
stack), both as subprocesses in the namespace.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .. import ROOT, channel, envs, fsutil
from .. import models as panel
from . import config as configuration
from . import deploy, memcg, netns, server_env



class StackError(Exception):
    """The stack cannot be brought up, used or found; the message says what to do."""


class OutOfMemory(StackError):
    """The kernel killed processes of the stack for want of memory (counted in its memory cgroup)."""


class RayStartRace(StackError):
    """Ray's GCS aborted as it started, on :data:`RAY_START_RACE`; ``up`` starts the stack once more."""


#: The failures every ``ndif`` command reports as ``error: <message>`` with exit status 2 instead of a
#: traceback: each one's message already names the problem and the fix.
USER_ERRORS = (StackError, configuration.ConfigError, netns.NetnsError, deploy.DeployError, envs.EnvError)


def _say(message: str) -> None:
    print(f"[ndif] {message}", file=sys.stderr, flush=True)


# State ---------------------------------------------------------------------------------------------

def read_state(cfg: configuration.StackConfig) -> Optional[dict]:
    try:
        return json.loads(cfg.state_file.read_text())
    except (OSError, ValueError):
        return None


def _write_state(cfg: configuration.StackConfig, state: dict) -> None:
    fsutil.write_text(cfg.state_file, json.dumps(state, indent=1))


@contextlib.contextmanager
def _exclusive(cfg: configuration.StackConfig):
    """One ``up`` or ``down`` at a time per stack folder, across processes."""
    cfg.folder.mkdir(parents=True, exist_ok=True)
    with open(cfg.folder / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StackError(f"Another `up` or `down` of the stack in {cfg.folder} is in progress; "
                             f"wait for it, or see `nnsight-repro ndif status`.") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


#: How long :func:`lease` waits for another process using the same stack folder before it gives up: a test
#: session holds the plain 0.8 stack's for all of its 15 minutes or so.
LEASE_WAIT_S = 1800.0


def _ancestry() -> set:
    """This process's pid and its ancestors'."""
    found, pid = set(), os.getpid()
    while pid and pid not in found:  # up to pid 1, which may be the holder (a container's pytest); its parent is 0
        found.add(pid)
        pid = netns.parent(pid)
    return found


def _holder(pid: str) -> str:
    """``pid N (its command line)``, as a lease's messages name its holder."""
    if not pid.isdigit():
        return "a process that has not written its pid yet"
    try:
        return f"pid {pid} ({' '.join(netns.command_line(int(pid)))[:120]})"
    except OSError:
        return f"pid {pid} (gone)"


@contextlib.contextmanager
def lease(cfg: configuration.StackConfig, say: Callable[[str], None] = _say, wait_s: float = LEASE_WAIT_S):
    """This process's use of the stack folder of ``cfg`` while the block runs. Another process holding it is
    waited for (said once, with its pid and command line) up to ``wait_s`` seconds, then :class:`StackError`
    names it and the fix. A process the holder started, or the holder itself again, goes on at once: the
    holder's lease covers the probe script a lane job runs on its stack. The lock is the kernel's, so a
    holder that dies, however it dies, frees it."""
    cfg.folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(cfg.folder / ".lease", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        started, ancestry, said = time.monotonic(), _ancestry(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            if holder.isdigit() and int(holder) in ancestry:
                yield
                return
            if holder.isdigit() and not said:
                said = True
                say(f"the {cfg.line} stack's folder {cfg.folder} is in use by {_holder(holder)}; waiting for it, "
                    f"at most {wait_s:.0f} s")
            if time.monotonic() - started > wait_s:
                raise StackError(
                    f"The {cfg.line} stack's folder {cfg.folder} is still in use by {_holder(holder)} after "
                    f"{wait_s:.0f} s: another run on this cache uses that stack. Wait for it to finish, or give "
                    f"this run a cache of its own (NNSIGHT_REPRO_CACHE=<a folder>).")
            time.sleep(0.5)
        # Until this write a waiter reads an empty file (or a killed holder's pid): it reads again.
        mine = str(os.getpid()).encode()
        os.pwrite(fd, mine, 0)
        os.ftruncate(fd, len(mine))  # after the write: a killed holder's longer pid leaves no digits behind
        if said:
            say(f"the {cfg.line} stack's folder is free after {time.monotonic() - started:.0f} s")
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # before the unlock: a reader never takes a pid that no longer holds it
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# Inside the namespace --------------------------------------------------------------------------------

def probe(cfg: configuration.StackConfig, *args: str, timeout: float = 20.0) -> dict:
    """Ask :mod:`probe` a question from inside the namespace (with this Python: it needs only the stdlib)."""
    try:
        return channel.run_one(netns.command(cfg.netns, [sys.executable, "-m", "nnsight_repro.ndif.probe", *args]),
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=timeout,
                               what=f"a network probe in namespace {cfg.netns}")
    except channel.ChannelError as exc:
        raise StackError(f"Could not probe inside namespace {cfg.netns}: {exc}") from None


def http_get(cfg: configuration.StackConfig, path: str, timeout: float = 5.0) -> dict:
    return probe(cfg, "get", "--timeout", str(timeout), cfg.api_url + path)[cfg.api_url + path]


def api_status(cfg: configuration.StackConfig, timeout: float = 5.0) -> Optional[dict]:
    """The API's ``/status`` as JSON, or None while it cannot give one (within ``timeout``)."""
    answer = http_get(cfg, "/status", timeout)
    if answer.get("status") != 200:
        return None
    try:
        return json.loads(answer["body"])
    except ValueError:
        return None


def deployment_levels(status: dict) -> Dict[str, dict]:
    """``{model_key: {"level", "state"}}`` from a ``/status`` answer."""
    levels = {}
    for name, entry in (status or {}).get("deployments", {}).items():
        key = entry.get("model_key") or name.split(":ModelActor:", 1)[-1]
        levels[key] = {"level": entry.get("deployment_level"), "state": entry.get("application_state")}
    return levels


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
        if RAY_START_RACE in _read(log):
            raise RayStartRace(f"Ray's GCS aborted as it started ({RAY_START_RACE}: a race in Ray 2.50, fixed in "
                               f"later Rays; {log}).")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _quoted(path: Path) -> str:
    return f"Last lines of {path}:\n{_log_tail(path)}"


def _log_tail(path: Path, lines: int = 12) -> str:
    text = _read(path).strip().splitlines()
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
        tail = _log_tail(self.log)
        if "Address already in use" in tail or "address already in use" in tail:
            raise StackError(f"{self.name} could not start: port {self.port} is already taken inside the stack's "
                             f"namespace. Log ({self.log}):\n{tail}")
        raise StackError(f"{self.name} exited with code {self.process.returncode} during start. {_quoted(self.log)}")


def _services(cfg: configuration.StackConfig, env: envs.Env) -> List[Service]:
    redis = server_env.redis_server()
    bin_ = env.path / "venv" / "bin"
    stores = [
        Service("redis", [redis, "--bind", "127.0.0.1", "--port", str(cfg.redis_port), "--save", "",
                          "--appendonly", "no", "--daemonize", "no", "--dir", str(cfg.home)],
                cfg.redis_port, cfg.logs / "redis.log"),
        Service("s3", [str(bin_ / "moto_server"), "-H", "127.0.0.1", "-p", str(cfg.s3_port)],
                cfg.s3_port, cfg.logs / "s3.log"),
    ]
    if cfg.line == "0.7":
        # ndif 0.0.1's start scripts, from their own folders (they run `python -m src...` and gunicorn
        # with `src/gunicorn.conf.py` relative to it), not through its CLI: the CLI only sets their
        # environment (config.environ sets the same), and on Ctrl-C it runs `ray stop`, which stops
        # every Ray process on the host.
        services = configuration.service_root(bin_)
        return stores + [
            Service("ray", ["bash", str(services / "ray" / "start.sh")], 6380, cfg.logs / "ray.log",
                    cwd=services / "ray", role="ray"),
            Service("api", ["bash", str(services / "api" / "start.sh")], cfg.api_port, cfg.logs / "api.log",
                    cwd=services / "api", role="api"),
        ]
    return stores + [
        # ndif's own launchers, in the foreground: `ndif start -f ray` runs ndif's Ray start script (Ray
        # head + the controller), `ndif start -f api` runs gunicorn with ndif's config.
        Service("ray", [str(bin_ / "ndif"), "start", "--foreground", "ray"], 6385, cfg.logs / "ray.log"),
        Service("api", [str(bin_ / "ndif"), "start", "--foreground", "api"], cfg.api_port, cfg.logs / "api.log"),
    ]


def _prepare_python_path(cfg: configuration.StackConfig, env: envs.Env) -> dict:
    """0.0.1: the folder first on every server process's path: the generated ``sitecustomize.py`` and,
    for the patched flavour, links to the ``patched`` environment's installed nnsight (package and
    metadata), so the server imports exactly that build; what it imports is checked, not assumed."""
    folder = cfg.python_path_dir
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    module = cfg.generation.adaptations
    (folder / "sitecustomize.py").write_text(
        "# Generated by nnsight_repro.ndif.stack: loads the ndif 0.0.1 adaptations in every server process.\n"
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


def _wait(what: str, ready: Callable[[], object], services: List[Service], timeout: float,
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
                             + "".join(f" {_quoted(log)}" for log in logs))
        time.sleep(interval)


# Memory ----------------------------------------------------------------------------------------------

def memory_group(cfg: configuration.StackConfig) -> Optional[memcg.Cgroup]:
    """The running stack's memory cgroup (from its state), or None when it runs without one."""
    info = (read_state(cfg) or {}).get("memory") or {}
    return memcg.Cgroup(Path(info["cgroup"]), info["version"]) if info.get("cgroup") else None


def out_of_memory_message(counters: dict, what: str, how: str) -> str:
    """What to tell a user whose stack ran out of memory ``what`` (while ...), ``how`` (what the kernel did)."""
    peak = f", its peak {counters['peak_mib']} MiB" if counters.get("peak_mib") is not None else ""
    if counters.get("limit_mib") is not None:
        cap = f"its memory limit is {counters['limit_mib']} MiB{peak}"
        fix = "deploy fewer models at once, or give the stack a higher --memory-limit"
    else:
        cap = f"it has no memory limit of its own: the machine ran out{peak}"
        fix = "deploy fewer models at once, or stop what else uses the machine's memory"
    return (f"The stack ran out of memory {what}: {how} ({cap}; memory cgroup {counters.get('cgroup')}). To run "
            f"it: {fix} (`ndif up --models`, `ndif panel --batch`).")


class MemoryWatch:
    """A check for :func:`_wait`: raises :class:`OutOfMemory` as soon as the stack has run out of memory
    since the watch was made, instead of letting the wait time out on a model actor that is gone or stuck.

    Out of memory is either of what the kernel does at a memory cgroup's limit: it kills a process (counted
    in ``oom_kill``; :meth:`check_kills`), or, while evicted code and data pages can still be read back in,
    it keeps evicting them and nothing makes progress (thrashing). Thrashing was measured once, with a
    model actor loading under a limit of the services' own memory plus 300 MiB: no kill in 300 s, 180
    major faults a second, system memory pressure 97%, against some 450 major faults for a whole cold
    start. The watch calls it thrashing when, every time it looks for :attr:`THRASH_S` seconds, the limit
    was hit since the last look and at least :attr:`THRASH_REFAULTS_PER_S` pages a second were refaults
    (pages read back in after the cgroup evicted them: ``workingset_refault_*``, the part of the major
    faults that reading new files does not make).
    """

    THRASH_REFAULTS_PER_S = 50
    THRASH_S = 20.0

    def __init__(self, group: Optional[memcg.Cgroup], what: str, clock: Callable[[], float] = time.monotonic):
        self.group, self.what, self.clock = group, what, clock
        self.first = self.last = memcg.counters(group) if group else None
        self.last_time, self.thrashing_since = clock(), None

    def check_kills(self, now: Optional[dict] = None) -> None:
        """Raise :class:`OutOfMemory` if the kernel has killed a process of the stack since the watch was made."""
        if self.group is None:
            return
        now = now or memcg.counters(self.group)
        kills = now["oom_kills"] - self.first["oom_kills"]
        if kills > 0:
            raise OutOfMemory(out_of_memory_message(
                now, self.what, f"the kernel killed {kills} of its processes for want of memory"))

    def __call__(self) -> None:
        if self.group is None:
            return
        now, at = memcg.counters(self.group), self.clock()
        self.check_kills(now)
        refaults = now["refaults"] - self.last["refaults"]
        if now["limit_hits"] > self.last["limit_hits"] and refaults >= self.THRASH_REFAULTS_PER_S * (at - self.last_time):
            # From this look on: one look over a long interval is not "every time it looks".
            self.thrashing_since = self.thrashing_since or at
            if at - self.thrashing_since >= self.THRASH_S:
                raise OutOfMemory(out_of_memory_message(
                    now, self.what, f"for {at - self.thrashing_since:.0f} s it was at its limit and reading evicted "
                                    f"pages back in ({now['refaults'] - self.first['refaults']} since the start of "
                                    f"the wait) instead of making progress"))
        else:
            self.thrashing_since = None
        self.last, self.last_time = now, at


# up / down / status ------------------------------------------------------------------------------------

def up(cfg: Optional[configuration.StackConfig] = None, models: Optional[List[str]] = None,
       say: Callable[[str], None] = _say,
       on_namespace: Optional[Callable[[configuration.StackConfig], None]] = None) -> dict:
    """Bring the stack up and deploy ``models`` (default: :data:`deploy.SERVED`); the state written.

    ``on_namespace`` is called once the namespace exists, before any service starts and before the
    cold start's clock (``state["cold_start_epoch"]``) starts: the benchmark starts its client there
    and waits until it is ready (:func:`start_client` ``ready=True``), as for a user whose script has
    imported nnsight and wrapped its model by the time the server starts.

    A start on which Ray's GCS aborts on its known start-up race (:data:`RAY_START_RACE`) is stopped as
    soon as its log shows it, and the stack is started once more.
    """
    cfg = cfg or configuration.default()
    if models is None:
        models = deploy.SERVED_07 if cfg.line == "0.7" else deploy.SERVED
    cfg.validate()
    known = panel.extended()
    unknown = [name for name in models if name not in known]
    if unknown:
        raise StackError(f"Unknown model(s) {', '.join(unknown)}; the panel has: {', '.join(known)}.")
    for attempt in (1, 2):
        try:
            with _exclusive(cfg):
                return _up_locked(cfg, models, say, on_namespace)
        except RayStartRace as exc:
            if attempt == 2:
                raise
            say(f"{str(exc).splitlines()[0]} Starting the stack once more.")


def _up_locked(cfg: configuration.StackConfig, models: List[str], say: Callable[[str], None],
               on_namespace: Optional[Callable[[configuration.StackConfig], None]]) -> dict:
    running = read_state(cfg)
    if netns.exists(cfg.netns):
        started = f", started {running['started']} by pid {running['owner_pid']}" if running else ""
        raise StackError(f"A local NDIF stack is already running for this cache (namespace {cfg.netns}"
                         f"{started}). Use it (`nnsight-repro ndif status`), or stop it first "
                         f"(`nnsight-repro ndif down`).")
    if running:
        say(f"forgetting the state of a stack that is gone ({cfg.state_file})")
        cfg.state_file.unlink()
    t0 = time.monotonic()

    def phase(message: str) -> None:
        # One line per phase of the start, so a minute-long cold start is never silent.
        say(f"{cfg.line} stack ({cfg.server}{''.join(' +' + e for e in cfg.extras)}): {message} (+{time.monotonic() - t0:.1f} s)")

    timings = {}
    phase("checking the server and client environments")
    env = server_env.ensure(line=cfg.line, extras=cfg.extras)
    server_env.redis_server()
    for client in cfg.generation.clients:
        envs.ensure(client)
    timings["environments_s"] = round(time.monotonic() - t0, 2)
    # The keys are needed before Ray starts (the controller deploys them as it comes up); they are
    # minted once and remembered, so a warm `up` starts no client.
    t_mint = time.monotonic()
    if models:
        phase(f"minting the remote keys of {', '.join(models)}")
    minted = minted_keys(cfg, models) if models else {}
    timings["keys_s"] = round(time.monotonic() - t_mint, 2)
    # A cold start: nothing of a previous run survives but nothing else is touched.
    for folder in (cfg.logs, cfg.ray_temp, cfg.home, cfg.folder / "hf_home"):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    if cfg.ray_temp_link.is_symlink() or cfg.ray_temp_link.is_file():
        cfg.ray_temp_link.unlink()
    cfg.ray_temp_link.symlink_to(cfg.ray_temp)
    state = {"netns": cfg.netns, "folder": str(cfg.folder), "api_url": cfg.api_url, "owner_pid": os.getpid(),
             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "phase": "starting", "services": {},
             "models": {name: m["key"] for name, m in minted.items()}, "timings": timings,
             "logs": str(cfg.logs), "line": cfg.line, "server": cfg.server, "with": list(cfg.extras),
             "ndif": cfg.generation.ndif}
    if cfg.line == "0.7":
        # 0.0.1's /status scans the Hub cache and fails (every time) when it does not exist.
        (cfg.folder / "hf_home" / "hub").mkdir()
    try:
        netns.create(cfg.netns)
        try:
            group = memcg.create(cfg.netns, cfg.memory_limit_mib)
            state["memory"] = {"cgroup": str(group.path), "version": group.version,
                               "limit_mib": cfg.memory_limit_mib}
        except memcg.MemcgError as exc:
            if cfg.memory_limit_mib is not None:
                raise StackError(f"A memory limit needs a memory cgroup for the stack, but {exc}; "
                                 f"run without --memory-limit.") from None
            say(f"no memory cgroup for the stack ({exc}): it runs, but an OOM kill will not be named as one")
            group, state["memory"] = None, {"cgroup": None, "why": str(exc)}
        _write_state(cfg, state)
        if on_namespace is not None:
            on_namespace(cfg)
        # The cold start counts from here: the namespace exists (and whatever the caller started in
        # it is ready), nothing of the server runs yet.
        t_cold = time.monotonic()
        state["cold_start_epoch"] = time.time()
        if cfg.line == "0.7":
            state["server_nnsight"] = _prepare_python_path(cfg, env)
        services = _services(cfg, env)
        ensure_ports_free(cfg, services)
        venv_bin = env.path / "venv" / "bin"
        service_env = cfg.environ(venv_bin, role="api")
        by_name = {s.name: s for s in services}
        # Ray first: its head, then the controller, then the controller actor is the longest chain
        # of the start, and nothing in it touches Redis or S3 before they listen (they take about a
        # second). ndif's controller deploys NDIF_DEPLOYMENTS (pinned) as it starts: the model
        # actors load while the API is still coming up, and no deploy client has to connect to Ray.
        deployments = {"NDIF_DEPLOYMENTS": "|".join(state["models"].values())}
        phase(f"starting Ray (its controller deploys {', '.join(minted) or 'nothing'})")
        memory = MemoryWatch(group, "while starting")
        by_name["ray"].start(cfg, {**cfg.environ(venv_bin, role="ray"), **deployments}, group)

        def starting() -> None:
            memory()
            check_ray_start(cfg)
        phase("starting Redis and the S3 store")
        for name in ("redis", "s3"):
            by_name[name].start(cfg, service_env, group)
        # The API's workers connect to the S3 store as they boot, and its queue dispatcher to Ray's
        # client server as soon as that port listens. It starts once `ray start` has said it is done:
        # started beside Ray, its imports only compete with Ray's for the two cores (A/B on the 0.7
        # stack, three cold starts each: 30.3/30.0/36.5 s to the first trace, against 27.9/29.2/34.9).
        _wait("Redis and the S3 store to listen",
              lambda: set(probe(cfg, "ports", str(cfg.redis_port), str(cfg.s3_port)).values()) == {"listening"},
              [by_name["redis"], by_name["s3"], by_name["ray"]], 30, interval=0.2, watch=starting)
        _wait("Ray's head to start", lambda: RAY_STARTED in _read(by_name["ray"].log), services[:3],
              cfg.start_timeout, interval=0.2, watch=starting, logs=[by_name["ray"].log])
        phase("starting the API")
        by_name["api"].start(cfg, service_env, group)
        state["services"] = {s.name: {"pid": s.process.pid, "port": s.port, "log": str(s.log)} for s in services}
        _write_state(cfg, state)
        say(f"services starting in namespace {cfg.netns} (logs: {cfg.logs})")
        # Short calls: ndif 0.0.1 answers a /status asked before its dispatcher listens never (see
        # adaptations_0_0_1 [A12]); the next call after the dispatcher starts is answered.
        _wait("the API to connect to Ray and the controller to list the node",
              lambda: (api_status(cfg, timeout=1.5) or {}).get("cluster", {}).get("nodes"), services,
              cfg.start_timeout, interval=0.5, watch=starting,
              logs=[by_name["api"].log, by_name["ray"].log])
        timings["services_s"] = round(time.monotonic() - t_cold, 2)
        say(f"services up in {timings['services_s']} s")
        if minted:
            phase(f"deploying {', '.join(minted)} (waiting for HOT)")
            wait_hot(cfg, env, minted, services, watch=MemoryWatch(group, f"while deploying {', '.join(minted)}"))
            timings["models_hot_s"] = round(time.monotonic() - t_cold, 2)
            say(f"{', '.join(minted)} HOT after {timings['models_hot_s']} s")
        state["phase"] = "ready"
        state["ready"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        _write_state(cfg, state)
        return state
    except BaseException as exc:
        say(f"up failed; stopping what it started (logs stay in {cfg.logs})")
        try:
            _down_locked(cfg, say=lambda m: None)
        except StackError as cleanup:
            # What went wrong first stays the error; that stopping it failed too is said beside it.
            say(f"stopping it failed too: {cleanup}")
        if isinstance(exc, (StackError, deploy.DeployError, netns.NetnsError)):
            kind = type(exc) if isinstance(exc, StackError) else StackError  # OutOfMemory stays OutOfMemory
            raise kind(f"{exc}\n(Logs of this attempt: {cfg.logs}; Ray's own: under {cfg.ray_temp_link})") from None
        raise

#: How long a model may be missing from /status after the controller is up before it counts as failed.
#: The controller drops a model it could not size or load (and only logs why).
MISSING_GRACE_S = 10.0


def minted_keys(cfg: configuration.StackConfig, models: List[str]) -> Dict[str, dict]:
    """``{name: {path, task, key}}`` for ``models``, as the stack's client (:attr:`StackConfig.client`)
    mints them; remembered per client in the stack folder."""
    name = "minted.json" if cfg.line == "0.8" else f"minted-{cfg.client}.json"
    return deploy.minted(models, cfg.folder / name, client=cfg.client)


def wait_hot(cfg: configuration.StackConfig, env: envs.Env, minted: Dict[str, dict],
             services: List[Service] = (), watch: Callable[[], None] = lambda: None) -> None:
    """Wait until ``/status`` shows every minted model HOT and RUNNING.

    A model missing (or dead) for :data:`MISSING_GRACE_S` is deployed once more through ``ndif deploy``,
    which reports per model the exception it failed with (and succeeds if the failure was passing).
    """
    keys = {m["key"]: name for name, m in minted.items()}
    missing_since: Dict[str, float] = {}
    retried = set()
    deadline = time.monotonic() + cfg.deploy_timeout
    while True:
        # Memory first: a service the kernel killed for want of memory is reported as that, not as a crash.
        watch()
        for service in services:
            service.check_alive()
        levels = deployment_levels(api_status(cfg))
        if all(levels.get(key, {}).get("level") == "HOT" and levels[key].get("state") == "RUNNING" for key in keys):
            return
        now = time.monotonic()
        failed = {}
        for key, name in keys.items():
            entry = levels.get(key)
            if entry is None or entry.get("state") == "UNHEALTHY":
                missing_since.setdefault(key, now)
                if now - missing_since[key] > MISSING_GRACE_S and name not in retried:
                    failed[name] = minted[name]
            else:
                missing_since.pop(key, None)
        if failed and cfg.line == "0.7":
            # 0.0.1's `ndif deploy` asks the Hub for the key: there is no second way in to report through.
            raise StackError(f"{', '.join(failed)} did not deploy: missing from /status {MISSING_GRACE_S:.0f} s "
                             f"after the controller came up. The model actor's error is in Ray's worker logs "
                             f"({cfg.ray_temp_link}/session_latest/logs/worker-*.err).")
        if failed:
            retried.update(failed)
            deploy_models(cfg, env, failed, services, watch)
        if now > deadline:
            waiting = {keys[k]: levels.get(k, {}).get("level", "missing") for k in keys}
            raise StackError(f"Timed out after {cfg.deploy_timeout:.0f} s waiting for the models to be HOT: {waiting}.")
        time.sleep(1.0)


def deploy_models(cfg: configuration.StackConfig, env: envs.Env, minted: Dict[str, dict],
                  services: List[Service] = (), watch: Optional[Callable[[], None]] = None) -> None:
    """``ndif deploy -f`` the minted models; on failure a :class:`deploy.DeployError` naming each with its
    cause, or :class:`OutOfMemory` when the kernel killed a process of the stack for want of memory meanwhile."""
    if watch is None:
        watch = MemoryWatch(memory_group(cfg), f"while deploying {', '.join(minted)}")
    deploy.write_file(cfg.deploy_file, minted, cfg.generation.dtype)
    log = cfg.logs / "deploy.log"
    # Appended to, so a failed up keeps every attempt; only this call's part is read back.
    offset = log.stat().st_size if log.exists() else 0
    with open(log, "ab") as fh:
        process = subprocess.Popen(
            netns.command(cfg.netns, [str(env.path / "venv" / "bin" / "ndif"), "deploy", "-f", str(cfg.deploy_file)]),
            env=cfg.environ(env.path / "venv" / "bin"), cwd=cfg.folder, stdout=fh, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
    try:
        _wait(f"`ndif deploy` of {', '.join(minted)}", lambda: process.poll() is not None, list(services),
              cfg.deploy_timeout, watch=watch)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with open(log, "rb") as fh:
        fh.seek(offset)
        output = fh.read().decode("utf-8", "replace")
    failed = deploy.failures(output, minted)
    if process.returncode or failed:
        reasons = "\n".join(f"  {name}: {reason}" for name, reason in failed.items()) or \
            "\n".join("    " + line for line in output.strip().splitlines()[-12:])
        raise deploy.DeployError(f"Model(s) failed to deploy ({log}):\n{reasons}")


def _down_locked(cfg: configuration.StackConfig, say: Callable[[str], None]) -> dict:
    report = {"netns": cfg.netns, "killed": [], "deleted_netns": False, "removed_cgroup": None}
    # Also without a state (a stack that lost it), the cgroup `up` would have made from here is found.
    group = memory_group(cfg) or memcg.find(cfg.netns)
    if netns.exists(cfg.netns):
        report["killed"] = netns.kill_all(cfg.netns)
        netns.delete(cfg.netns)
        report["deleted_netns"] = True
        say(f"stopped {len(report['killed'])} process(es) and deleted namespace {cfg.netns}")
    else:
        say(f"no stack running (namespace {cfg.netns} does not exist)")
    with contextlib.suppress(FileNotFoundError):
        cfg.state_file.unlink()
    if group is not None:
        # Every process of the cgroup was in the namespace, so it is empty once they have exited.
        try:
            memcg.remove(group)
        except memcg.MemcgError as exc:
            raise StackError(f"The stack's processes are stopped, but {exc}.") from None
        report["removed_cgroup"] = str(group.path)
    return report


def down(cfg: Optional[configuration.StackConfig] = None, say: Callable[[str], None] = _say) -> dict:
    """Kill every process in the stack's namespace, delete it, forget the state. Idempotent."""
    cfg = cfg or configuration.default()
    with _exclusive(cfg):
        return _down_locked(cfg, say)


def status(cfg: Optional[configuration.StackConfig] = None) -> dict:
    """What runs: each service alive or not, the API answering, each model's level. Never raises for a dead stack."""
    cfg = cfg or configuration.default()
    state = read_state(cfg)
    report = {"netns": cfg.netns, "running": netns.exists(cfg.netns), "folder": str(cfg.folder),
              "logs": str(cfg.logs), "api_url": cfg.api_url, "state": state, "problems": [],
              "line": cfg.line}
    if not report["running"]:
        if state:
            report["problems"].append(f"the state file says a stack started {state.get('started')}, "
                                      f"but its namespace {cfg.netns} is gone")
        return report
    alive = set(netns.pids(cfg.netns))
    report["pids"] = sorted(alive)
    services = {}
    for name, info in ((state or {}).get("services") or {}).items():
        services[name] = {**info, "alive": info["pid"] in alive}
        if info["pid"] not in alive:
            report["problems"].append(f"{name} (pid {info['pid']}) is not running; see {info['log']}")
    report["services"] = services
    group = memory_group(cfg)
    report["memory"] = memcg.counters(group) if group else None
    if report["memory"] and report["memory"]["oom_kills"]:
        limit = report["memory"]["limit_mib"]
        report["problems"].append(f"the kernel killed {report['memory']['oom_kills']} of the stack's processes for "
                                  f"want of memory ({f'limit {limit} MiB' if limit is not None else 'no limit'})")
    try:
        ping = http_get(cfg, "/ping")
        report["api"] = "answering" if ping.get("status") == 200 else ping.get("error") or f"HTTP {ping.get('status')}"
        levels = deployment_levels(api_status(cfg)) if report["api"] == "answering" else {}
    except StackError as exc:
        report["api"], levels = f"unreachable: {exc}", {}
    if report["api"] != "answering":
        report["problems"].append(f"the API at {cfg.api_url} is not answering ({report['api']})")
    report["models"] = {}
    if cfg.line == "0.7":
        # Besides what `up` deployed (by name, below), what the server deployed on request, by key.
        named = set(((state or {}).get("models") or {}).values())
        report["models"] = {key: level for key, level in levels.items() if key not in named}
    for name, key in ((state or {}).get("models") or {}).items():
        report["models"][name] = levels.get(key, {"level": "missing", "state": None})
        if report["api"] == "answering" and report["models"][name]["level"] != "HOT":
            report["problems"].append(f"model {name} is {report['models'][name]['level']}, not HOT")
    if state and state.get("phase") != "ready":
        report["problems"].append(f"`up` has not finished (phase: {state.get('phase')})")
    return report


def healthy(cfg: Optional[configuration.StackConfig] = None) -> bool:
    report = status(cfg)
    return report["running"] and not report["problems"]


def ensure_up(cfg: configuration.StackConfig, say: Callable[[str], None] = _say) -> bool:
    """The stack of ``cfg`` running as configured, for callers that may share one: a healthy stack of the
    same server flavour is used as it is; anything else in its namespace (unhealthy, or the other
    flavour: one stack per generation runs per cache) is stopped, saying why, and replaced.

    True when this call brought the stack up (the caller brings it down); False when it was running
    already, and then it is left running.
    """
    running = read_state(cfg) or {}
    is_healthy = healthy(cfg)
    if is_healthy and running.get("server", "stock") == cfg.server:
        return False
    if netns.exists(cfg.netns):
        why = "unhealthy" if not is_healthy else f"running {running.get('server', 'stock')} nnsight, not {cfg.server}"
        say(f"the local {cfg.line} stack is {why}; replacing it")
        down(cfg, say=say)
    say(f"bringing up the local {cfg.line} stack ({cfg.server})")
    up(cfg, say=say)
    return True


# Running code against the stack --------------------------------------------------------------------------

def client_command(cfg: configuration.StackConfig, env: envs.Env, args: List[str]) -> List[str]:
    return netns.command(cfg.netns, [str(env.python), *args])


def start_client(cfg: configuration.StackConfig, cases: List[str], client: Optional[str] = None,
                 ready: bool = False, ready_timeout: float = 300) -> channel.Stream:
    """:mod:`remote_client` cases, started in a client environment (default: the generation's first,
    ``upstream-0.8`` for the 0.8 stack) inside the namespace; its records come through the channel.

    ``ready``: return only once the client says it is ready (a ``first:`` case has imported nnsight and
    wrapped its model; its first record is ``{"ready": case}``), so its start does not overlap the server's.
    """
    if not netns.exists(cfg.netns):
        line = "" if cfg.line == "0.8" else f" --line {cfg.line}"
        raise StackError(f"No local NDIF stack is running (namespace {cfg.netns} does not exist); "
                         f"start one with `nnsight-repro ndif up{line}`.")
    client = client or cfg.generation.clients[0]
    if client not in cfg.generation.clients:
        raise StackError(f"Client environment {client!r} does not speak the {cfg.line} stack's protocol; "
                         f"its clients: {', '.join(cfg.generation.clients)}.")
    env = envs.ensure(client, build=False)
    stream = channel.start(
        client_command(cfg, env, ["-m", "nnsight_repro.ndif.remote_client", "run", "--cases", ",".join(cases)]),
        env=env.environ({"NDIF_HOST": cfg.api_url}), cwd=ROOT,
        what=f"the remote client in the {client!r} environment, namespace {cfg.netns}")
    if ready:
        wait_ready(stream, ready_timeout)
    return stream


def wait_ready(client: channel.Stream, timeout: float) -> None:
    """Until the client's first record, ``{"ready": ...}``; a client that dies or hangs first is killed, named."""
    try:
        record = client.next(timeout)
    except channel.ChannelTimeout as exc:
        client.close()
        raise StackError(f"The remote client was not ready after {timeout:.0f} s: {exc}") from None
    except channel.ChannelError as exc:
        client.close()
        raise StackError(f"The remote client exited before it was ready: {exc}") from None
    if record is None or "ready" not in record:
        client.close()
        raise StackError(f"The remote client {'exited' if record is None else f'sent {record!r}'} "
                         f"before it was ready.")


def up_to_first_trace(cfg: configuration.StackConfig, model: str, client: str,
                      models: Optional[List[str]] = None, say: Callable[[str], None] = _say) -> dict:
    """A cold start measured: ``up`` with a ready ``first:<model>`` client waiting in the namespace (the
    clock starts once it is ready), until that client's remote trace returned. The state, with
    ``first_trace_s`` and ``first_request_s`` added to its timings; the client is gone either way.
    A failed trace raises (the stack stays up: the caller brings it down)."""
    first = {}

    def start_first_client(running_cfg):
        first["client"] = start_client(running_cfg, [f"first:{model}"], client=client, ready=True)

    try:
        state = up(cfg, models=models, on_namespace=start_first_client, say=say)
        record = client_records(cfg, first["client"])[f"first:{model}"]
    finally:
        if "client" in first:
            first["client"].close()
    if not record.get("ok"):
        raise StackError(f"The first remote trace ({model}, {client} client) failed: {record}")
    state["timings"]["first_trace_s"] = round(record["done_epoch"] - state["cold_start_epoch"], 2)
    state["timings"]["first_request_s"] = record["request_s"]
    return state


def timing_medians(record: dict) -> dict:
    """A ``timing:`` case's record as medians, remote and local, and their ratio remote/local."""
    remote, local = statistics.median(record["remote_s"]), statistics.median(record["local_s"])
    return {"remote_median_s": round(remote, 4), "local_median_s": round(local, 4), "ratio": round(remote / local, 1)}


def client_records(cfg: configuration.StackConfig, client: channel.Stream, timeout: float = 600) -> dict:
    """The case records of a :func:`start_client` client; a client that dies, or a dead stack, is named."""
    try:
        sent = [r for r in client.records(timeout) if "ready" not in r]
        if len(sent) != 1 or "cases" not in sent[0]:
            raise client._error(f"sent {sent!r} instead of one record of cases")
    except channel.ChannelError as exc:
        problems = status(cfg)["problems"]
        health = ("; the stack is not healthy: " + "; ".join(problems)) if problems else ""
        raise StackError(f"The remote client failed{health}: {exc}") from None
    finally:
        client.close()
    records = sent[0]["cases"]
    # A failed case on a stack that died says so, instead of leaving the reader with a connection error.
    if any(not r.get("ok") for r in records.values()):
        problems = status(cfg)["problems"]
        if problems:
            for record in records.values():
                if not record.get("ok"):
                    record["stack_problems"] = problems
    return records


def run_client(cfg: Optional[configuration.StackConfig], cases: List[str], timeout: float = 600,
               client: Optional[str] = None) -> dict:
    """Run :mod:`remote_client` cases in a client environment (see :func:`start_client`) inside the namespace."""
    cfg = cfg or configuration.default()
    return client_records(cfg, start_client(cfg, cases, client), timeout)


def ray_client_connects(cfg: configuration.StackConfig, count: int, parallel: int = 2,
                        timeout: float = 600) -> List[dict]:
    """``parallel`` loops of ``count`` Ray clients connecting to the running stack's Ray as its API does
    (``ray_clients.py``, inside the namespace): every attempt's record, ``loop`` added."""
    env = server_env.ensure(build=False, line=cfg.line, extras=cfg.extras)
    argv = netns.command(cfg.netns, [str(env.python), "-m", "nnsight_repro.ndif.ray_clients",
                                     configuration.RAY_CLIENT_ADDRESS, str(count)])
    loops = [channel.start(argv, env=cfg.environ(env.path / "venv" / "bin", role="api"), cwd=ROOT,
                           what=f"Ray client loop {number} in the {env.name!r} environment, namespace {cfg.netns}")
             for number in range(parallel)]
    records = []
    try:
        for number, loop in enumerate(loops):
            try:
                attempts = loop.records(timeout)
            except channel.ChannelError as exc:
                raise StackError(str(exc)) from None
            if len(attempts) != count:
                raise StackError(f"Ray client loop {number} reported {len(attempts)} of {count} connects.")
            records += [{**attempt, "loop": number} for attempt in attempts]
    finally:
        for loop in loops:
            loop.close()
    return records


def built_models(cfg: configuration.StackConfig) -> List[dict]:
    """What the model actors built, one record per model load, oldest first (``logs/built.jsonl``, :mod:`built_log`)."""
    try:
        text = cfg.built_log.read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def inline_cap(cfg: Optional[configuration.StackConfig] = None) -> int:
    """The largest result the server hands back inline (ndif derives it from our Redis's pubsub limits)."""
    cfg = cfg or configuration.default()
    env = server_env.ensure(build=False, extras=cfg.extras)
    try:
        found = channel.run_one(netns.command(cfg.netns, [str(env.python), "-m", "nnsight_repro.ndif.server_facts",
                                                          "inline-cap"]),
                                env=cfg.environ(env.path / "venv" / "bin"), cwd=ROOT, timeout=60,
                                what=f"the server environment {env.name!r} in namespace {cfg.netns} (its inline cap)")
    except channel.ChannelError as exc:
        raise StackError(f"Could not read the server's inline cap: {exc}") from None
    return found["inline_cap"]
