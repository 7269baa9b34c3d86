"""The local NDIF stacks as pytest fixtures, shared by every remote test (loaded from conftest.py).

``ndif_stack``: the 0.8 stack (ndif 0.1.2). ``ndif07_stock`` / ``ndif07_patched``: the 0.7 stack (ndif
0.0.1) with a stock or a patched server nnsight, and everything the session asks
of each 0.7 flavour — the negative-control pairings and the probe script's client lines that flavour
serves — done in one cold start each, because a 0.7 stack takes a minute or more to come up.
``ndif08_multimolecule`` / ``ndif07_multimolecule``: the same for each line's multimolecule flavour (a
panel batch, then the probe script with ``--with multimolecule``).

``ndif_stack`` brings the stack up once per session (building its environment if needed) and tears it
down at the end, killing only what it started. A stack a developer already started with
``nnsight-repro ndif up`` is used as it is and left running, if it is healthy; an unhealthy leftover is
stopped and replaced. When the stack cannot be brought up the fixture raises: remote tests then fail
with the reason, they never skip.
"""

import contextlib
import json
import os
import subprocess
import sys
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

    if netns.exists(cfg.netns):
        stack.down(cfg)
    state = stack.up(cfg)
    try:
        yield NdifStack(cfg, state, owned=True)
    finally:
        stack.down(cfg)


@pytest.fixture(scope="session")
def ndif_stack():
    """The session's local NDIF stack (see the module docstring): ``.cfg``, ``.state``, ``.run(cases)``."""
    from nnsight_repro.ndif import config, stack

    cfg = config.default()
    owned = stack.ensure_up(cfg)
    try:
        yield NdifStack(cfg, stack.read_state(cfg), owned=owned)
    finally:
        if owned:
            stack.down(cfg)


def _everything_against_07(server: str, scratch) -> dict:
    """The negative-control pairings, a second ``up`` (refused), Ray clients connecting as the API does,
    on the stock flavour a user's ``__main__`` Envoy subclass from the stock and the fixed client
    (``envoy_subclass_cases.run_live``), and the probe script's client lines
    served by ``server``, all while one cold 0.7 stack of that flavour runs; the stack is down on return,
    so a session that asks both flavours starts exactly two 0.7 stacks, one after the other."""
    from envoy_subclass_cases import run_live
    from nnsight_repro.ndif import config, negative_control, netns, stack

    with cold_stack(config.default(line="0.7", server=server)) as running:
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
    result["netns_left_after_down"] = netns.exists(result["netns"])
    return result


def probe_script(cfg, out) -> dict:
    """``probe_ndif.py`` run as a user runs it (no ``NDIF_HOST``) for every client line the running stack
    of ``cfg`` serves: the script finds that healthy stack of its flavour and uses it as it is, so the
    session starts no stack for the probes. Its records by client line, its output, and whether the
    stack was still up after it."""
    from nnsight_repro import ROOT
    from nnsight_repro.ndif import stack
    from nnsight_repro.ndif.feasibility.declarations import CLIENT_LINES

    client_lines = [name for name, line in CLIENT_LINES.items() if line.stack == cfg.line and line.server == cfg.server]
    flavour = "".join(f"+{name}" for name in cfg.extras)
    out.mkdir()
    environ = {k: v for k, v in os.environ.items() if k not in {"NDIF_HOST", "NDIF_API_KEY"}}
    with_flags = [flag for name in cfg.extras for flag in ("--with", name)]
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "ndif_feasibility" / "probe_ndif.py"), *with_flags,
                          "--line", ",".join(client_lines), "--out", str(out)],
                         capture_output=True, text=True, env=environ, timeout=1800, cwd=ROOT)
    return {"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr,
            "records": {name: [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}{flavour}-2*.json"))]
                        for name in client_lines},
            "stack_still_up": stack.healthy(cfg)}


@pytest.fixture(scope="session")
def ndif07_stock(tmp_path_factory):
    return _everything_against_07("stock", tmp_path_factory.mktemp("ndif07-stock"))


@pytest.fixture(scope="session")
def ndif07_patched(tmp_path_factory):
    return _everything_against_07("patched", tmp_path_factory.mktemp("ndif07-patched"))


#: What CI traces on each line's multimolecule flavour: an RNA model (multimolecule) and AntiBERTy (real
#: weights, from the antiberty wheel). The full panel is `python3 -m nnsight_repro ndif panel`.
CI_PANEL = ["rnabert", "antiberty"]


def _multimolecule_batch(line: str, scratch) -> dict:
    """:data:`CI_PANEL` through the same code as the panel command (:func:`nnsight_repro.ndif.panel.run_batch`):
    a cold stack of the line's multimolecule flavour (a folder and namespace of its own, so a plain stack of
    the line can stay up beside it), every pairing of the line, then, on the same stack, the probe script
    with ``--with multimolecule`` (``result["while_up"]``, :func:`probe_script`); the stack is down again on
    return."""
    from nnsight_repro.ndif import panel

    result = panel.run_batch(line, CI_PANEL, 1, while_up=lambda cfg: probe_script(cfg, scratch / "probes"))
    result["by"] = {(r["model"], r["client"], r["trace"]): r for r in result["rows"]}
    return result


@pytest.fixture(scope="session")
def ndif08_multimolecule(tmp_path_factory):
    return _multimolecule_batch("0.8", tmp_path_factory.mktemp("ndif08-multimolecule"))


@pytest.fixture(scope="session")
def ndif07_multimolecule(tmp_path_factory):
    return _multimolecule_batch("0.7", tmp_path_factory.mktemp("ndif07-multimolecule"))
