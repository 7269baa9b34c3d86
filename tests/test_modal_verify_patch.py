"""``modal_verify_patch.py`` offline, and the local verify that writes the same report.

Nothing of Modal is faked: the file is imported, asked for ``--help``, run
without a token, and its function is called with ``.local()``, all for real.
Modal's client lives in the ``tools`` environment (never in an environment under
test), so those steps run there as subprocesses. Any Modal token of the user is
hidden from every one of them: ``MODAL_*`` variables are dropped and
``MODAL_CONFIG_PATH`` names a file that does not exist, so nothing can reach
Modal's servers whoever runs the suite.
"""

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nnsight_repro import ROOT, channel, checks, envs, models, series, verify

SERIES = "nnsight-v0.7.0"
#: Small enough to keep the `.local()` run short, wide enough to show a failing and a numeric check.
LOCAL_MODELS = ["gpt2", "bert-mlm"]
LOCAL_CHECKS = ["synthesized_classes", "remote_key", "embedding_shift"]


@pytest.fixture(scope="session")
def tools():
    return envs.ensure("tools")


def without_modal_token(environ: dict) -> dict:
    hidden = {k: v for k, v in environ.items() if not k.startswith("MODAL_")}
    hidden["MODAL_CONFIG_PATH"] = str(ROOT / ".no-such-dir" / "modal.toml")
    return hidden


def in_tools(tools, args, extra_env=None, timeout=600) -> subprocess.CompletedProcess:
    """``args`` run by the tools environment's python (or its ``modal`` when args[0] == "modal"), from the root."""
    program = [str(tools.python.with_name("modal")), *args[1:]] if args[0] == "modal" else [str(tools.python), *args]
    return subprocess.run(program, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=without_modal_token(tools.environ(extra_env)))


def json_from(tools, code: str, extra_env=None) -> dict:
    """The record ``code`` sends (``send(...)``); it runs with ``modal_verify_patch`` imported as ``m``."""
    return channel.run_one([str(tools.python), "-c",
                            "import json, modal_verify_patch as m\nfrom nnsight_repro.channel import send\n" + code],
                           env=without_modal_token(tools.environ(extra_env)), cwd=ROOT, timeout=600,
                           what="the 'tools' environment (modal_verify_patch imported)")


def series_copy(tmp_path: Path) -> Path:
    """A copy of patches/ to spoil; NNSIGHT_REPRO_PATCHES points the project at it."""
    target = tmp_path / "patches"
    shutil.copytree(ROOT / "patches", target)
    return target


def spoil_a_context_line(patch: Path) -> None:
    """Change the first context line of the first hunk, so the patch no longer fits its base."""
    lines = patch.read_text().splitlines(keepends=True)
    in_hunk = False
    for i, line in enumerate(lines):
        in_hunk = in_hunk or line.startswith("@@")
        if in_hunk and line.startswith(" ") and line.strip():
            lines[i] = " # not what the base has\n"
            break
    else:
        raise AssertionError(f"{patch} has no context line to spoil")
    patch.write_text("".join(lines))


# The Modal file ----------------------------------------------------------------------------------------------

def test_modal_file_builds_its_app_image_and_function_without_contacting_modal(tools):
    built = json_from(tools, (
        "import modal\n"
        "send({'app': isinstance(m.app, modal.App), 'name': m.app.name, 'app_id': m.app.app_id,\n"
        "  'image': isinstance(m.image, modal.Image), 'function': isinstance(m.check_main_and_patched, modal.Function),\n"
        "  'entrypoint': isinstance(m.main, modal.app.LocalEntrypoint),\n"
        "  'same_app': m.check_main_and_patched.app is m.app and m.main.app is m.app})"))
    assert built == {"app": True, "name": "nnsight-verify-patch", "app_id": None, "image": True, "function": True,
                     "entrypoint": True, "same_app": True}


def test_modal_run_help_lists_the_entrypoint_flags(tools):
    result = in_tools(tools, ["modal", "run", "modal_verify_patch.py", "--help"], timeout=120)
    assert result.returncode == 0, result.stderr
    for flag in ("--models", "--checks", "--gpu", "--out"):
        assert flag in result.stdout, (flag, result.stdout)


