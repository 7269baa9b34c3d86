"""The local NDIF stacks as pytest fixtures, shared by every remote test (loaded from conftest.py).

One cold stack per server generation, each with multimolecule installed (``server_packages.SUITE``), runs every
live check of its generation:

- 0.8 (ndif 0.1.2): the lane job ``ndif08`` brings it up and runs :data:`CI_PANEL` on it through the panel's
  code and the probe script, and leaves it up; ``ndif_stack`` then hands it to the remote tests of the
  session's own process, and ``ndif08_out_of_memory`` breaks it, after every other test
  (:func:`pytest_collection_modifyitems`).
- 0.7 (ndif 0.0.1, stock nnsight 0.7.0, what the public NDIF runs): the lane job ``ndif07``: the panel batch,
  then everything else of that generation on the same stack, its API killed last (``ndif07``, and
  ``ndif07_stock`` for what ran while it was up); the stack is down when the job ends.

The lane (``tests/stack_lane.py``, :mod:`nnsight_repro.lane`) runs each job in a process of its own from before
the first test, while the offline tests run, and the modules that read a job run after the rest, so the
offline tests have both cold starts to overlap. ``NNSIGHT_REPRO_STACK_LANE=on-demand`` runs a job when a test
first asks for it instead.

Not started here: the 0.7 stack with the patched server nnsight, and stacks without multimolecule. Every 0.7
client x server pairing is checked offline as a model actor loads a request (``tests/test_wire.py``), and the
live runs of those stacks are commands whose records are committed: ``ndif negative-control``
(results/ndif_0.7) and ``probe_ndif.py`` (results/ndif_feasibility).

The session brings down at the end only what it started. A stack a developer already started with
``nnsight-repro ndif up --with multimolecule`` is used as it is and left running, if it is healthy; an
unhealthy leftover is stopped and replaced. When a stack cannot be brought up the fixtures raise: remote
tests then fail with the reason, they never skip. Each stack a session uses is its folder's ``stack_state.lease``
while it does, so a second session on the same cache waits for the first rather than bringing its stacks down.
"""

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

from envoy_subclass_cases import run_live
from nnsight_repro import ROOT, procfs
from nnsight_repro.ndif import (config, errors, health, memcg, memory_watch, negative_control, netns, panel, server_env,
                                server_packages, stack, stack_clients, stack_state)
from nnsight_repro.ndif.feasibility.declarations import PROBED_PAIRINGS


@dataclass
class NdifStack:
    cfg: object
    state: dict
    owned: bool

    def run(self, cases, client=None):
        """:mod:`nnsight_repro.ndif.remote_client` cases, run inside the namespace by a client of the stack's
        line (``client``: its environment; default the line's first, ``upstream-0.8`` for the 0.8 stack)."""
        return stack_clients.run_client(self.cfg, list(cases), client=client)

    def status(self) -> dict:
        return health.status(self.cfg)


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
def ndif_stack(ndif08, terminal_line):
    """The session's 0.8 stack, which the lane job ``ndif08`` brought up (see the module docstring):
    ``.cfg``, ``.state``, ``.run(cases)``. It is this session's to bring down if that job started it."""
    cfg = config.default(**LANE_JOBS["ndif08"][1])
    # A wait for another session's lease is said where the user sees it: it can last minutes.
    with stack_state.lease(cfg, say=lambda message: terminal_line(f"[ndif] {message}")):
        # Up already, unless it died since the job: then it is replaced here, and brought down here too.
        replaced = stack.ensure_up(cfg)
        try:
            yield NdifStack(cfg, stack_state.read_state(cfg), owned=replaced or ndif08["owned"])
        finally:
            if replaced:
                stack.down(cfg)


def _up_with_everything_on_08(stack_args: dict, scratch) -> dict:
    """The 0.8 generation's stack brought up (or a healthy one found, as ``ndif_stack`` would) and left up for
    the session's remote tests, after :data:`CI_PANEL` through the panel's code
    (:func:`nnsight_repro.ndif.panel.run_on_running_stack`) and the probe script (:func:`probe_script`) ran on
    it: the lane runs this beside the offline tests, which have its cold start to overlap. ``owned``: whether
    the job started the stack (the session then brings it down)."""
    cfg = config.default(**stack_args)
    with stack_state.lease(cfg):
        owned = stack.ensure_up(cfg)
        return {"owned": owned, "batch": panel.run_on_running_stack(cfg, CI_PANEL, 1),
                "probes": probe_script(cfg, scratch / "probes")}


