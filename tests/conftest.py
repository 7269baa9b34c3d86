"""Fixtures shared by the suite: tiny offline models, built once per session.

The suite runs against whatever nnsight this interpreter imports; what differs
between nnsight lines comes from ``nnsight_repro.lines``.
"""

import os

from nnsight_repro.settings import HF_OFFLINE

# Before transformers is imported anywhere: nothing may reach the hub.
for name, value in HF_OFFLINE.items():
    os.environ.setdefault(name, value)
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest

# The local NDIF stacks, shared by every remote test, the lane that runs the 0.7 one beside the other tests,
# and the local verify, shared by every test of the check routine's records (tests/ndif_fixture.py,
# tests/stack_lane.py, tests/verify_fixture.py).
pytest_plugins = ["nnsight_env", "ndif_fixture", "stack_lane", "verify_fixture"]


@pytest.fixture(scope="session")
def line():
    from nnsight_repro import lines

    return lines.current()


@pytest.fixture(scope="session")
def subject():
    """``subject(name)``: a panel model wrapped the way a user would, built once per name."""
    from nnsight_repro import checks

    built = {}

    def get(name):
        if name not in built:
            built[name] = checks.Subject(name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def bert():
    """``bert(layers)``: a tiny random BertForMaskedLM, built once per depth."""
    from nnsight_repro import models

    built = {}

    def get(layers=2):
        if layers not in built:
            built[layers] = models.build_model(models.get("bert-mlm"), layers)
        return built[layers]

    return get


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # Every fixture is torn down and every report written by now. What is left is the interpreter's last
    # full garbage collection at exit: about 2 of the 10 s an `import nnsight` process takes on this
    # machine, most of it walking torch's, transformers' and nnsight's live objects again. One collection
    # here finalizes whatever the last teardown left (whichever pytest runs this); what survives it is
    # frozen, so the exit's collection skips it. The memory goes back to the system with the process.
    import gc

    gc.collect()
    gc.freeze()
