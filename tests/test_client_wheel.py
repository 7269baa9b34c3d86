"""The fixed client as a researcher installs it: the project's wheel, pip-installed into a fresh venv.

The venv is what a researcher on today's NDIF has before installing: torch and transformers (the
0.7 line's pins) and no nnsight. pip itself installs the wheel, with its dependencies resolved as pip
does for anyone (all already there, so nothing is fetched). The check routine then runs in that venv
and every outcome must be the one predicted for a fixed nnsight.
"""

import json
import subprocess
import sys

import pytest

from nnsight_repro import checks, envs, models, verify, wheel
from nnsight_repro.envs import build as env_build


@pytest.fixture(scope="module")
def researcher(tmp_path_factory):
    folder = tmp_path_factory.mktemp("researcher")
    built = wheel.build(folder / "dist")
    step = env_build.stepper("researcher venv", folder / "build.log")
    python = env_build.make_venv(step, folder)
    env_build.install_pins(step, python, envs.PINS / "line-0.7.txt")
    env_build.checked(step, python, "importing torch and transformers", "import torch, transformers")
    base = getattr(sys, "_base_executable", sys.executable)
    installed = subprocess.run([base, "-m", "pip", "--python", python, "install", "--quiet", str(built)],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return {"wheel": built, "env": envs.Env("researcher", folder, {"inputs": {}})}


def test_the_wheel_reports_a_version_a_server_accepts_and_names_the_series(researcher):
    from packaging.version import Version

    names = wheel.applied_series()
    assert wheel.version(names).startswith("0.7.0+encoders.")
    reported = researcher["env"].run(["-c", "import nnsight; print(nnsight.__version__)"]).stdout.strip()
    assert reported == wheel.version(names)
    # What ndif 0.0.1 and 0.1.x do with the nnsight-version header: Version(header) < Version(minimum)
    # is refused, and the minimum of today's NDIF is its own nnsight, 0.7.0.
    assert not Version(reported) < Version("0.7.0")
    assert researcher["wheel"].name.startswith(f"nnsight-{reported}-")


def test_the_wheel_was_installed_by_pip_with_its_c_extension(researcher):
    found = researcher["env"].run(["-c", (
        "import importlib.metadata as m, importlib.util, json\n"
        "d = m.distribution('nnsight')\n"
        "print(json.dumps({'installer': (d.read_text('INSTALLER') or '').strip(),\n"
        "                  'c': importlib.util.find_spec('nnsight._c.py_mount') is not None}))")])
    assert found.returncode == 0, found.stderr[-2000:]
    assert json.loads(found.stdout) == {"installer": "pip", "c": True}


def test_the_check_routine_passes_in_the_researchers_venv(researcher):
    record = verify.record_in(researcher["env"], list(models.PANEL), checks.CHECKS)
    assert record["environment"]["nnsight"] == wheel.version(wheel.applied_series())
    for model, per_check in record["models"].items():
        for check, outcome in per_check.items():
            assert outcome["ok"] is checks.expected_ok(models.get(model), check, True), (model, check, outcome)
    assert all(outcome["ok"] for per_check in record["models"].values() for outcome in per_check.values())
