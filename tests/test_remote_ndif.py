"""Remote traces against a real NDIF server on loopback, and how the local stack behaves when things go wrong.

The server is PyPI ``ndif`` 0.1.2 (it serves nnsight 0.8 clients), brought up by the session fixture
``ndif_stack`` (``tests/ndif_fixture.py``) inside a private network namespace. The client is nnsight
0.8.1 from the ``upstream-0.8`` environment, run inside that namespace (this interpreter is a 0.7
client), with ``remote=True``: the request goes through the real API, queue, controller and model
actor. A stack that cannot be brought up makes these tests fail; none of them skips.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nnsight_repro import ROOT, channel, series
from nnsight_repro.ndif import (config, deploy, errors, health, netns, server_env, server_packages, services, stack,
                                stack_clients, stack_state)

TRACED = ["gpt2", "bert-mlm", "esm-mlm"]


@pytest.fixture(scope="module")
def inline_cap(ndif_stack):
    return stack_clients.inline_cap(ndif_stack.cfg)


@pytest.fixture(scope="module")
def remote(ndif_stack, inline_cap):
    """Every remote case, run by one client process (starting nnsight costs seconds on two cores)."""
    return ndif_stack.run([f"trace:{name}" for name in TRACED] + ["error", f"large:{inline_cap}"])


def assert_equal_to_local(record):
    assert record.get("ok") is not None, record
    for point in ("first_layer", "final_hidden"):
        assert point in record, record
        assert record[point]["equals_local"], (point, record)
        assert record[point]["max_abs_diff"] == 0.0, (point, record)


# Remote traces -----------------------------------------------------------------------------------

def test_decoder_control_remote_trace_equals_local(remote):
    assert_equal_to_local(remote["trace:gpt2"])


def test_bert_masked_lm_encoder_layer_outputs_remote_equal_local(remote):
    # Equal encoder-layer outputs also prove the server built a masked LM: BertLMHeadModel (what an
    # AutoModelForCausalLM rebuild gives) attends causally and would change every position but the last.
    assert_equal_to_local(remote["trace:bert-mlm"])


def test_esm_masked_lm_encoder_layer_outputs_remote_equal_local(remote):
    assert_equal_to_local(remote["trace:esm-mlm"])


def test_encoder_layers_are_read_as_nnsights_output_on_the_08_line(remote):
    # 0.8 keeps `.output` for nnsight and moves BERT's colliding submodule to `E_output`.
    for name in ("bert-mlm", "esm-mlm"):
        assert remote[f"trace:{name}"]["read_points"] == ["first_layer: output", "final_hidden: output"]


def test_masked_lms_are_requested_under_a_fill_mask_key(remote):
    for name in ("bert-mlm", "esm-mlm"):
        key = json.loads(remote[f"trace:{name}"]["key"].split(":", 1)[1])
        assert key["task"] == "fill-mask", key


def test_server_side_exception_arrives_with_its_message(remote):
    record = remote["error"]
    assert record["local"]["raised"] and record["remote"]["raised"], record
    assert record["remote"]["type"].endswith("RemoteError"), record
    assert record["local"]["message"] in record["remote"]["message"]
    # The server's traceback points at the client's own line.
    assert "remote_client.py" in record["remote"]["message"]


def test_result_above_inline_cap_comes_back_through_the_object_store(remote, inline_cap, ndif_stack):
    record = remote[f"large:{inline_cap}"]
    assert record.get("equals_local"), record
    assert record["bytes"] > inline_cap
    assert record["route"] == {"route": "object-store", "url_host": f"127.0.0.1:{ndif_stack.cfg.s3_port}"}


def test_stack_serves_every_model_hot_under_the_key_the_client_sends(remote, ndif_stack):
    report = ndif_stack.status()
    assert report["problems"] == [], report["problems"]
    keys = ndif_stack.state["models"]
    for name in TRACED:
        assert report["models"][name]["level"] == "HOT"
        assert keys[name] == remote[f"trace:{name}"]["key"]


# The stack itself ----------------------------------------------------------------------------------

def test_stack_namespace_has_only_loopback(ndif_stack):
    # ndif binds its Ray dashboard and gunicorn to 0.0.0.0; in here that is loopback and nothing else.
    assert netns.interfaces(ndif_stack.cfg.netns) == ["lo"]


def test_second_up_while_one_runs_is_refused_naming_the_running_stack(ndif_stack):
    with pytest.raises(errors.StackError, match=f"already running .*{ndif_stack.cfg.netns}.*ndif down"):
        stack.up(ndif_stack.cfg)
    assert health.healthy(ndif_stack.cfg)


def test_model_that_fails_to_deploy_is_named_with_its_cause(ndif_stack, tmp_path):
    broken = tmp_path / "broken-gpt2"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    key = "nnsight.modeling.transformers.TransformersModel:" + json.dumps(
        {"repo_id": str(broken), "revision": None, "task": "text-generation"})
    # What `up` does after starting the controller with the models to deploy: this one never shows up
    # in /status, so it is deployed again through `ndif deploy`, which names the cause.
    with pytest.raises(deploy.DeployError, match="broken: .*no-such-architecture"):
        stack.wait_hot(ndif_stack.cfg, server_env.ensure(build=False, extras=ndif_stack.cfg.extras),
                       {"broken": {"path": str(broken), "task": "text-generation", "key": key}})


def test_deploy_failure_of_a_model_whose_actor_died_names_the_exception_it_died_of():
    # The shape `ndif deploy` prints when a model's actor raised while loading (seen live with truncated
    # weights): Ray's sentence on the ✗ line, the model's own exception at the end of the traceback.
    key = 'nnsight.modeling.transformers.TransformersModel:{"repo_id": "/m/gpt2", "revision": null}'
    output = "\n".join([
        f"  ⋯ {key}: provisioned 1 replica(s), initializing...",
        f"  ✗ {key} [c82c3]: initialization failed - The actor died because of an error raised in its "
        "creation task, ray::c82c3:ModelActor:CPUModelActor.__init__() (pid=25890, ip=127.0.0.1)",
        "  File \"/venv/lib/python3.11/site-packages/safetensors/torch.py\", line 315, in load_file",
        "safetensors._safetensors_rust.SafetensorError: Error while deserializing header: invalid header length",
        "",
        "✗ 1 of 1 model(s) not ready.",
    ])
    reasons = deploy.failures(output, {"gpt2": {"path": "/m/gpt2", "key": key}})
    assert set(reasons) == {"gpt2"}
    assert reasons["gpt2"].startswith("[c82c3]: initialization failed - The actor died")
    assert reasons["gpt2"].endswith("caused by safetensors._safetensors_rust.SafetensorError: "
                                    "Error while deserializing header: invalid header length")


def test_colliding_ports_are_refused_before_anything_starts():
    with pytest.raises(config.ConfigError, match="api port 6385 is already taken inside the stack by ray gcs"):
        config.StackConfig(folder=Path("/tmp/nnsr-unused"), api_port=6385).validate()
    with pytest.raises(config.ConfigError, match="port 7000 is configured for both redis and s3"):
        config.StackConfig(folder=Path("/tmp/nnsr-unused"), redis_port=7000, s3_port=7000).validate()


def client_like(behaviour: str) -> channel.Stream:
    """A stand-in for a remote client (tests/channel_child.py), on the same channel."""
    return channel.start([sys.executable, str(Path(__file__).with_name("channel_child.py")), behaviour],
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, what="a stand-in remote client")


def test_ready_client_is_waited_for_past_its_other_output():
    client = client_like("ready-client")
    stack_clients.wait_ready(client, timeout=30)
    assert client.records(timeout=30) == [{"cases": {}}]
    assert "warning: something" in client.stderr_tail()
    client.close()


def test_client_that_exits_before_it_is_ready_is_named_with_its_stderr():
    client = client_like("failing")
    with pytest.raises(errors.StackError,
                       match=r"(?s)exited before it was ready.*stand-in remote client.*exited with code 1.*about to fail"):
        stack_clients.wait_ready(client, timeout=30)


def test_client_never_ready_is_killed_after_the_timeout():
    client = client_like("hang")
    with pytest.raises(errors.StackError, match="not ready after 1 s"):
        stack_clients.wait_ready(client, timeout=1)
    assert client.poll() is not None


@pytest.fixture
def scratch_stack():
    """A second stack's settings, in its own short folder (Ray's socket paths) and namespace."""
    # The suite's extras, so an `up` in it uses the server environment the suite already built.
    cfg = config.StackConfig(folder=Path(tempfile.mkdtemp(prefix="nnsr-", dir="/tmp")), extras=server_packages.SUITE)
    yield cfg
    stack.down(cfg, say=lambda m: None)
    assert not netns.exists(cfg.netns)
    shutil.rmtree(cfg.folder, ignore_errors=True)
    shutil.rmtree(cfg.ray_temp, ignore_errors=True)  # outside the folder: a short path (Ray's sockets)


def test_port_already_taken_in_the_namespace_is_named(scratch_stack):
    netns.create(scratch_stack.netns)
    listener = subprocess.Popen(netns.command(scratch_stack.netns, [
        sys.executable, "-c",
        "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 8001)); s.listen(); time.sleep(60)"]))
    try:
        subprocess.run(netns.command(scratch_stack.netns, [sys.executable, "-c",
                       "import socket, time\nwhile socket.socket().connect_ex(('127.0.0.1', 8001)): time.sleep(0.1)"]),
                       timeout=30, check=True)
        api = services.Service("api", [], 8001, scratch_stack.folder / "api.log")
        with pytest.raises(errors.StackError, match=r"Port\(s\) 8001 \(for api\) are already taken"):
            services.ensure_ports_free(scratch_stack, [api])
    finally:
        listener.kill()
        listener.wait()


def test_up_that_fails_midway_names_the_service_and_leaves_nothing_running(scratch_stack):
    # Ray's start script cannot create its temp dir: the ray service exits as the stack starts.
    cfg = config.StackConfig(folder=scratch_stack.folder, extras=scratch_stack.extras,
                             extra_env={"NDIF_RAY_TEMP_DIR": "/proc/nnsr-no-such-dir"})
    with pytest.raises(errors.StackError, match=r"(?s)ray exited with code 1 during start.*ray\.log"):
        stack.up(cfg, models=[])
    assert not netns.exists(cfg.netns)
    assert stack_state.read_state(cfg) is None
    assert (cfg.logs / "redis.log").exists()  # the logs of the failed run stay


@pytest.mark.parametrize("layout", ["", "ray"], ids=["0.1.2", "0.0.1"])
def test_rays_start_race_in_its_gcs_log_is_named_at_once(scratch_stack, layout):
    logs = scratch_stack.ray_temp / layout / "session_2026-12-01_00-00-00_000000_1" / "logs"
    logs.mkdir(parents=True)
    services.check_ray_start(scratch_stack)  # a GCS that logs nothing of it
    (logs / "gcs_server.out").write_text(f"[2026-12-01 00:00:01,000 C 1 1] gcs_server.cc:1 Check failed: "
                                         f"!exporting_started_ {services.RAY_START_RACE}.\n")
    with pytest.raises(errors.RayStartRace, match="Ray's GCS aborted as it started .*gcs_server.out"):
        services.check_ray_start(scratch_stack)


@pytest.mark.parametrize("races, outcome", [(1, "up"), (2, "RayStartRace")])
def test_up_starts_once_more_after_rays_start_race_and_only_once(scratch_stack, monkeypatch, races, outcome):
    calls, said = [], []

    def up_locked(cfg, models, say, on_namespace):
        calls.append(cfg)
        if len(calls) <= races:
            raise errors.RayStartRace("Ray's GCS aborted as it started (...).")
        return {"phase": "ready"}

    monkeypatch.setattr(stack, "up_once", up_locked)
    if outcome == "up":
        assert stack.up(scratch_stack, models=[], say=said.append) == {"phase": "ready"}
    else:
        with pytest.raises(errors.RayStartRace):
            stack.up(scratch_stack, models=[], say=said.append)
    assert len(calls) == 2 and said == ["Ray's GCS aborted as it started (...). Starting the stack once more."]


def test_a_wait_that_times_out_quotes_the_end_of_the_services_log(tmp_path):
    log = tmp_path / "ray.log"
    log.write_text("Usage stats collection is disabled.\nLocal node IP: 127.0.0.1\n")
    with pytest.raises(errors.StackError, match=r"(?s)Timed out after 0 s waiting for Ray's head.*"
                                               r"ray\.log:\n    Usage stats.*\n    Local node IP: 127\.0\.0\.1$"):
        services.wait("Ray's head to start", lambda: False, [], 0.05, interval=0.01, logs=[log])
    with pytest.raises(errors.StackError, match=r"(?s)waiting for the API.*api\.log:\n\(no log\).*ray\.log:\n    Usage"):
        services.wait("the API", lambda: False, [], 0.05, interval=0.01, logs=[tmp_path / "api.log", log])


# The multimolecule extra: an RNA model and AntiBERTy ---------------------------------------------------
# The session's 0.8 stack (it runs `--with multimolecule`), through the panel command's code (fixture
# ndif08_batch in tests/ndif_fixture.py).

#: What the server must build for each: the masked LM the key's task names (RNABERT exists for transformers
#: only after `import multimolecule` in the server process that builds it).
MULTIMOLECULE_BUILT = {"rnabert": "RnaBertForMaskedLM", "antiberty": "BertForMaskedLM"}


@pytest.mark.parametrize("trace", ["read", "write"])
@pytest.mark.parametrize("model", sorted(MULTIMOLECULE_BUILT))
def test_multimolecule_extra_runs_rnabert_and_antiberty_remotely_equal_to_local(ndif08_batch, model, trace):
    row = ndif08_batch["by"][(model, "upstream-0.8", trace)]
    assert row["ok"] and row["max_abs_diff"] == 0.0, row
    assert row["built_class"] == MULTIMOLECULE_BUILT[model], row
    assert json.loads(row["key"].split(":", 1)[1])["task"] == "fill-mask", row["key"]
    if trace == "read":
        assert row["read_points"] == ["first_layer: output", "final_hidden: output"], row
    else:
        assert row["write_changes_local_output"], row


def test_antiberty_runs_with_its_real_weights(ndif08_batch):
    # The packaged AntiBERTy (antiberty==0.1.3's trained_models): hidden size 512, not a tiny random model's 32.
    row = ndif08_batch["by"][("antiberty", "upstream-0.8", "read")]
    assert row["points"]["first_layer"]["shape"][-1] == 512, row["points"]


def test_multimolecule_extra_builds_in_its_own_environment_without_oom_kills(ndif08_batch):
    built = ndif08_batch["built"]
    assert {b["module_class"] for b in built} == set(MULTIMOLECULE_BUILT.values()), built
    env = str(server_env.path("0.8", server_packages.SUITE)) + "/"
    assert all(b["nnsight_file"].startswith(env) for b in built), built
    assert ndif08_batch["memory"]["stack_rss_mib"] > 0
    # The stack runs in a memory cgroup of its own, which saw no OOM kill (what its `down` leaves:
    # tests/test_ndif_memory.py, the session's last test on it).
    assert ndif08_batch["memory"]["cgroup"]["oom_kills"] == 0, ndif08_batch["memory"]


def test_multimolecule_extra_is_a_stack_of_its_own_and_unknown_extras_are_refused():
    with_extra, plain = config.default(extras=["multimolecule"]), config.default()
    assert with_extra.folder != plain.folder and with_extra.netns != plain.netns
    assert with_extra.environ(Path("/x/bin"))["NNSIGHT_REPRO_NDIF_SERVER_IMPORTS"] == "multimolecule"
    assert "NNSIGHT_REPRO_NDIF_SERVER_IMPORTS" not in plain.environ(Path("/x/bin"))
    with pytest.raises(config.ConfigError, match="Unknown extra.*foo.*`--with` takes: multimolecule"):
        config.default(extras=["foo"])
    result = subprocess.run([sys.executable, "-m", "nnsight_repro", "ndif", "up", "--with", "foo"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid choice: 'foo'" in result.stderr, result.stderr


def test_two_extras_of_one_package_are_refused_naming_both():
    with pytest.raises(config.ConfigError, match="multimolecule, multimolecule-patched each install multimolecule"):
        config.default(extras=["multimolecule-patched", "multimolecule"])
    result = subprocess.run([sys.executable, "-m", "nnsight_repro", "ndif", "up", "--with", "multimolecule",
                             "--with", "multimolecule-patched"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "each install multimolecule; choose one" in result.stderr, result.stderr


def test_an_extras_fix_reaches_only_its_own_venv_not_the_installed_file_it_was_linked_to(tmp_path):
    # uv links an installed file to its cache, and every venv with that release links the same inode.
    extra = server_packages.EXTRAS["multimolecule-patched"]
    site_of_this_env = Path(importlib.util.find_spec("multimolecule").origin).parent.parent
    released = site_of_this_env / series.touched(extra.series)[0]
    cache = tmp_path / "uv-cache" / "sinusoidal.py"
    cache.parent.mkdir()
    shutil.copyfile(released, cache)
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    installed = site / series.touched(extra.series)[0]
    installed.parent.mkdir(parents=True)
    os.link(cache, installed)
    server_env.apply_series(extra, tmp_path / "venv" / "bin" / "python")
    assert cache.read_bytes() == released.read_bytes()
    assert installed.stat().st_ino != cache.stat().st_ino
    assert "promote_types" in installed.read_text() and "promote_types" not in cache.read_text()
