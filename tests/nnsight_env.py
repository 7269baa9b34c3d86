"""``pytest tests/...`` from any interpreter: without nnsight, the run moves into a project environment.

Loaded from conftest.py (``pytest_plugins``). The suite runs against whatever nnsight the interpreter
imports. An interpreter without one (the system ``python3`` with pytest, on a fresh clone) cannot
collect it, so before collection this plugin builds the chosen environment if needed (``patched`` by
default; ``--nnsight-env NAME`` or ``NNSIGHT_REPRO_TEST_ENV=NAME`` picks ``main`` or ``upstream-0.8``),
says so in one line and replaces the process with that environment's ``python -m pytest`` and the same
arguments, from the same directory. An interpreter that has nnsight runs the suite itself, as always,
unless an environment is named explicitly and it is not that one.

It never re-executes from inside a project environment (``NNSIGHT_REPRO_ENV`` is set there): a second
hop could only loop.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from nnsight_repro import settings

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = "patched"
VARIABLE = settings.variable("TEST_ENV")

def pytest_addoption(parser):
    parser.addoption("--nnsight-env", default=None, metavar="NAME",
                     help=f"run the suite in this project environment (main, patched, upstream-0.8); default: "
                          f"the interpreter's own nnsight, or {DEFAULT} when it has none (also ${VARIABLE})")


def chosen(config):
    """The environment to move into, or None to run here."""
    named = config.getoption("--nnsight-env") or os.environ.get(VARIABLE) or None
    inside = settings.setting("ENV")
    if inside:
        if named and named != inside:
            raise pytest.UsageError(f"This interpreter is the {inside!r} environment; run pytest from a "
                                    f"plain interpreter to use {named!r}.")
        return None
    if named:
        return named
    return None if importlib.util.find_spec("nnsight") else DEFAULT


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    name = chosen(config)
    if name is None:
        return
    from nnsight_repro import envs

    reason = "this interpreter has no nnsight" if not importlib.util.find_spec("nnsight") else "asked for"
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()  # the new process must write to the real terminal, not pytest's capture
    try:
        env = envs.ensure(name)
    except envs.EnvError as exc:
        raise pytest.UsageError(str(exc)) from None
    args = list(config.invocation_params.args)
    print(f"[nnsight-repro] {reason}: running pytest in the {name!r} environment ({env.python}); "
          f"--nnsight-env or ${VARIABLE} picks main, patched or upstream-0.8", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.chdir(config.invocation_params.dir)
    os.execve(str(env.python), [str(env.python), "-m", "pytest", *args], env.environ())
