"""Environments: built once, reused warm, and refused with a named fix when they cannot be trusted."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nnsight_repro import ROOT, envs
from nnsight_repro.envs import build as env_build, sdists


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
        sdists.sdist("0.7.0", envs.spec("main").sdist_sha256)


def test_missing_sdist_names_where_to_put_it(scratch_cache):
    with pytest.raises(envs.EnvError, match=r"put nnsight-0\.0\.0\.tar\.gz into"):
        sdists.sdist("0.0.0", "0" * 64)


def test_a_download_reads_the_file_the_index_page_links_and_checks_its_hash(scratch_cache, tmp_path, monkeypatch):
    import hashlib

    project = tmp_path / "index" / "nnsight"
    (project / "files").mkdir(parents=True)
    (project / "files" / "nnsight-9.9.9.tar.gz").write_bytes(b"release bytes")
    (project / "index.html").write_text('<a href="files/nnsight-9.9.9.tar.gz#sha256=x">nnsight-9.9.9.tar.gz</a>')
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "index").as_uri())
    path = sdists.sdist("9.9.9", hashlib.sha256(b"release bytes").hexdigest())
    assert path == scratch_cache / "sdists" / "nnsight-9.9.9.tar.gz" and path.read_bytes() == b"release bytes"


def test_verify_rejects_unknown_names_before_touching_any_environment(scratch_cache):
    result = subprocess.run([sys.executable, "-m", "nnsight_repro", "verify", "--models", "bert-mlm,nope"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "unknown model(s) nope" in result.stderr
    assert not (scratch_cache / "envs").exists()


# Building with uv -----------------------------------------------------------------------------------------

from nnsight_repro import uvtool  # noqa: E402

BYTECODE = ROOT / "nnsight_repro" / "bytecode.py"


def share(action, site, store):
    return subprocess.run([sys.executable, str(BYTECODE), action, str(site), str(store)], capture_output=True,
                          text=True, check=True).stdout.strip()


def imported(site, statement, write=True, flags=()):
    """``statement`` run with ``site`` on the path, as a build's check (``write``) or with bytecode writing off."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return subprocess.run([sys.executable, *flags, *([] if write else ["-B"]), "-c", statement], capture_output=True,
                          text=True, check=True, env={**env, "PYTHONPATH": str(site)})


def installed(site, name, text, cache):
    """``site/name`` as uv installs it: a hard link to a file in its cache."""
    cache.mkdir(exist_ok=True)
    (cache / name).write_text(text)
    site.mkdir(exist_ok=True)
    os.link(cache / name, site / name)
    return site / name


def pyc(site, module):
    return site / "__pycache__" / f"{module}.{sys.implementation.cache_tag}.pyc"


def test_a_pyc_a_check_compiled_in_one_venv_is_linked_into_the_next_and_loaded_there(tmp_path):
    first, second, store, cache = tmp_path / "first", tmp_path / "second", tmp_path / "store", tmp_path / "cache"
    source = installed(first, "shared_mod.py", "def where():\n    return where.__code__.co_filename\n", cache)
    second.mkdir()
    os.link(source, second / "shared_mod.py")
    assert share("link", first, store) == "0 .pyc linked from the store"
    imported(first, "import shared_mod")
    assert share("publish", first, store) == "1 .pyc published to the store"
    assert share("link", second, store) == "1 .pyc linked from the store"
    assert pyc(first, "shared_mod").stat().st_ino == pyc(second, "shared_mod").stat().st_ino
    # Imported from the second copy with bytecode writing off: Python takes the shared .pyc, and its code
    # names the second copy, not the file it was compiled from.
    run = imported(second, "import shared_mod; print(shared_mod.where())", write=False, flags=["-v"])
    assert f"{pyc(second, 'shared_mod')} matches {second / 'shared_mod.py'}" in run.stderr
    assert run.stdout.split() == [str(second / "shared_mod.py")]


def test_only_what_the_check_imports_is_compiled(tmp_path):
    site, store, cache = tmp_path / "site", tmp_path / "store", tmp_path / "cache"
    installed(site, "used.py", "import helper\n", cache)
    installed(site, "helper.py", "X = 1\n", cache)
    installed(site, "unused.py", "Y = 2\n", cache)
    imported(site, "import used")
    assert share("publish", site, store) == "2 .pyc published to the store"
    assert pyc(site, "used").exists() and pyc(site, "helper").exists() and not pyc(site, "unused").exists()


