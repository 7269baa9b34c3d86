"""The local NDIF stacks as pytest fixtures, shared by every remote test (loaded from conftest.py).

``ndif_stack``: the 0.8 stack (ndif 0.1.2). ``ndif07_stock`` / ``ndif07_patched``: the 0.7 stack (ndif
0.0.1) with a stock or a patched server nnsight, and everything the session asks
of each 0.7 flavour — the negative-control pairings and the probe script's client lines that flavour
serves — done in one cold start each, because a 0.7 stack takes a minute or more to come up.
``ndif08_multimolecule`` / ``ndif07_multimolecule``: the same for each line's multimolecule flavour (a
panel batch, then the probe script with ``--with multimolecule`` for the probes that flavour changes).
The checks that break a stack run last on one of these instead of on a cold stack of their own: the
0.8 multimolecule stack is run out of memory (:func:`run_out_of_memory`), the patched 0.7 stack's API is
killed (:func:`kill_the_api`); so those two jobs' "leaves nothing" records are of the ``down`` after that.

``ndif_stack`` brings the stack up once per session (building its environment if needed) and tears it
down at the end, killing only what it started. A stack a developer already started with
``nnsight-repro ndif up`` is used as it is and left running, if it is healthy; an unhealthy leftover is
stopped and replaced. When the stack cannot be brought up the fixture raises: remote tests then fail
with the reason, they never skip. Each stack a session uses is its folder's ``stack.lease`` while it does,
so a second session on the same cache waits for the first rather than bringing its stacks down.

The four fixtures that bring a stack up and down again within themselves are jobs of the live-stack lane
(``LANE_JOBS``, ``tests/stack_lane.py``): a process of their own, started before the first test with every
job the collected tests ask for, runs them one after another while the other tests run, and each fixture
waits for its job's record. The modules that read them run after the rest (``pytest_collection_modifyitems``),
so the offline tests have the lane's cold starts to overlap. ``NNSIGHT_REPRO_STACK_LANE=on-demand`` runs each
job when a test first asks for it instead, in test order, as the suite ran before the lane.
"""

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

import pytest


@dataclass
class NdifStack:
    cfg: object
    state: dict
    owned: bool

    def run(self, cases, client=None):
        """:mod:`nnsight_repro.ndif.remote_client` cases, run inside the namespace by a client of the stack's
        line (``client``: its environment; default the line's first, ``upstream-0.8`` for the 0.8 stack)."""
        from nnsight_repro.ndif import stack

        return stack.run_client(self.cfg, list(cases), client=client)

    def status(self) -> dict:
        from nnsight_repro.ndif import stack

        return stack.status(self.cfg)


@contextlib.contextmanager
def cold_stack(cfg):
    """The stack of ``cfg`` brought up from nothing (a leftover in this cache's namespace, healthy or not,
    is stopped first) and always brought down on leaving. A failure to come up raises: the tests using
    it fail with the reason, they never skip."""
    from nnsight_repro.ndif import netns, stack

    with stack.lease(cfg):
        if netns.exists(cfg.netns):
            stack.down(cfg)
        state = stack.up(cfg)
        try:
            yield NdifStack(cfg, state, owned=True)
        finally:
            stack.down(cfg)


@pytest.fixture(scope="session")
def terminal_line(request):
    """Says a line on the terminal from a session fixture: past pytest's capture, where the running test's
    output would swallow it."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")

    def say(line):
        if reporter is None or capture is None:
            return print(line, file=sys.stderr, flush=True)
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)

    return say


@pytest.fixture(scope="session")
def ndif_stack(terminal_line):
    """The session's local NDIF stack (see the module docstring): ``.cfg``, ``.state``, ``.run(cases)``."""
    from nnsight_repro.ndif import config, stack

    cfg = config.default()
    # A wait for another session's lease is said where the user sees it: it can last minutes.
    with stack.lease(cfg, say=lambda message: terminal_line(f"[ndif] {message}")):
        owned = stack.ensure_up(cfg)
        try:
            yield NdifStack(cfg, stack.read_state(cfg), owned=owned)
        finally:
            if owned:
                stack.down(cfg)


