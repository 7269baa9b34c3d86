"""The local NDIF stack as a pytest fixture, shared by every remote test (loaded from conftest.py).

``ndif_stack`` brings the stack up once per session (building its environment if needed) and tears it
down at the end, killing only what it started. A stack a developer already started with
``nnsight-repro ndif up`` is used as it is and left running, if it is healthy; an unhealthy leftover is
stopped and replaced. When the stack cannot be brought up the fixture raises: remote tests then fail
with the reason, they never skip.
"""

from dataclasses import dataclass

import pytest


@dataclass
class NdifStack:
    cfg: object
    state: dict
    owned: bool

    def run(self, cases):
        """:mod:`nnsight_repro.ndif.remote_client` cases, run by an nnsight 0.8 client inside the namespace."""
        from nnsight_repro.ndif import stack

        return stack.run_client(self.cfg, list(cases))

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