def test_a_pyc_for_another_file_of_the_same_name_is_not_reused(tmp_path):
    first, second, store = tmp_path / "first", tmp_path / "second", tmp_path / "store"
    installed(first, "m.py", "A = 1\n", tmp_path / "cache")
    installed(second, "m.py", "A = 2\n", tmp_path / "cache2")  # another inode
    imported(first, "import m")
    share("publish", first, store)
    assert share("link", second, store) == "0 .pyc linked from the store"
    assert imported(second, "import m; print(m.A)").stdout.split() == ["2"]


def test_a_pyc_that_does_not_match_its_source_is_not_published(tmp_path):
    site, store = tmp_path / "site", tmp_path / "store"
    source = installed(site, "m.py", "A = 1\n", tmp_path / "cache")
    imported(site, "import m")
    # Edited in place, same size, a later second: the .pyc's header no longer matches.
    source.write_text("A = 3\n")
    os.utime(source, (source.stat().st_atime, source.stat().st_mtime + 10))
    assert share("publish", site, store) == "0 .pyc published to the store"


def test_a_store_entry_that_is_not_a_pyc_of_its_source_is_not_linked(tmp_path):
    site, store = tmp_path / "site", tmp_path / "store"
    installed(site, "m.py", "A = 1\n", tmp_path / "cache")
    imported(site, "import m")
    share("publish", site, store)
    (entry,) = store.iterdir()
    entry.write_bytes(b"\0" * 16 + entry.read_bytes()[16:])  # another interpreter's, or damaged
    pyc(site, "m").unlink()
    assert share("link", site, store) == "0 .pyc linked from the store"


def test_a_file_no_other_venv_can_link_is_not_published(tmp_path):
    site, store = tmp_path / "site", tmp_path / "store"
    site.mkdir()
    (site / "own.py").write_text("A = 1\n")  # copied, or rewritten by git apply: one link
    imported(site, "import own")
    assert share("publish", site, store) == "0 .pyc published to the store"


def test_a_builds_check_runs_between_link_and_publish_with_bytecode_writing_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    calls = []

    def step(description, command, env=None):
        calls.append((command[2], env))  # bytecode.py's action, or the check's code
        return "out"

    assert env_build.checked(step, str(python), "checking", "import x") == "out"
    assert [what for what, _ in calls] == ["link", "import x", "publish"]
    assert calls[1][1] is not None and "PYTHONDONTWRITEBYTECODE" not in calls[1][1]


@pytest.mark.parametrize("line", ["0.7", "0.8"])
def test_environment_and_stack_processes_write_the_bytecode_no_check_compiled(monkeypatch, line):
    from nnsight_repro.ndif import config

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert "PYTHONDONTWRITEBYTECODE" not in envs.Env("main", envs.env_dir("main"), {}).environ()
    role = "api" if line == "0.7" else ""
    assert "PYTHONDONTWRITEBYTECODE" not in config.default(line=line).environ(Path("/nowhere/bin"), role=role)


def test_find_links_come_from_pips_environment_and_config(tmp_path, monkeypatch):
    wheels, more = tmp_path / "wheels", tmp_path / "more"
    wheels.mkdir(), more.mkdir()
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {more}\n")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    found = uvtool.pip_find_links()
    assert found.index(str(wheels)) < found.index(str(more))
    (more / "torch-9.9.9+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    (more / f"torch-9.9.8+cpu-{tag}-{tag}-{'linux_x86_64' if sys.platform == 'linux' else 'any'}.whl").touch()
    assert uvtool.find_wheel("torch", "9.9.8").name.startswith("torch-9.9.8+cpu-")
    assert uvtool.find_wheel("torch", "9.9.7") is None


def test_a_missing_torch_wheel_names_the_package_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "none"))
    monkeypatch.setattr(uvtool.Path, "home", lambda: tmp_path)
    pins = tmp_path / "pins.txt"
    pins.write_text("torch==0.0.1\n")
    with pytest.raises(envs.EnvError, match=r"No local CPU wheel of torch 0\.0\.1.*Fix: put torch-0\.0\.1\+cpu"):
        env_build.torch_wheel(pins)


