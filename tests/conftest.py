"""Fixtures shared by the suite: tiny offline models, built once per session.

The suite runs against whatever nnsight this interpreter imports; what differs
between nnsight lines comes from ``nnsight_repro.lines``.
"""

import os

# Before transformers is imported anywhere: nothing may reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import subprocess
import sys

import pytest

# The local NDIF stack, shared by every remote test, and the local verify, shared by every test of
# the check routine's records (tests/ndif_fixture.py, tests/verify_fixture.py).
pytest_plugins = ["nnsight_env", "ndif_fixture", "verify_fixture"]

# Imports nnsight, then unpickles whatever classes it is sent and names them.
# It never wraps a model, so it has never built an encoder's classes itself.
FRESH_INTERPRETER = (
    "import pickle, sys\n"
    "from nnsight.intervention.envoy import Envoy\n"
    "classes = pickle.loads(sys.stdin.buffer.read())\n"
    "assert all(issubclass(c, Envoy) for c in classes), classes\n"
    "print(' '.join(f'{c.__module__}.{c.__qualname__}' for c in classes))\n"
)


def pytest_configure(config):
    """Start the fresh interpreter before this one imports nnsight, so the two imports overlap."""
    if any("test_envoy_overloaded_mount" in str(arg) or str(arg).rstrip("/").endswith("tests")
           for arg in config.args):
        config.fresh_interpreter = subprocess.Popen(
            [sys.executable, "-c", FRESH_INTERPRETER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )


def pytest_unconfigure(config):
    child = getattr(config, "fresh_interpreter", None)
    if child is not None and child.poll() is None:
        child.kill()
        child.wait()


@pytest.fixture(scope="session")
def fresh_interpreter(request):
    """The child started in ``pytest_configure`` (or a new one, if this run did not start it)."""
    child = getattr(request.config, "fresh_interpreter", None)
    if child is None:
        child = subprocess.Popen([sys.executable, "-c", FRESH_INTERPRETER], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return child


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