def _everything_against_07(stack_args: dict, scratch) -> dict:
    """Every live check of the 0.7 generation on one cold stack (stock nnsight 0.7.0 with multimolecule, what
    a deployment that serves RNA models would run): :data:`CI_PANEL` through the panel's own code
    (:func:`nnsight_repro.ndif.panel.run_batch`), then, while that stack is up (``result["while_up"]``), the
    negative-control pairings, a second ``up`` (refused), Ray clients connecting as the API does, a user's
    ``__main__`` Envoy subclass from the stock and the fixed client (``envoy_subclass_cases.run_live``), the
    probe script's pairings this server serves and, last, since it breaks the stack, its API killed
    (:func:`kill_the_api`). The stack is down on return.

    Not here: the patched server nnsight (every client x server pairing is :mod:`tests.test_wire`'s, offline,
    as a model actor loads a request; live, ``ndif negative-control``, committed in results/ndif_0.7) and a
    server without multimolecule (the probes' committed records, results/ndif_feasibility)."""

    def while_up(cfg) -> dict:
        result = negative_control.run_pairings(cfg)
        result["status"] = health.status(cfg)
        try:
            stack.up(cfg)
            result["second_up"] = None
        except errors.StackError as exc:
            result["second_up"] = str(exc)
        result["healthy_after_second_up"] = health.healthy(cfg)
        result["netns"] = cfg.netns
        result["ray_clients"] = stack_clients.ray_client_connects(cfg, count=8, parallel=2)
        (scratch / "envoy-subclass").mkdir()
        result["envoy_subclass"] = run_live(cfg, scratch / "envoy-subclass")
        result["probes"] = probe_script(cfg, scratch / "probes")
        result["api_killed"] = kill_the_api(cfg)
        return result

    (extra,) = stack_args["extras"]
    return panel.run_batch(stack_args["line"], CI_PANEL, 1, extra=extra, while_up=while_up)