def test_uv_that_cannot_be_installed_names_uv_and_the_fix(scratch_cache, monkeypatch):
    monkeypatch.delenv("NNSIGHT_REPRO_UV", raising=False)
    for key, value in {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "",
                       "PIP_FIND_LINKS": "", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
                       "PIP_CONFIG_FILE": os.devnull}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(uvtool.UvError, match=rf"Could not install uv {uvtool.VERSION}.*NNSIGHT_REPRO_UV"):
        uvtool.binary()
    assert not (scratch_cache / "uv" / uvtool.VERSION).exists()


def tiny_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel, so a resolution test needs no index at all."""
    import zipfile

    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def broken_tools(suite_uv, scratch_cache, monkeypatch):
    """``make(pin)``: a tools environment whose one pin is ``pin``, built by the suite's uv with the network off."""
    monkeypatch.setenv("NNSIGHT_REPRO_UV", suite_uv)
    monkeypatch.setenv("NNSIGHT_REPRO_OFFLINE", "1")
    pins = scratch_cache / "pins"
    pins.mkdir()
    monkeypatch.setattr(envs.specs, "PINS", pins)

    def make(pin):
        (pins / "broken.txt").write_text(pin + "\n")
        spec = envs.ToolSpec("broken-tools", "broken.txt")
        monkeypatch.setitem(envs.TOOLS, spec.name, spec)
        return spec

    return make


def assert_never_ready(spec):
    assert envs.state(spec.name, envs.env_dir(spec.name), envs.digest_of(envs.inputs(spec))) == "half-built"
    with pytest.raises(envs.EnvError, match="did not finish"):
        envs.ensure(spec.name, build=False)


def test_a_pin_that_does_not_resolve_fails_naming_it_and_leaves_no_ready_environment(broken_tools, tmp_path,
                                                                                      monkeypatch):
    links = tmp_path / "links"
    links.mkdir()
    tiny_wheel(links, "nnsrprobe", "1.0")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    spec = broken_tools("nnsrprobe==2.0")
    with pytest.raises(envs.EnvError, match=r"a pinned requirement \(nnsrprobe\) does not resolve\. Fix: correct"):
        envs.ensure(spec.name)
    assert_never_ready(spec)


def test_a_package_the_network_must_supply_names_it_and_the_fix_when_offline(broken_tools):
    spec = broken_tools("click==8.5.1")  # in no find-links directory; the scratch uv cache is empty
    with pytest.raises(envs.EnvError, match=r"could not reach the package index for click\. Fix: restore access"):
        envs.ensure(spec.name)
    assert_never_ready(spec)


@pytest.mark.parametrize("cut_short", ["its unpacked files lost", "its folder gone"])
def test_a_uv_cache_entry_cut_short_names_the_package_and_the_fix(broken_tools, tmp_path, monkeypatch, cut_short):
    links = tmp_path / "links"
    links.mkdir()
    tiny_wheel(links, "nnsrprobe", "1.0")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    spec = broken_tools("nnsrprobe==1.0")
    envs.ensure(spec.name)  # puts nnsrprobe into the scratch uv cache
    (entry,) = (uvtool.cache() / "archive-v0").iterdir()
    for unpacked in list(entry.iterdir()) if cut_short == "its unpacked files lost" else [entry]:
        shutil.rmtree(unpacked)
    shutil.rmtree(envs.env_dir(spec.name))  # the next build installs from that entry
    with pytest.raises(envs.EnvError, match=r"uv's cache at .* looks damaged \(while handling nnsrprobe\)\. "
                                            r"Fix: `.*uv cache clean nnsrprobe`"):
        envs.ensure(spec.name)
    assert_never_ready(spec)


@pytest.fixture(scope="session")
def suite_uv():
    """The uv the suite's environments were built with (the project cache's), so no test downloads uv again."""
    home = os.environ.get("NNSIGHT_REPRO_UV") or str(envs.cache_dir() / "uv" / uvtool.VERSION / "bin" / "uv")
    assert Path(home).is_file(), f"{home}: the environments were not built with this project's uv"
    return home