def _everything_against_07(stack_args: dict, scratch) -> dict:
    """The negative-control pairings, a second ``up`` (refused), Ray clients connecting as the API does,
    on the stock flavour a user's ``__main__`` Envoy subclass from the stock and the fixed client
    (``envoy_subclass_cases.run_live``), and the probe script's client lines served by
    ``stack_args["server"]``, all while one cold 0.7 stack of that flavour runs, and on the patched flavour,
    last, its API killed (:func:`kill_the_api`); the stack is down on
    return, so a session that asks both flavours starts exactly two 0.7 stacks, one after the other."""
    from envoy_subclass_cases import run_live
    from nnsight_repro.ndif import config, negative_control, netns, stack

    server = stack_args["server"]
    with cold_stack(config.default(**stack_args)) as running:
        result = negative_control.run_pairings(running.cfg)
        result["status"] = running.status()
        try:
            stack.up(running.cfg)
            result["second_up"] = None
        except stack.StackError as exc:
            result["second_up"] = str(exc)
        result["healthy_after_second_up"] = stack.healthy(running.cfg)
        result["netns"] = running.cfg.netns
        result["ray_clients"] = stack.ray_client_connects(running.cfg, count=8, parallel=2)
        if server == "stock":
            (scratch / "envoy-subclass").mkdir()
            result["envoy_subclass"] = run_live(running.cfg, scratch / "envoy-subclass")
        result["probes"] = probe_script(running.cfg, scratch / "probes")
        if server == "patched":
            result["api_killed"] = kill_the_api(running.cfg)
    result["netns_left_after_down"] = netns.exists(result["netns"])
    return result


