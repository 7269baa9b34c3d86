"""The local NDIF stacks as pytest fixtures, shared by every remote test (loaded from conftest.py).

``ndif_stack``: the 0.8 stack (ndif 0.1.2). ``ndif07_stacks``: the 0.7 stack (ndif 0.0.1), one server
flavour at a time (see its docstring).

``ndif_stack`` brings the stack up once per session (building its environment if needed) and tears it
down at the end, killing only what it started. A stack a developer already started with
``nnsight-repro ndif up`` is used as it is and left running, if it is healthy; an unhealthy leftover is
stopped and replaced. When the stack cannot be brought up the fixture raises: remote tests then fail
with the reason, they never skip.
"""

from dataclasses import dataclass

import contextlib

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