@pytest.mark.parametrize("name", ["main", "patched", "upstream-0.8"])
def test_a_built_environment_has_every_pin_and_torch_from_the_local_cpu_wheel(name):
    env = envs.ensure(name, build=False)
    frozen = {}
    for line in env.stamp["packages"]:
        key, _, rest = line.partition(" @ ") if " @ " in line else line.partition("==")
        frozen[key.lower().replace("_", "-")] = rest
    for pin in (envs.PINS / env.stamp["inputs"]["spec"]["pins"]).read_text().splitlines():
        if not pin or pin.startswith("#"):
            continue
        key, version = pin.split("==")
        key = key.lower().replace("_", "-")
        if key == "torch":
            # By path, the CPU build: never a resolver's choice from PyPI (whose Linux wheel is CUDA's).
            assert frozen[key].startswith("file://") and f"torch-{version}+cpu-" in frozen[key], frozen[key]
        else:
            assert frozen.get(key) == version, (pin, frozen.get(key))
    assert not [k for k in frozen if k.startswith("nvidia-")]
    assert frozen["nnsight"].startswith("file://") and f"nnsight-{env.stamp['inputs']['spec']['nnsight']}-" in frozen["nnsight"]


# nnsight's C extension, compiled once per release -------------------------------------------------------

def fake_wheel(path: Path, files: dict) -> Path:
    """A wheel holding ``files`` (name -> bytes) and a RECORD that lists each with its hash, as a build writes it."""
    import zipfile

    record = "nnsight-0.7.0.dist-info/RECORD"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(record, "".join(f"{line}\n" for line in record_lines(files)) + f"{record},,\n")
    return path


def record_lines(files: dict) -> list:
    import base64
    import hashlib

    return [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
            f"{len(data)}" for name, data in files.items()]


def wheel_contents(path: Path) -> dict:
    import zipfile

    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


@pytest.fixture
def release_and_source(tmp_path):
    release = fake_wheel(tmp_path / "nnsight-0.7.0-cp311-cp311-linux_x86_64.whl", {
        "nnsight/__init__.py": b"", "nnsight/intervention/envoy.py": b"OLD = 1\n",
        "nnsight/_c/py_mount.so": b"\x7fELF compiled once"})
    source = tmp_path / "src-tree"
    (source / "src" / "nnsight" / "intervention").mkdir(parents=True)
    (source / "src" / "nnsight" / "intervention" / "envoy.py").write_bytes(b"NEW = 2\n")
    (source / "src" / "nnsight" / "added.py").write_bytes(b"ADDED = 3\n")
    return release, source


def test_a_series_of_python_files_goes_into_the_releases_wheel_with_a_record_that_verifies(
        release_and_source, tmp_path, monkeypatch):
    release, source = release_and_source
    monkeypatch.setattr(envs.series, "touched", lambda name: [
        "src/nnsight/intervention/envoy.py", "src/nnsight/added.py", "tests/test_overloaded_mount.py",
        ".github/workflows/python-app.yml"])
    built = wheel_contents(env_build.series_wheel(release, "any", source, tmp_path / "out"))
    record = built.pop("nnsight-0.7.0.dist-info/RECORD").decode().splitlines()
    assert built == {"nnsight/__init__.py": b"", "nnsight/intervention/envoy.py": b"NEW = 2\n",
                     "nnsight/added.py": b"ADDED = 3\n", "nnsight/_c/py_mount.so": b"\x7fELF compiled once"}
    assert sorted(record) == sorted([*record_lines(built), "nnsight-0.7.0.dist-info/RECORD,,"])


def test_a_file_the_series_deletes_leaves_the_wheel_and_its_record(release_and_source, tmp_path, monkeypatch):
    release, source = release_and_source
    monkeypatch.setattr(envs.series, "touched", lambda name: ["src/nnsight/__init__.py"])  # absent from source
    built = wheel_contents(env_build.series_wheel(release, "any", source, tmp_path / "out"))
    assert "nnsight/__init__.py" not in built
    assert "nnsight/__init__.py" not in built["nnsight-0.7.0.dist-info/RECORD"].decode()


@pytest.mark.parametrize("touched", ["src/nnsight/_c/py_mount.cpp", "setup.py", "pyproject.toml"])
def test_a_series_touching_what_a_build_compiles_or_reads_gets_a_build_of_its_own(
        release_and_source, tmp_path, monkeypatch, touched):
    release, source = release_and_source
    monkeypatch.setattr(envs.series, "touched", lambda name: ["src/nnsight/intervention/envoy.py", touched])
    assert env_build.series_wheel(release, "any", source, tmp_path / "out") is None


