"""The local verify, run once per session and read by every test that asserts on the check routine's records.

``python3 -m nnsight_repro verify`` is the project's main job: every model (PANEL and the RNA/protein
panel), every check, in main, patched and upstream-0.8. The negative control, the panel tests and the
verify tests all read its report, so the suite asserts on what users run, and the routine runs once
per environment instead of once per test module. Environments are built by ``python3 -m nnsight_repro
test``; a missing one fails the command, never skips a test.
"""

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from nnsight_repro import ROOT


@dataclass
class LocalVerify:
    path: Path
    seconds: float
    report: dict


@pytest.fixture(scope="session")
def local_verify(tmp_path_factory) -> LocalVerify:
    out = tmp_path_factory.mktemp("local-verify")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "nnsight_repro", "verify", "--out", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=1800)
    seconds = time.monotonic() - started
    if result.returncode:
        pytest.fail(f"nnsight-repro verify exited {result.returncode}:\n{result.stderr[-3000:]}")
    written = sorted(out.glob("local-*.json"))
    assert len(written) == 1, written
    return LocalVerify(written[0], seconds, json.loads(written[0].read_text()))
