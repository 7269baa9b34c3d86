"""The local NDIF stacks as pytest fixtures, shared by every remote test (loaded from conftest.py).

``ndif_stack``: the 0.8 stack (ndif 0.1.2). ``ndif07_stacks``: the 0.7 stack (ndif 0.0.1), one server
flavour at a time (see its docstring). ``ndif07_stock`` / ``ndif07_patched``: everything the session asks
of each 0.7 flavour — the negative-control pairings and the probe script's client lines that flavour
serves — done in one cold start each, because a 0.7 stack takes a minute or more to come up.

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


@pytest.fixture(scope="session")
def ndif_stack():
    """The session's local NDIF stack (see the module docstring): ``.cfg``, ``.state``, ``.run(cases)``."""
    from nnsight_repro.ndif import config, netns, stack

    cfg = config.default()
    if stack.healthy(cfg):
        yield NdifStack(cfg, stack.read_state(cfg), owned=False)
        return
    if netns.exists(cfg.netns):
        stack.down(cfg)
    state = stack.up(cfg)
    try:
        yield NdifStack(cfg, state, owned=True)
    finally:
        stack.down(cfg)


class Ndif07Stacks:
    """The 0.7 stack, one server flavour at a time: ``with stacks.running("stock") as s: ...``.

    Each ``running`` brings a stack up cold (a leftover 0.7 stack in this cache's namespace, of either
    flavour, is stopped first) and always brings it down on leaving, so a session that runs both
    flavours starts exactly two stacks, one after the other. A failure to come up raises: the tests
    using it fail with the reason, they never skip.
    """

    @contextlib.contextmanager
    def running(self, server: str):
        from nnsight_repro.ndif import config, netns, stack

        cfg = config.default(line="0.7", server=server)
        if netns.exists(cfg.netns):
            stack.down(cfg)
        state = stack.up(cfg)
        try:
            yield NdifStack(cfg, state, owned=True)
        finally:
            stack.down(cfg)


@pytest.fixture(scope="session")
def ndif07_stacks():
    """Brings up the 0.7 stack (ndif 0.0.1) per server flavour: see :class:`Ndif07Stacks`."""
    return Ndif07Stacks()


def _everything_against_07(stacks: Ndif07Stacks, server: str, out) -> dict:
    """The negative-control pairings, a second ``up`` (refused), and the probe script's client lines
    served by ``server``, all while one cold stack of that flavour runs; the stack is down on return."""
    from nnsight_repro import ROOT
    from nnsight_repro.ndif import negative_control, netns, stack

    probe_ndif = ROOT / "scripts" / "ndif_feasibility" / "probe_ndif.py"
    sys.path.insert(0, str(probe_ndif.parent))
    try:
        import probe_ndif as runner
    finally:
        sys.path.remove(str(probe_ndif.parent))
    client_lines = [name for name, line in runner.CLIENT_LINES.items() if line.stack == "0.7" and line.server == server]
    with stacks.running(server) as running:
        result = negative_control.run_pairings(running.cfg)
        result["status"] = running.status()
        try:
            stack.up(running.cfg)
            result["second_up"] = None
        except stack.StackError as exc:
            result["second_up"] = str(exc)
        result["healthy_after_second_up"] = stack.healthy(running.cfg)
        result["netns"] = running.cfg.netns
        # The probe script finds this healthy stack of the right flavour and uses it as it is.
        environ = {k: v for k, v in os.environ.items() if k not in {"NDIF_HOST", "NDIF_API_KEY"}}
        run = subprocess.run([sys.executable, str(probe_ndif), "--line", ",".join(client_lines), "--out", str(out)],
                             capture_output=True, text=True, env=environ, timeout=1800, cwd=ROOT)
        result["probes"] = {"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr,
                            "records": {name: [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-2*.json"))]
                                        for name in client_lines},
                            "stack_still_up": stack.healthy(running.cfg)}
    result["netns_left_after_down"] = netns.exists(result["netns"])
    return result


@pytest.fixture(scope="session")
def ndif07_stock(ndif07_stacks, tmp_path_factory):
    return _everything_against_07(ndif07_stacks, "stock", tmp_path_factory.mktemp("probes-07-stock"))


@pytest.fixture(scope="session")
def ndif07_patched(ndif07_stacks, tmp_path_factory):
    return _everything_against_07(ndif07_stacks, "patched", tmp_path_factory.mktemp("probes-07-patched"))