def installed_nnsight(env) -> Path:
    return next(env.path.glob("venv/lib/python*/site-packages/nnsight"))


def test_main_and_patched_install_one_compiled_c_extension():
    main, patched = (installed_nnsight(envs.ensure(name, build=False)) for name in ("main", "patched"))
    compiled = sorted(p.relative_to(main) for p in main.glob("_c/*.so"))
    assert compiled, f"no compiled extension under {main}/_c"
    for name in compiled:
        assert (main / name).read_bytes() == (patched / name).read_bytes(), name


def test_patched_installs_exactly_the_series_sources():
    env = envs.ensure("patched", build=False)
    installed = installed_nnsight(env)
    for touched in envs.series.touched(env.stamp["inputs"]["spec"]["series"]):
        if touched.startswith("src/nnsight/"):
            assert (installed / touched[len("src/nnsight/"):]).read_bytes() == (env.source / touched).read_bytes()


# `pytest tests/...` from a plain interpreter (tests/nnsight_env.py) --------------------------------------

def plain_interpreter_environ() -> dict:
    """This environment's variables without what marks a project environment (as a fresh shell has them)."""
    return {k: v for k, v in os.environ.items() if k not in {"NNSIGHT_REPRO_ENV", "PYTHONPATH", "VIRTUAL_ENV",
                                                           "NNSIGHT_REPRO_TEST_ENV"}}


def base_interpreter_without_nnsight() -> str:
    base = getattr(sys, "_base_executable", sys.executable)
    probe = subprocess.run([base, "-c", "import importlib.util as u; print(bool(u.find_spec('nnsight')), "
                            "bool(u.find_spec('pytest')))"], capture_output=True, text=True,
                           env=plain_interpreter_environ())
    assert probe.stdout.split() == ["False", "True"], (base, probe.stdout, probe.stderr)
    return base


@pytest.mark.parametrize("choice, env_name", [([], "patched"), (["--nnsight-env", "main"], "main")])
def test_pytest_from_an_interpreter_without_nnsight_runs_in_the_chosen_environment(choice, env_name):
    base = base_interpreter_without_nnsight()
    test = "tests/test_envs.py::test_the_suite_runs_in_the_environment_it_was_moved_into"
    result = subprocess.run([base, "-m", "pytest", test, "-q", *choice], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**plain_interpreter_environ(), "NNSIGHT_REPRO_EXPECT_ENV": env_name})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    moved = [line for line in result.stderr.splitlines() if line.startswith("[nnsight-repro]")]
    assert len(moved) == 1 and f"in the {env_name!r} environment" in moved[0], result.stderr
    assert "1 passed" in result.stdout


def test_the_suite_runs_in_the_environment_it_was_moved_into():
    expected = os.environ.get("NNSIGHT_REPRO_EXPECT_ENV")
    import nnsight

    assert os.environ.get("NNSIGHT_REPRO_ENV") == (expected or os.environ.get("NNSIGHT_REPRO_ENV"))
    assert f"/envs/{os.environ['NNSIGHT_REPRO_ENV']}/venv/" in nnsight.__file__


def test_naming_another_environment_from_inside_one_is_refused():
    result = subprocess.run([sys.executable, "-m", "pytest", "tests/test_envs.py::test_unknown_environment_is_"
                             "refused_naming_the_known_ones", "-q", "--nnsight-env", "upstream-0.8"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "run pytest from a plain interpreter to use 'upstream-0.8'" in result.stderr


# Modal's client from the project's own install -----------------------------------------------------------

def test_the_modal_extra_pins_the_modal_the_tools_environment_runs():
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["modal"]
    tools = [line for line in (envs.PINS / "tools.txt").read_text().splitlines() if line.startswith("modal==")]
    assert extra == tools == ["modal==1.6.4"]


def test_modal_run_through_the_project_command_needs_no_modal_of_ones_own():
    base = base_interpreter_without_nnsight()
    environ = {k: v for k, v in plain_interpreter_environ().items() if not k.startswith("MODAL_")}
    environ["MODAL_CONFIG_PATH"] = str(ROOT / ".no-such-dir" / "modal.toml")
    result = subprocess.run([base, "-m", "nnsight_repro", "modal", "run", "modal_verify_patch.py", "--help"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300, env=environ)
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--models", "--checks", "--gpu", "--out"):
        assert flag in result.stdout, result.stdout
