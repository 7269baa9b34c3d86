"""A stack folder's lease (nnsight_repro.ndif.stack_state.lease): a second user waits for the first, a user the
holder started goes on, and a holder that dies frees it. No stack runs: the lease needs only a folder."""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from nnsight_repro import ROOT
from nnsight_repro.ndif import errors, stack_state

#: A process that takes the lease of the folder in argv[1], says so by creating argv[1]/held, and keeps it
#: until argv[1]/release appears; argv[1]/letting-go is created just before it lets go.
HOLDER = """
import sys, time
from pathlib import Path
from types import SimpleNamespace
from nnsight_repro.ndif import errors, stack_state
folder = Path(sys.argv[1])
with stack_state.lease(SimpleNamespace(folder=folder, line="0.8"), say=lambda m: None, wait_s=0):
    (folder / "held").touch()
    while not (folder / "release").exists():
        time.sleep(0.05)
    (folder / "letting-go").touch()
"""

#: A process that takes the lease once, without waiting, and exits 0 if it got it; it leaves its parent's pid
#: in argv[1]/taker-parent.
TAKER = """
import os, sys
from pathlib import Path
from types import SimpleNamespace
from nnsight_repro.ndif import errors, stack_state
folder = Path(sys.argv[1])
(folder / "taker-parent").write_text(str(os.getppid()))
with stack_state.lease(SimpleNamespace(folder=folder, line="0.8"), say=lambda m: None, wait_s=0):
    pass
"""


def python(code, folder):
    return [sys.executable, "-c", code, str(folder)]


def env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture
def cfg(tmp_path):
    return SimpleNamespace(folder=tmp_path, line="0.8")


@pytest.fixture
def holder(cfg):
    """Another process holding the lease (it is not this test's ancestor), released or killed by the test."""
    process = subprocess.Popen(python(HOLDER, cfg.folder), env=env(), cwd=ROOT)
    deadline = time.monotonic() + 60
    while not (cfg.folder / "held").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the holder never took the lease"
        time.sleep(0.05)
    yield process
    (cfg.folder / "release").touch()
    process.wait(timeout=60)


def test_a_second_user_waits_for_the_holder_and_takes_the_lease_once_it_lets_go(cfg, holder):
    said = []

    def say(message):  # the holder is told to let go only once the wait has been said
        said.append(message)
        (cfg.folder / "release").touch()

    with stack_state.lease(cfg, say=say, wait_s=60):
        assert (cfg.folder / "letting-go").exists(), "the lease was taken while its holder still held it"
    assert len(said) == 2, said
    assert f"in use by pid {holder.pid} (" in said[0] and "waiting" in said[0], said
    assert said[1].startswith("the 0.8 stack's folder is free after"), said


def test_a_lease_still_held_after_the_wait_raises_naming_the_holder_and_the_fix(cfg, holder):
    with pytest.raises(errors.StackError) as raised:
        with stack_state.lease(cfg, say=lambda m: None, wait_s=1):
            pytest.fail("the lease was taken while another process held it")
    message = str(raised.value)
    assert f"still in use by pid {holder.pid}" in message and str(cfg.folder) in message, message
    assert "NNSIGHT_REPRO_CACHE" in message, message


def test_a_process_the_holder_started_goes_on_under_its_lease(cfg):
    said = []
    with stack_state.lease(cfg, say=said.append, wait_s=0):
        with stack_state.lease(cfg, say=said.append, wait_s=0):  # the holder itself, again
            pass
        child = subprocess.run(python(TAKER, cfg.folder), env=env(), cwd=ROOT, capture_output=True, text=True,
                               timeout=60)
        # Further down than a child: the whole ancestry counts, whatever the holder starts in between.
        grandchild = subprocess.run(["sh", "-c", '"$@"; exit $?', "sh", *python(TAKER, cfg.folder)],
                                    env=env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert grandchild.returncode == 0, grandchild.stderr
    assert (cfg.folder / "taker-parent").read_text() != str(os.getpid()), "the shell did not stay in between"
    assert said == []


def test_a_holder_killed_outright_frees_the_lease(cfg, holder):
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=60)
    said = []
    with stack_state.lease(cfg, say=said.append, wait_s=0):
        assert (cfg.folder / ".lease").read_text() == str(os.getpid())
    assert said == []