def test_modal_run_without_a_token_fails_fast_with_modals_own_message(tools):
    started = time.monotonic()
    result = in_tools(tools, ["modal", "run", "modal_verify_patch.py"], timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert "Token missing" in result.stdout + result.stderr, result.stdout + result.stderr
    assert elapsed < 30, f"took {elapsed:.1f} s: it must fail before trying to reach Modal"


def test_image_uses_the_base_commit_and_the_series_in_patches(tools):
    image = json_from(tools, (
        "send({'commit': m.BASE_COMMIT, 'series_dir': str(m.SERIES_DIR), 'pins': str(m.PINS_FILE),\n"
        "  'main': m.main_source_commands(), 'patched': m.patched_source_commands(),\n"
        "  'series_in_image': m.IMAGE_SERIES_DIR})"))
    base = series.base(SERIES)
    assert image["commit"] == base.commit and len(image["commit"]) == 40
    assert Path(image["series_dir"]) == ROOT / "patches" / SERIES
    assert Path(image["pins"]) == ROOT / "nnsight_repro" / "pins" / "line-0.7.txt"
    for commands in (image["main"], image["patched"]):
        # Checked out by the full SHA, and the build fails unless HEAD is exactly it.
        assert any(f"checkout --quiet --detach {base.commit}" in c for c in commands), commands
        assert any(f'rev-parse HEAD)" = {base.commit}' in c for c in commands), commands
    applying = [c for c in image["patched"] if " am " in c]
    assert len(applying) == 1 and f"{image['series_in_image']}/series" in applying[0], image["patched"]
    assert not any(" am " in c for c in image["main"])


def test_main_and_patched_are_installed_by_the_same_steps_with_one_version_string(tools):
    steps = json_from(tools, "send({v: m.install_commands(v) for v in ('main', 'patched')})")
    assert [s.replace("/patched/", "/main/") for s in steps["patched"]] == steps["main"]
    assert any("SETUPTOOLS_SCM_PRETEND_VERSION_FOR_NNSIGHT=0.7.0 " in s for s in steps["main"]), steps["main"]


@pytest.fixture(scope="module")
def modal_side(tools, tmp_path_factory):
    """``check_main_and_patched.local()`` against this machine's environments, then the entrypoint's writer."""
    out = tmp_path_factory.mktemp("modal-report")
    return json_from(tools, (
        "from pathlib import Path\n"
        "from nnsight_repro import envs\n"
        f"result = m.check_main_and_patched.local({','.join(LOCAL_MODELS)!r}, {','.join(LOCAL_CHECKS)!r},\n"
        "                                        envs_root=str(envs.cache_dir() / 'envs'))\n"
        f"path = m.write_report(result, Path({str(out)!r}))\n"
        "send({'result': result, 'report': str(path)})"))


def test_check_function_runs_the_routine_in_main_then_patched(modal_side):
    result = modal_side["result"]
    assert set(result) == {"records", "source_heads", "check_routine_digest", "machine", "ran_on_modal"}
    assert list(result["records"]) == ["main", "patched"]
    for variant, record in result["records"].items():
        environment = record["environment"]
        assert environment["env"] == variant and environment["nnsight"] == "0.7.0"
        assert f"/envs/{variant}/venv/" in environment["nnsight_file"], environment["nnsight_file"]
        assert isinstance(environment["nnsight_c_extension"], bool)
        assert list(record["models"]) == LOCAL_MODELS
        assert all(list(checks) == LOCAL_CHECKS for checks in record["models"].values())
    assert not result["records"]["main"]["models"]["bert-mlm"]["synthesized_classes"]["ok"]
    assert result["records"]["patched"]["models"]["bert-mlm"]["synthesized_classes"]["ok"]
    assert result["check_routine_digest"] == verify.check_routine_digest()
    assert result["ran_on_modal"] is False


def test_report_of_a_local_call_does_not_pass_for_a_modal_run(modal_side):
    path = Path(modal_side["report"])
    report = json.loads(path.read_text())
    assert path.name.startswith("modal-local-"), path.name
    assert report["provenance"]["runner"] == "modal-local" and report["provenance"]["details"]["ran_on_modal"] is False


def test_modal_report_has_the_schema_and_inputs_of_the_local_verify(modal_side, local_verify):
    remote = json.loads(Path(modal_side["report"]).read_text())
    local = json.loads(local_verify.path.read_text())
    assert list(remote) == list(local)
    assert remote["schema"] == local["schema"] == verify.SCHEMA
    assert set(remote["provenance"]) == set(local["provenance"])
    assert set(remote["provenance"]["machine"]) == set(local["provenance"]["machine"])
    assert (remote["provenance"]["runner"], local["provenance"]["runner"]) == ("modal-local", "local")
    assert remote["inputs"] == local["inputs"]
    for variant in ("main", "patched"):
        assert set(remote["environments"][variant]) == set(local["environments"][variant])
        for model in LOCAL_MODELS:
            for check in LOCAL_CHECKS:
                assert (set(remote["outcomes"][model][check][variant])
                        == set(local["outcomes"][model][check][variant])), (model, check, variant)
    assert set(remote["plots"]) == set(LOCAL_MODELS)
    assert all((Path(modal_side["report"]).parent / name).is_file() for name in remote["plots"].values())


@pytest.mark.parametrize("flag, value, message", [
    ("models", "gpt2,nope", "unknown model(s) nope"),
    ("checks", "remote_key,nope", "unknown check(s) nope"),
])
def test_modal_entrypoint_refuses_unknown_names_before_calling_modal(tools, flag, value, message):
    # Were the names checked after the call, the call itself would fail first: the app is not running.
    refused = json_from(tools, (
        "try:\n"
        f"    m.main({flag}={value!r}, out='/nonexistent')\n"
        "except Exception as exc:\n"
        "    send({'error': type(exc).__name__, 'message': str(exc)})\n"))
    assert refused["error"] == "EnvError" and message in refused["message"], refused


def test_modal_run_refuses_a_series_based_on_another_commit(tools, tmp_path):
    patches = series_copy(tmp_path)
    listing = patches / SERIES / "series"
    listing.write_text(listing.read_text().replace(series.base(SERIES).commit, "1" * 40))
    result = in_tools(tools, ["modal", "run", "modal_verify_patch.py"], {"NNSIGHT_REPRO_PATCHES": str(patches)})
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "SeriesError" in output and "1" * 40 in output, output[-3000:]
    assert "Token missing" not in output, "it got as far as Modal"


def test_modal_run_refuses_a_series_that_does_not_apply(tools, tmp_path):
    patches = series_copy(tmp_path)
    spoil_a_context_line(sorted((patches / SERIES).glob("0001-*.patch"))[0])
    result = in_tools(tools, ["modal", "run", "modal_verify_patch.py"], {"NNSIGHT_REPRO_PATCHES": str(patches)})
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "SeriesError" in output and "git am" in output, output[-3000:]
    assert "Token missing" not in output, "it got as far as Modal"


# The local verify --------------------------------------------------------------------------------------------

def test_local_verify_runs_every_model_and_check_and_each_outcome_is_the_predicted_one(local_verify):
    report = json.loads(local_verify.path.read_text())
    assert list(report["outcomes"]) == list(models.extended())
    for model, per_check in report["outcomes"].items():
        assert list(per_check) == checks.CHECKS + checks.EXTRA_CHECKS, (model, list(per_check))
        for check, per_env in per_check.items():
            for env_name, outcome in per_env.items():
                fixed = env_name != "main"
                assert outcome["ok"] is checks.expected_ok(models.get(model), check, fixed), (model, check, per_env)


def test_verify_still_writes_the_report_when_one_environment_fails(local_verify, monkeypatch, tmp_path):
    def record(name, models_, checks_):
        if name == "main":
            raise RuntimeError("the check routine failed in 'main' (exit 1):\nImportError: boom")
        return local_verify.report["raw"][name]

    monkeypatch.setattr(verify, "record", record)
    chosen = list(models.extended())
    recs, failed = verify.records(["main", "patched"], chosen, checks.CHECKS + checks.EXTRA_CHECKS)
    assert list(failed) == ["main"] and "ImportError: boom" in failed["main"]
    assert recs["patched"] == local_verify.report["raw"]["patched"]
    assert all(r == {"ok": False, "error": "EnvironmentFailed", "message": failed["main"].splitlines()[0]}
               for per in recs["main"]["models"].values() for r in per.values())
    rep = verify.report(recs, argv=["test"], runner="local", series_name=SERIES)
    path = verify.write(rep, tmp_path, "local-one-failed")
    assert "main | FAILED" in path.with_suffix(".md").read_text()
    assert json.loads(path.read_text())["outcomes"]["bert-mlm"]["remote_local"]["patched"]["ok"]


def test_local_verify_finds_every_number_identical_between_main_and_patched(local_verify):
    report = json.loads(local_verify.path.read_text())
    assert report["numbers_identical"], report["numbers"]
    for model, numbers in report["numbers"].items():
        shift = numbers["digests"]["embedding_shift"]
        assert shift["main"] == shift["patched"], (model, shift)


def test_local_verify_records_base_series_check_routine_and_c_extension(local_verify):
    report = json.loads(local_verify.path.read_text())
    base = series.base(SERIES)
    assert report["inputs"]["base"] == {"repo": base.repo, "tag": base.tag, "commit": base.commit}
    assert report["inputs"]["series"]["digest"] == series.digest(SERIES)
    assert report["inputs"]["check_routine"]["digest"] == verify.check_routine_digest()
    for name, environment in report["environments"].items():
        assert isinstance(environment["nnsight_c_extension"], bool), name
        assert environment["nnsight"] == envs.spec(name).nnsight


def png_size(path: Path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def test_local_verify_draws_one_embedding_shift_plot_per_model_beside_the_json(local_verify):
    report = json.loads(local_verify.path.read_text())
    markdown = local_verify.path.with_suffix(".md").read_text()
    assert set(report["plots"]) == set(models.extended())
    for model, name in report["plots"].items():
        width, height = png_size(local_verify.path.parent / name)
        assert width > 300 and height > 200, (model, width, height)
        assert f"]({name})" in markdown, name


def test_local_verify_refuses_a_series_that_does_not_apply_before_touching_any_environment(tmp_path):
    patches = series_copy(tmp_path)
    spoil_a_context_line(sorted((patches / SERIES).glob("0001-*.patch"))[0])
    cache = tmp_path / "cache"
    sdist = envs.cache_dir() / "sdists" / "nnsight-0.7.0.tar.gz"
    (cache / "sdists").mkdir(parents=True)
    shutil.copy(sdist, cache / "sdists" / sdist.name)
    result = subprocess.run([sys.executable, "-m", "nnsight_repro", "verify", "--out", str(tmp_path / "out")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NNSIGHT_REPRO_PATCHES": str(patches),
                                 "NNSIGHT_REPRO_CACHE": str(cache)})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error:" in result.stderr and "git am" in result.stderr, result.stderr[-3000:]
    assert not (cache / "envs").exists() and not (tmp_path / "out").exists()