def kill_the_api(cfg) -> dict:
    """A stack whose API dies mid-run, on a stack the session has up anyway, last, since it breaks it: the API
    killed whole (each service is a process group of its own: gunicorn's master, workers and the queue
    dispatcher), then what ``status`` and a client that runs into the dead stack say, what ``down`` stopped,
    and which of the services' processes still live after it. Whatever raises is recorded (``raised``), so
    the job's other results stand."""
    found = {}
    try:
        found["started"] = {name: info["pid"] for name, info in stack_state.read_state(cfg)["services"].items()}
        api = found["started"]["api"]
        os.killpg(api, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while api in netns.pids(cfg.netns) and time.monotonic() < deadline:
            time.sleep(0.1)  # SIGKILL is delivered asynchronously
        found["problems"] = health.status(cfg)["problems"]
        found["client"] = stack_clients.run_client(cfg, ["trace:gpt2"])["trace:gpt2"]
        found["down"] = stack.down(cfg, say=lambda m: None)
        found["netns_left"] = netns.exists(cfg.netns)
        found["alive_after_down"] = [pid for pid in found["started"].values() if not procfs.exited(pid)]
    except Exception:
        found["raised"] = traceback.format_exc()
    return found


#: A bound on one probe script run, past the silences its runner tolerates (``runner.NO_ANSWER_S`` each).
PROBE_SCRIPT_TIMEOUT_S = 1800


def probe_script(cfg, out) -> dict:
    """``probe_ndif.py`` run as a user runs it (no ``NDIF_HOST``) for every pairing the running stack
    of ``cfg`` serves, every probe: the script finds that healthy stack with its extras and uses it as it is,
    so the session starts no stack for the probes. Its records by pairing, the folder it wrote them to
    (``out``), its output, and whether the stack was still up after it."""
    pairings = [name for name, p in PROBED_PAIRINGS.items() if p.line == cfg.line and p.server == cfg.server]
    suffix = "".join(f"+{name}" for name in cfg.extras)
    out.mkdir()
    environ = {k: v for k, v in os.environ.items() if k not in {"NDIF_HOST", "NDIF_API_KEY"}}
    with_flags = [flag for name in cfg.extras for flag in ("--with", name)]
    # Its own session, so a timeout kills the script's clients with it.
    with subprocess.Popen([sys.executable, str(ROOT / "scripts" / "ndif_feasibility" / "probe_ndif.py"), *with_flags,
                           "--pairing", ",".join(pairings), "--out", str(out)],
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
    return {"returncode": returncode, "stdout": stdout, "stderr": stderr, "out": str(out),
            "records": {name: [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}{suffix}-2*.json"))]
                        for name in pairings},
            "stack_still_up": health.healthy(cfg)}


@pytest.fixture(scope="session")
def ndif07(live_stack_lane):
    """The 0.7 generation's lane job (:func:`_everything_against_07`): the batch's rows by (model, client,
    trace) in ``by``, and what ran while its stack was up in ``while_up`` (None if it never got that far)."""
    return _by_row(live_stack_lane.result("ndif07"))


@pytest.fixture(scope="session")
def ndif07_stock(ndif07):
    """What ran on the 0.7 stack while it was up (the pairings, the probes, ...), and whether its namespace
    outlived its ``down``."""
    if not ndif07.get("while_up"):
        pytest.fail(f"the 0.7 stack never got past its panel batch: {ndif07['rows'][0]}")
    return {**ndif07["while_up"], "netns_left_after_down": ndif07["netns_left_after_down"]}


#: What CI traces through the panel's code on each generation's stack: an RNA model (multimolecule) and
#: AntiBERTy (real weights, from the antiberty wheel). The full panel is `python3 -m nnsight_repro ndif panel`.
CI_PANEL = ["rnabert", "antiberty"]


@pytest.fixture(scope="session")
def ndif08(live_stack_lane):
    """The 0.8 generation's lane job (:func:`_up_with_everything_on_08`); its stack is up after it, and down
    at the end of the session if the job started it."""
    record = live_stack_lane.result("ndif08")
    try:
        yield record
    finally:
        if record["owned"]:
            bring_down("ndif08")


@pytest.fixture(scope="session")
def ndif08_batch(ndif08):
    """:data:`CI_PANEL` on the session's 0.8 stack through the panel command's code (deployed, traced by every
    client of the generation, rows judged): the batch's record, its rows by (model, client, trace) in ``by``."""
    return _by_row(ndif08["batch"])


@pytest.fixture(scope="session")
def ndif08_out_of_memory(ndif_stack):
    """:func:`run_out_of_memory` on the session's 0.8 stack. It breaks the stack, so the tests that ask for it
    run after every other (:func:`pytest_collection_modifyitems`), and only on a stack this session owns."""
    if not ndif_stack.owned:
        pytest.fail("The out-of-memory check breaks the stack it runs on, and this session did not start the "
                    "running 0.8 multimolecule stack: bring it down (`python3 -m nnsight_repro ndif down --with "
                    "multimolecule`) and run the session again.")
    return run_out_of_memory(ndif_stack.cfg)


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
    group = memory_watch.memory_group(cfg)
    if group is None:
        return {"no_cgroup": (stack_state.read_state(cfg) or {}).get("memory")}
    record = {"model": OUT_OF_MEMORY_MODEL, "cgroup": str(group.path), "deploy_timeout_s": cfg.deploy_timeout,
              "raised": None}
    try:
        env = server_env.ensure(build=False, line=cfg.line, extras=cfg.extras)
        # Minted before the cap: minting runs a client, which is not what the check is about.
        minted = stack.minted_keys(cfg, [OUT_OF_MEMORY_MODEL])
        # Made before the cap is written: a kill the write itself causes counts too.
        watch = memory_watch.MemoryWatch(group, f"while deploying {OUT_OF_MEMORY_MODEL}")
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


#: The jobs of the live-stack lane: what each runs, ``run(stack_args, scratch)``, and the stack it runs on
#: (``config.default``'s arguments). A job does everything the session asks of that stack beside the offline
#: tests and returns a JSON record; ``ndif07`` brings its stack down before it returns, ``ndif08`` leaves its up
#: for the session's remote tests (:func:`ndif08` brings it down at the end). The session brings a stack down
#: again when its job returned no result. ``scratch``: a folder of the job's own.
LANE_JOBS = {
    "ndif08": (_up_with_everything_on_08, {"extras": server_packages.SUITE}),
    "ndif07": (_everything_against_07, {"line": "0.7", "extras": server_packages.SUITE}),
}
#: The same jobs as the lane calls them, ``run(scratch)``.
LANE_RUNS = {job: functools.partial(run, stack_args) for job, (run, stack_args) in LANE_JOBS.items()}


def bring_down(job: str) -> None:
    """Brings the stack of lane job ``job`` down (idempotent): what a lane killed mid-job left up."""
    stack.down(config.default(**LANE_JOBS[job][1]))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Last of all, after the lane's readers (tests/stack_lane.py): the test that breaks the 0.8 stack."""
    breaking = [item for item in items if "ndif08_out_of_memory" in getattr(item, "fixturenames", ())]
    items[:] = [item for item in items if item not in breaking] + breaking
