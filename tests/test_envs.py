"""Environments: built once, reused warm, and refused with a named fix when they cannot be trusted."""

import json
import subprocess
import sys

import pytest

from nnsight_repro import ROOT, envs


@pytest.fixture
def scratch_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NNSIGHT_REPRO_CACHE", str(tmp_path))
    return tmp_path


def test_unknown_environment_is_refused_naming_the_known_ones():
    with pytest.raises(envs.EnvError, match="main, patched, upstream-0.8"):
        envs.ensure("nightly")


def test_built_environment_is_reused_without_building():
    env = envs.ensure("patched", build=False)
    assert env.stamp["digest"] == envs.digest_of(envs.inputs(envs.spec("patched")))


def test_half_built_environment_is_never_used(scratch_cache):
    (scratch_cache / "envs" / "main" / "venv" / "bin").mkdir(parents=True)
    with pytest.raises(envs.EnvError, match="did not finish.*envs build main"):
        envs.ensure("main", build=False)


def test_environment_from_other_pins_is_refused_naming_what_changed(scratch_cache):
    path = scratch_cache / "envs" / "main"
    (path / "venv" / "bin").mkdir(parents=True)
    (path / "venv" / "bin" / "python").touch()
    inputs = {**envs.inputs(envs.spec("main")), "pins_sha256": "0" * 64}
    (path / "env.json").write_text(json.dumps({"digest": envs.digest_of(inputs), "inputs": inputs}))
    with pytest.raises(envs.EnvError, match="other inputs .*pins_sha256.*envs build main"):
        envs.ensure("main", build=False)


def test_sdist_with_another_hash_is_refused(scratch_cache):
    (scratch_cache / "sdists").mkdir()
    (scratch_cache / "sdists" / "nnsight-0.7.0.tar.gz").write_bytes(b"not the release")
    with pytest.raises(envs.EnvError, match="not the pinned .*Delete it"):
        envs.sdist("0.7.0", envs.spec("main").sdist_sha256)


def test_missing_sdist_names_where_to_put_it(scratch_cache):
    with pytest.raises(envs.EnvError, match=r"put nnsight-0\.0\.0\.tar\.gz into"):
        envs.sdist("0.0.0", "0" * 64)


def test_verify_rejects_unknown_names_before_touching_any_environment(scratch_cache):
    result = subprocess.run([sys.executable, "-m", "nnsight_repro", "verify", "--models", "bert-mlm,nope"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "unknown model(s) nope" in result.stderr
    assert not (scratch_cache / "envs").exists()
