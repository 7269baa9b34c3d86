"""A local NDIF stack's life: ``up``, ``down``, ``ensure_up``, and deploying models onto it.

Two generations (:mod:`config`): ndif 0.1.2 for nnsight 0.8 clients (the default, described first),
and ndif 0.0.1 for nnsight 0.7.0 clients (``line="0.7"``, described at the end).

``up`` brings the whole stack up from nothing (building its environment if needed) inside a private
network namespace: Redis (queue, small results), moto as the S3 store (large results), ndif's Ray head
and controller (``ndif start --foreground ray``) and ndif's API (``ndif start --foreground api``). The
controller deploys the panel models as it starts (``NDIF_DEPLOYMENTS``, under the keys the client mints;
see :mod:`deploy`), and ``up`` returns once ``/status`` shows every one HOT; a model that never shows up
is deployed once more through ``ndif deploy``, which names the exception it failed with.
Foreground starts, because then each service is a process this module started and watches: one that
exits during ``up`` is reported with the end of its log instead of being waited on. Every wait watches
the stack's memory (:mod:`.memory_watch`). A start on which Ray's GCS aborts on its known race
(:data:`.services.RAY_START_RACE`) ends as soon as its log shows it, and ``up`` starts once more.

``down`` kills exactly the processes in the namespace (TERM, then KILL), deletes it and removes the cgroup;
it never runs ``ray stop`` or ``ndif stop``, which kill every Ray process on the host. It is safe to call at
any time, also after a failed or half-finished ``up``, and ``up`` calls it itself when it fails.

Logs stay in ``<cache>/ndif/logs`` until the next ``up`` (Ray's own are under ``<cache>/ndif/ray``).

The 0.7 generation differs in what runs, not in how: Redis and moto as above; ndif 0.0.1's own
``ray/start.sh`` (Ray head, then the controller, which is :mod:`adaptations_0_0_1`) and ``api/start.sh``
(gunicorn and its queue dispatcher), run directly with the environment ndif's CLI would give them. Every
server process first imports a generated ``sitecustomize.py`` that loads the adaptations; for the
``patched`` server build the ``patched`` environment's own nnsight build is linked in front of the
server's stock one. The controller deploys GPT-2 as it starts (its ``served``, under the key
the server build's own client mints) and ``up`` waits until it is HOT; any other key deploys on its
first request, under whatever key the client sends (which is what the negative control is about). Each
model actor records what it built in ``logs/built.jsonl``.

Owns the order of a start and of a stop, the state they write, and deploying. Does not own: who may use
the folder (:mod:`.stack_state`), how a service runs or is waited on (:mod:`.services`), health and ``status``
(:mod:`.health`), memory (:mod:`.memory_watch`), or running clients (:mod:`.stack_clients`).

Stdlib only: this runs in the test process (a 0.7 client) and in the CLI; server code runs in the server
environment, both as subprocesses in the namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from typing import Callable, Dict, List, Optional

from .. import envs
from .. import models as panel
from . import config as configuration
from . import deploy, errors, memcg, netns, server_env
from .errors import RayStartRace, StackError
from .health import api_status, deployment_levels, healthy, probe
from .memory_watch import MemoryWatch, memory_group
from .services import RAY_STARTED, Service, check_ray_start, ensure_ports_free, prepare_python_path, read_log, \
    services_of, wait
from .stack_state import exclusive, read_state, write_state


# up / down ------------------------------------------------------------------------------------------

def up(cfg: Optional[configuration.StackConfig] = None, models: Optional[List[str]] = None,
       say: Callable[[str], None] = errors.say,
       on_namespace: Optional[Callable[[configuration.StackConfig], None]] = None) -> dict:
    """Bring the stack up and deploy ``models`` (default: the generation's :attr:`~.generations.Generation.served`);
    the state written.

    ``on_namespace`` is called once the namespace exists, before any service starts and before the
    cold start's clock (``state["cold_start_epoch"]``) starts: the benchmark starts its client there
    and waits until it is ready (:func:`.stack_clients.start_client` ``ready=True``), as for a user whose script has
    imported nnsight and wrapped its model by the time the server starts.

    A start on which Ray's GCS aborts on its known start-up race (:data:`.services.RAY_START_RACE`) is stopped as
    soon as its log shows it, and the stack is started once more.
    """
    cfg = cfg or configuration.default()
    if models is None:
        models = list(cfg.generation.served)
    cfg.validate()
    known = panel.extended()
    unknown = [name for name in models if name not in known]
    if unknown:
        raise StackError(f"Unknown model(s) {', '.join(unknown)}; the panel has: {', '.join(known)}.")
    for attempt in (1, 2):
        try:
            with exclusive(cfg):
                return up_once(cfg, models, say, on_namespace)
        except RayStartRace as exc:
            if attempt == 2:
                raise
            say(f"{str(exc).splitlines()[0]} Starting the stack once more.")


def up_once(cfg: configuration.StackConfig, models: List[str], say: Callable[[str], None],
            on_namespace: Optional[Callable[[configuration.StackConfig], None]]) -> dict:
    """One attempt of :func:`up`, which holds the stack folder's lock: everything it started is stopped
    again when it fails (the error then names this attempt's logs)."""
    _refuse_a_running_stack(cfg, say)
    t0 = time.monotonic()

    def phase(message: str) -> None:
        # One line per phase of the start, so a minute-long cold start is never silent.
        say(f"{cfg.line} stack ({cfg.server}{''.join(' +' + e for e in cfg.extras)}): {message} "
            f"(+{time.monotonic() - t0:.1f} s)")

    env, minted, state = _prepare(cfg, models, phase, t0)
    try:
        netns.create(cfg.netns)
        group = _memory_group_of_a_new_stack(cfg, state, say)
        write_state(cfg, state)
        if on_namespace is not None:
            on_namespace(cfg)
        # The cold start counts from here: the namespace exists (and whatever the caller started in
        # it is ready), nothing of the server runs yet.
        t_cold = time.monotonic()
        state["cold_start_epoch"] = time.time()
        services = _start_services(cfg, env, state, group, phase, say)
        state["timings"]["services_s"] = round(time.monotonic() - t_cold, 2)
        say(f"services up in {state['timings']['services_s']} s")
        if minted:
            phase(f"deploying {', '.join(minted)} (waiting for HOT)")
            wait_hot(cfg, env, minted, services, watch=MemoryWatch(group, f"while deploying {', '.join(minted)}"))
            state["timings"]["models_hot_s"] = round(time.monotonic() - t_cold, 2)
            say(f"{', '.join(minted)} HOT after {state['timings']['models_hot_s']} s")
        state["phase"] = "ready"
        state["ready"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_state(cfg, state)
        return state
    except BaseException as exc:
        _undo_a_failed_up(cfg, exc, say)
        raise


def _refuse_a_running_stack(cfg: configuration.StackConfig, say: Callable[[str], None]) -> None:
    """A stack whose namespace exists is refused, named; the state of one that is gone is forgotten."""
    running = read_state(cfg)
    if netns.exists(cfg.netns):
        started = f", started {running['started']} by pid {running['owner_pid']}" if running else ""
        raise StackError(f"A local NDIF stack is already running for this cache (namespace {cfg.netns}"
                         f"{started}). Use it (`nnsight-repro ndif status`), or stop it first "
                         f"(`nnsight-repro ndif down`).")
    if running:
        say(f"forgetting the state of a stack that is gone ({cfg.state_file})")
        cfg.state_file.unlink()


def _prepare(cfg: configuration.StackConfig, models: List[str], phase: Callable[[str], None], t0: float):
    """Before anything starts: the environments, the models' keys, empty folders, and the first state."""
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
    if cfg.generation.status_needs_hub_cache:
        (cfg.folder / "hf_home" / "hub").mkdir()
    return env, minted, state


def _memory_group_of_a_new_stack(cfg: configuration.StackConfig, state: dict,
                                 say: Callable[[str], None]) -> Optional[memcg.Cgroup]:
    """The new stack's memory cgroup, recorded in ``state``; None (said) where the host gives none and no
    limit was asked for."""
    try:
        group = memcg.create(cfg.netns, cfg.memory_limit_mib)
    except memcg.MemcgError as exc:
        if cfg.memory_limit_mib is not None:
            raise StackError(f"A memory limit needs a memory cgroup for the stack, but {exc}; "
                             f"run without --memory-limit.") from None
        say(f"no memory cgroup for the stack ({exc}): it runs, but an OOM kill will not be named as one")
        state["memory"] = {"cgroup": None, "why": str(exc)}
        return None
    state["memory"] = {"cgroup": str(group.path), "version": group.version, "limit_mib": cfg.memory_limit_mib}
    return group


def _start_services(cfg: configuration.StackConfig, env: envs.Env, state: dict, group: Optional[memcg.Cgroup],
                    phase: Callable[[str], None], say: Callable[[str], None]) -> List[Service]:
    """Every service started in order, until the API lists Ray's node; the services, their pids in ``state``."""
    if cfg.generation.needs_python_path:
        state["server_nnsight"] = prepare_python_path(cfg, env)
    services = services_of(cfg, env)
    ensure_ports_free(cfg, services)
    venv_bin = env.path / "venv" / "bin"
    service_env = cfg.environ(venv_bin, role="api")
    by_name = {s.name: s for s in services}
    # Ray first: its head, then the controller, then the controller actor is the longest chain
    # of the start, and nothing in it touches Redis or S3 before they listen (they take about a
    # second). ndif's controller deploys NDIF_DEPLOYMENTS (pinned) as it starts: the model
    # actors load while the API is still coming up, and no deploy client has to connect to Ray.
    deployments = {"NDIF_DEPLOYMENTS": "|".join(state["models"].values())}
    phase(f"starting Ray (its controller deploys {', '.join(state['models']) or 'nothing'})")
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
    wait("Redis and the S3 store to listen",
         lambda: set(probe(cfg, "ports", str(cfg.redis_port), str(cfg.s3_port)).values()) == {"listening"},
         [by_name["redis"], by_name["s3"], by_name["ray"]], 30, interval=0.2, watch=starting)
    wait("Ray's head to start", lambda: RAY_STARTED in read_log(by_name["ray"].log), services[:3],
         cfg.start_timeout, interval=0.2, watch=starting, logs=[by_name["ray"].log])
    phase("starting the API")
    by_name["api"].start(cfg, service_env, group)
    state["services"] = {s.name: {"pid": s.process.pid, "port": s.port, "log": str(s.log)} for s in services}
    write_state(cfg, state)
    say(f"services starting in namespace {cfg.netns} (logs: {cfg.logs})")
    # Short calls: ndif 0.0.1 answers a /status asked before its dispatcher listens never (see
    # adaptations_0_0_1 [A12]); the next call after the dispatcher starts is answered.
    wait("the API to connect to Ray and the controller to list the node",
         lambda: (api_status(cfg, timeout=1.5) or {}).get("cluster", {}).get("nodes"), services,
         cfg.start_timeout, interval=0.5, watch=starting,
         logs=[by_name["api"].log, by_name["ray"].log])
    return services


def _undo_a_failed_up(cfg: configuration.StackConfig, exc: BaseException, say: Callable[[str], None]) -> None:
    """Stop what a failed ``up`` started; a failure the user can act on is raised again with this attempt's
    logs named (anything else the caller raises as it was)."""
    say(f"up failed; stopping what it started (logs stay in {cfg.logs})")
    try:
        _down_locked(cfg, say=lambda m: None)
    except StackError as cleanup:
        # What went wrong first stays the error; that stopping it failed too is said beside it.
        say(f"stopping it failed too: {cleanup}")
    if isinstance(exc, (StackError, deploy.DeployError, netns.NetnsError)):
        kind = type(exc) if isinstance(exc, StackError) else StackError  # OutOfMemory stays OutOfMemory
        raise kind(f"{exc}\n(Logs of this attempt: {cfg.logs}; Ray's own: under {cfg.ray_temp_link})") from None


#: How long a model may be missing from /status after the controller is up before it counts as failed.
#: The controller drops a model it could not size or load (and only logs why).
MISSING_GRACE_S = 10.0


def minted_keys(cfg: configuration.StackConfig, models: List[str]) -> Dict[str, dict]:
    """``{name: {path, task, key}}`` for ``models``, as the stack's client (:attr:`StackConfig.client`)
    mints them; remembered per client in the stack folder."""
    return deploy.minted(models, cfg.folder / cfg.generation.minted_file(cfg.client), client=cfg.client)


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
        if failed and not cfg.generation.redeploys:
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
    cause, or :class:`~.errors.OutOfMemory` when the kernel killed a process of the stack for want of memory meanwhile."""
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
        wait(f"`ndif deploy` of {', '.join(minted)}", lambda: process.poll() is not None, list(services),
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


def down(cfg: Optional[configuration.StackConfig] = None, say: Callable[[str], None] = errors.say) -> dict:
    """Kill every process in the stack's namespace, delete it, forget the state. Idempotent."""
    cfg = cfg or configuration.default()
    with exclusive(cfg):
        return _down_locked(cfg, say)




def ensure_up(cfg: configuration.StackConfig, say: Callable[[str], None] = errors.say) -> bool:
    """The stack of ``cfg`` running as configured, for callers that may share one: a healthy stack of the
    same server build is used as it is; anything else in its namespace (unhealthy, or the other
    server build: one stack per generation runs per cache) is stopped, saying why, and replaced.

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