def kill_the_api(cfg) -> dict:
    """A stack whose API dies mid-run, on a stack the session has up anyway, last, since it breaks it: the API
    killed whole (each service is a process group of its own: gunicorn's master, workers and the queue
    dispatcher), then what ``status`` and a client that runs into the dead stack say, what ``down`` stopped,
    and which of the services' processes still live after it. Whatever raises is recorded (``raised``), so
    the job's other results stand."""
    from nnsight_repro.ndif import netns, stack

    found = {}
    try:
        found["started"] = {name: info["pid"] for name, info in stack.read_state(cfg)["services"].items()}
        api = found["started"]["api"]
        os.killpg(api, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while api in netns.pids(cfg.netns) and time.monotonic() < deadline:
            time.sleep(0.1)  # SIGKILL is delivered asynchronously
        found["problems"] = stack.status(cfg)["problems"]
        found["client"] = stack.run_client(cfg, ["trace:gpt2"])["trace:gpt2"]
        found["down"] = stack.down(cfg, say=lambda m: None)
        found["netns_left"] = netns.exists(cfg.netns)
        found["alive_after_down"] = [pid for pid in found["started"].values() if not netns.exited(pid)]
    except Exception:
        found["raised"] = traceback.format_exc()
    return found


#: A bound on one probe script run, past the silences its runner tolerates (``runner.NO_ANSWER_S`` each).
PROBE_SCRIPT_TIMEOUT_S = 1800


def probe_script(cfg, out) -> dict:
    """``probe_ndif.py`` run as a user runs it (no ``NDIF_HOST``) for every client line the running stack
    of ``cfg`` serves: the script finds that healthy stack of its flavour and uses it as it is, so the
    session starts no stack for the probes. On a flavoured stack, only the probes whose outcome the flavour
    changes (``--probe``): the session's plain stack of the same line runs the others for the same client
    lines and server nnsight. Its records by client line, its output, and whether the stack was still up
    after it."""
    from nnsight_repro import ROOT
    from nnsight_repro.ndif import stack
    from nnsight_repro.ndif.feasibility.declarations import (CLIENT_LINES, ProbeFileError, depends_on_flavours,
                                                             load_probes)
    from nnsight_repro.ndif.feasibility.runner import DEFAULT_PROBES

    client_lines = [name for name, line in CLIENT_LINES.items() if line.stack == cfg.line and line.server == cfg.server]
    flavour = "".join(f"+{name}" for name in cfg.extras)
    out.mkdir()
    environ = {k: v for k, v in os.environ.items() if k not in {"NDIF_HOST", "NDIF_API_KEY"}}
    with_flags = [flag for name in cfg.extras for flag in ("--with", name)]
    if cfg.extras:
        try:
            chosen = [probe["id"] for probe in load_probes(DEFAULT_PROBES) if depends_on_flavours(probe, cfg.extras)]
            with_flags += ["--probe", ",".join(chosen)]
        except ProbeFileError:
            pass  # the script refuses the file itself, and that refusal is its record
    # Its own session, so a timeout kills the script's clients with it.
    with subprocess.Popen([sys.executable, str(ROOT / "scripts" / "ndif_feasibility" / "probe_ndif.py"), *with_flags,
                           "--line", ",".join(client_lines), "--out", str(out)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ, cwd=ROOT,
                          start_new_session=True) as run:
        try:
            stdout, stderr = run.communicate(timeout=PROBE_SCRIPT_TIMEOUT_S)
            returncode = run.returncode
        except subprocess.TimeoutExpired:
            # The job's other results stand; the tests reading the probes fail on this record.
            os.killpg(run.pid, signal.SIGKILL)
            stdout, stderr = run.communicate(timeout=60)
            returncode, stderr = None, stderr + f"\n(killed after {PROBE_SCRIPT_TIMEOUT_S} s)"
        except BaseException:
            # The lane interrupted (SIGTERM): the script and its clients go first, so the stack can come down.
            os.killpg(run.pid, signal.SIGKILL)
            raise
    return {"returncode": returncode, "stdout": stdout, "stderr": stderr,
            "records": {name: [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}{flavour}-2*.json"))]
                        for name in client_lines},
            "stack_still_up": stack.healthy(cfg)}


@pytest.fixture(scope="session")
def ndif07_stock(live_stack_lane):
    return live_stack_lane.result("ndif07_stock")


@pytest.fixture(scope="session")
def ndif07_patched(live_stack_lane):
    return live_stack_lane.result("ndif07_patched")


#: What CI traces on each line's multimolecule flavour: an RNA model (multimolecule) and AntiBERTy (real
#: weights, from the antiberty wheel). The full panel is `python3 -m nnsight_repro ndif panel`.
CI_PANEL = ["rnabert", "antiberty"]


def _multimolecule_batch(stack_args: dict, scratch) -> dict:
    """:data:`CI_PANEL` through the same code as the panel command (:func:`nnsight_repro.ndif.panel.run_batch`):
    a cold stack of the line's multimolecule flavour (a folder and namespace of its own, so a plain stack of
    the line can stay up beside it), every pairing of the line, then, on the same stack, the probe script
    with ``--with multimolecule`` (``result["while_up"]["probes"]``, :func:`probe_script`) and, on 0.8, last,
    the stack run out of memory (``result["while_up"]["out_of_memory"]``, :func:`run_out_of_memory`); the
    stack is down again on return."""
    from nnsight_repro.ndif import panel

    (flavour,) = stack_args["extras"]
    line = stack_args["line"]

    def while_up(cfg) -> dict:
        found = {"probes": probe_script(cfg, scratch / "probes")}
        if line == "0.8":
            # Only here: a 0.7 stack deploys a model on its first request, so there the check would run through
            # a client's trace (README, "Not here yet").
            found["out_of_memory"] = run_out_of_memory(cfg)
        return found

    return panel.run_batch(line, CI_PANEL, 1, flavour=flavour, while_up=while_up)


#: The cap :func:`run_out_of_memory` sets: what the stack holds plus this, less than a model actor needs
#: (some 650-780 MiB measured) and more than the running services need to go on.
HEADROOM_MIB = 300
#: The model it deploys into that cap: one that neither the batch nor the probes deploy.
OUT_OF_MEMORY_MODEL = "rnafm"


def run_out_of_memory(cfg) -> dict:
    """Issue 16's bad input on a 0.8 stack the session has up anyway, last, since it breaks the stack: its
    memory cgroup capped at what its processes hold plus :data:`HEADROOM_MIB`, one more model deployed, then
    the stack brought down. What the deploy raised and after how long, the cgroup's counters either side of
    the cap, and what ``down`` reported. Whatever else raises is recorded (``raised``, ``down_error``), so
    the job's other results stand."""
    from nnsight_repro.ndif import memcg, netns, server_env, stack

    group = stack.memory_group(cfg)
    if group is None:
        return {"no_cgroup": (stack.read_state(cfg) or {}).get("memory")}
    record = {"model": OUT_OF_MEMORY_MODEL, "cgroup": str(group.path), "deploy_timeout_s": cfg.deploy_timeout,
              "raised": None}
    try:
        env = server_env.ensure(build=False, line=cfg.line, extras=cfg.extras)
        # Minted before the cap: minting runs a client, which is not what the check is about.
        minted = stack.minted_keys(cfg, [OUT_OF_MEMORY_MODEL])
        # Made before the cap is written: a kill the write itself causes counts too.
        watch = stack.MemoryWatch(group, f"while deploying {OUT_OF_MEMORY_MODEL}")
        record["before_cap"] = memcg.counters(group)
        record["limit_mib"] = record["before_cap"]["anon_mib"] + HEADROOM_MIB
        started = time.monotonic()
        memcg.set_limit(group, record["limit_mib"])
        record["after_cap"] = memcg.counters(group)
        stack.deploy_models(cfg, env, minted, watch=watch)
    except Exception as exc:
        record.update(raised=type(exc).__name__, message=str(exc))
    if "limit_mib" in record:
        record["seconds"] = round(time.monotonic() - started, 1)
    try:
        record["down"] = stack.down(cfg, say=lambda m: None)
    except Exception as exc:
        record["down_error"] = f"{type(exc).__name__}: {exc}"
    record["netns_left"], record["cgroup_left"] = netns.exists(cfg.netns), group.path.exists()
    return record


def _by_row(batch: dict) -> dict:
    """The batch with ``by``: its rows by (model, client, trace)."""
    return {**batch, "by": {(r["model"], r["client"], r["trace"]): r for r in batch["rows"]}}


@pytest.fixture(scope="session")
def ndif08_multimolecule(live_stack_lane):
    return _by_row(live_stack_lane.result("ndif08_multimolecule"))


@pytest.fixture(scope="session")
def ndif07_multimolecule(live_stack_lane):
    return _by_row(live_stack_lane.result("ndif07_multimolecule"))


#: The jobs of the live-stack lane: what each runs, ``run(stack_args, scratch)``, and the stack it runs on
#: (``config.default``'s arguments). A job brings that stack up cold, does everything the session asks of it,
#: and brings it down before it returns (a JSON record); the session brings it down again when the job returned
#: no result. ``scratch``: a folder of the job's own.
LANE_JOBS = {
    "ndif07_stock": (_everything_against_07, {"line": "0.7", "server": "stock"}),
    "ndif07_patched": (_everything_against_07, {"line": "0.7", "server": "patched"}),
    "ndif08_multimolecule": (_multimolecule_batch, {"line": "0.8", "extras": ("multimolecule",)}),
    "ndif07_multimolecule": (_multimolecule_batch, {"line": "0.7", "extras": ("multimolecule",)}),
}
#: The same jobs as the lane calls them, ``run(scratch)``.
LANE_RUNS = {job: functools.partial(run, stack_args) for job, (run, stack_args) in LANE_JOBS.items()}


def _bring_down(job: str) -> None:
    from nnsight_repro.ndif import config, stack

    stack.down(config.default(**LANE_JOBS[job][1]))


def pytest_collection_modifyitems(session, config, items):
    """Tests that read a lane job run last (unless the lane runs on demand); a mode it lacks stops the run."""
    import stack_lane

    try:
        ahead = stack_lane.mode() == "ahead"
    except stack_lane.LaneError as exc:
        raise pytest.UsageError(str(exc)) from None
    if ahead:
        items[:] = stack_lane.readers_last(items, LANE_JOBS)


@pytest.fixture(scope="session", autouse=True)
def live_stack_lane(request, tmp_path_factory, terminal_line):
    """The session's :class:`stack_lane.Lane`, started before the first test with the jobs the collected tests
    ask for; at the end, whatever it still runs is interrupted and its stack brought down."""
    import stack_lane

    lane = stack_lane.Lane(tmp_path_factory.mktemp("stack-lane"), "ndif_fixture:LANE_RUNS", _bring_down,
                           terminal_line)
    jobs = stack_lane.needed(request.session.items, LANE_JOBS) if stack_lane.mode() == "ahead" else []
    if jobs:
        terminal_line(f"[ndif] live stacks beside the tests: {', '.join(jobs)} (log: {lane.log})")
        lane.start(jobs)
    try:
        yield lane
    finally:
        lane.stop()
