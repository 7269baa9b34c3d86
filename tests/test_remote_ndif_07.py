"""The negative control end to end against a real server: nnsight 0.7.0 clients, ``remote=True``.

The server is the 0.7 stack: PyPI ``ndif`` 0.0.1 plus the backports in
``nnsight_repro/ndif/adaptations_0_0_1.py`` (not the server production ran for 0.7.0), with stock
nnsight 0.7.0 and multimolecule. The clients are the ``main`` (stock 0.7.0) and ``patched`` environments,
run inside the stack's namespace. One cold stack per session (the lane job ``ndif07``,
tests/ndif_fixture.py), down again before these assertions run; every pairing's cases run in
:func:`nnsight_repro.ndif.negative_control.run_pairings`, the same code that writes
``results/ndif_0.7/negative_control.json``. The patched server nnsight is not started here: every client x
server pairing is ``tests/test_wire.py``'s, offline, as a model actor loads a request, and the live run of
every pairing is ``ndif negative-control``'s committed record. Which class the server built for a key is read from
the model actors' own records (``logs/built.jsonl``), not inferred. A stack that cannot come up makes
these tests fail; none of them skips.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nnsight_repro import ROOT, channel, envs
from nnsight_repro.ndif import config, negative_control, server_env, server_packages, services, stack

HOOKED_OUTPUT = "name 'hooked_output' is not defined"
#: The class each masked LM must be rebuilt as: what the key's automodel selects.
MASKED_LM_CLASSES = [("bert-mlm", "BertForMaskedLM"), ("esm-mlm", "EsmForMaskedLM")]
ATOL = negative_control.ATOL


def case(result, client, model, kind="trace"):
    return result["clients"][client][f"{kind}:{model}:{ATOL}"]


def built_for(result, key):
    """The classes the server's model actors built for ``key`` (one per load)."""
    return [b["module_class"] for b in result["built"] if b["model_key"] == key]


def key_fields(key):
    return json.loads(key.split(":", 1)[1])


def assert_within_bf16_tolerance(record):
    # The server computes in bfloat16 (ndif 0.0.1's default dtype); the local run is float32.
    # Why 0.08: nnsight_repro/ndif/generations.py, BF16_ATOL.
    assert record["ok"], record
    for point in ("first_layer", "final_hidden"):
        assert record[point]["dtype"] == "torch.bfloat16", record
        assert record[point]["max_abs_diff"] <= ATOL, (point, record)


def assert_write_within_bf16_tolerance(record):
    assert record["ok"] and record["write_changes_local_output"], record
    assert record["logits"]["dtype"] == "torch.bfloat16" and record["logits"]["max_abs_diff"] <= ATOL, record


# Stock server ----------------------------------------------------------------------------------------

def test_stock_server_serves_the_decoder_control_to_a_stock_client(ndif07_stock):
    record = case(ndif07_stock, "main", "gpt2")
    assert_within_bf16_tolerance(record)
    assert built_for(ndif07_stock, record["key"]) == ["GPT2LMHeadModel"]


def test_stock_client_bert_fails_on_the_server_with_hooked_output_name_error(ndif07_stock):
    record = case(ndif07_stock, "main", "bert-mlm")
    assert not record["ok"]
    assert "RemoteException" in record["message"] and HOOKED_OUTPUT in record["message"], record["message"]
    # The stock key names no model class, so the server rebuilt the masked LM as AutoModelForCausalLM.
    assert "automodel" not in key_fields(record["key"])
    assert built_for(ndif07_stock, record["key"]) == ["BertLMHeadModel"]


@pytest.mark.parametrize("model, built", MASKED_LM_CLASSES)
def test_patched_client_encoder_reads_run_on_a_stock_server(ndif07_stock, model, built):
    """What the public NDIF runs: a stock server, and a client with the series."""
    record = case(ndif07_stock, "patched", model)
    assert_within_bf16_tolerance(record)
    assert record["read_points"][0] == "first_layer: nns_output"
    # The automodel in the key needs only the client: a stock server already rebuilds the masked LM.
    assert key_fields(record["key"])["automodel"] == "AutoModelForMaskedLM"
    assert built_for(ndif07_stock, record["key"]) == [built]


@pytest.mark.parametrize("model", ["bert-mlm", "esm-mlm"])
def test_patched_client_encoder_writes_run_on_a_stock_server(ndif07_stock, model):
    assert_write_within_bf16_tolerance(case(ndif07_stock, "patched", model, "write"))


@pytest.mark.parametrize("client", ["main", "patched"])
def test_decoder_reads_and_writes_run_on_a_stock_server_from_either_client(ndif07_stock, client):
    assert_within_bf16_tolerance(case(ndif07_stock, client, "gpt2"))
    assert_write_within_bf16_tolerance(case(ndif07_stock, client, "gpt2", "write"))


def test_stock_server_runs_its_own_stock_nnsight(ndif07_stock):
    env = str(server_env.path("0.7", server_packages.SUITE)) + "/"
    assert ndif07_stock["server_nnsight"]["file"].startswith(env), ndif07_stock["server_nnsight"]
    assert all(b["nnsight_file"].startswith(env) for b in ndif07_stock["built"]), ndif07_stock["built"]


# The stack itself ------------------------------------------------------------------------------------

def test_stack_has_only_loopback_lists_every_buildable_key_hot_and_leaves_nothing(ndif07_stock):
    result = ndif07_stock
    assert result["interfaces"] == ["lo"]
    assert result["status"]["problems"] == [], result["status"]["problems"]
    records = [r for per_client in result["clients"].values() for r in per_client.values() if "key" in r]
    keys = {r["key"] for r in records}
    # The stock client's ESM key asks for AutoModelForCausalLM, which ESM has not: the one key no server builds.
    unbuildable = {r["key"] for r in records if "error provisioning the model deployment" in r.get("message", "")}
    assert unbuildable and all("esm-mlm" in key and "automodel" not in key for key in unbuildable), unbuildable
    # Models `up` deployed are listed by name, those deployed on request by key.
    by_key = {**result["status"]["models"],
              **{key: result["status"]["models"][name] for name, key in result["status"]["state"]["models"].items()}}
    for key in keys - unbuildable:
        assert by_key[key]["level"] == "HOT", (key, result["status"]["models"])


def test_stack_deploys_gpt2_at_start_under_its_own_clients_key(ndif07_stock):
    result = ndif07_stock
    (gpt2_key,) = result["status"]["state"]["models"].values()
    assert list(result["status"]["state"]["models"]) == ["gpt2"]
    # The key every 0.7 client sends for GPT-2 (no automodel: the default), and the actor that built it.
    assert gpt2_key.endswith('"revision": null}') and "automodel" not in gpt2_key
    assert result["built"][0]["model_key"] == gpt2_key and result["built"][0]["module_class"] == "GPT2LMHeadModel"
    assert not result["netns_left_after_down"]


def test_every_ray_client_connecting_as_the_api_does_gets_its_server(ndif07_stock):
    # With gRPC's fork support on in Ray's processes, 18 of 122 such connects (measured) lost their server at
    # start and waited 30 s (generations.RAY_ENV, which tests/test_generations.py checks every Ray process
    # gets); 16 connects would see that about 19 times in 20.
    attempts = ndif07_stock["ray_clients"]
    assert len(attempts) == 16
    assert [a for a in attempts if not a["ok"]] == []


def test_second_up_while_a_07_stack_runs_is_refused_naming_it(ndif07_stock):
    assert "already running" in ndif07_stock["second_up"] and ndif07_stock["netns"] in ndif07_stock["second_up"]
    assert ndif07_stock["healthy_after_second_up"]


def test_stack_whose_api_dies_mid_run_is_reported_and_down_cleans_up(ndif07_stock):
    # Done last on the session's 0.7 stack (tests/ndif_fixture.py kill_the_api): it breaks that stack.
    found = ndif07_stock["api_killed"]
    assert "raised" not in found, found["raised"]
    api = found["started"]["api"]
    assert any(p.startswith(f"api (pid {api}) is not running") for p in found["problems"]), found["problems"]
    # A client that runs into the dead stack is told which service died, not only "connection refused".
    assert found["client"].get("ok") is False, found["client"]
    assert any(p.startswith(f"api (pid {api})") for p in found["client"].get("stack_problems", [])), found["client"]
    assert found["down"]["deleted_netns"] and not found["netns_left"], found["down"]
    assert set(found["started"].values()) - {api} <= set(found["down"]["killed"]), found
    assert found["alive_after_down"] == [], found


@pytest.mark.parametrize("server, client_env", [("stock", None), ("patched", "patched")])
def test_each_server_build_imports_its_own_nnsight_in_every_server_process(server, client_env, tmp_path):
    # What `up` checks before it starts a service, run without a stack: a server process's Python path puts the
    # patched environment's installed nnsight first for the patched build, and nothing for the stock one. (The
    # patched build's live run: `ndif negative-control`, results/ndif_0.7/negative_control.json.)
    cfg = config.StackConfig(folder=tmp_path / "ndif-0.7", line="0.7", server=server, extras=server_packages.SUITE)
    env = server_env.ensure(build=False, line="0.7", extras=cfg.extras)
    found = services.prepare_python_path(cfg, env)
    expected = envs.env_dir(client_env) if client_env else env.path
    assert found["file"].startswith(str(expected) + os.sep) and found["adaptations"], found


def test_07_stack_settings_that_cannot_work_are_refused_before_anything_starts():
    folder = Path("/tmp/nnsr-unused")
    with pytest.raises(config.ConfigError, match="gpus must be at least 4 for the 0.7 stack"):
        config.StackConfig(folder=folder, line="0.7", gpus=1).validate()
    with pytest.raises(config.ConfigError, match="api port 6380 is already taken inside the stack by ray gcs"):
        config.StackConfig(folder=folder, line="0.7", gpus=8, api_port=6380).validate()
    with pytest.raises(config.ConfigError, match="server 'patched' is not a server build of the 0.8 stack"):
        config.StackConfig(folder=folder, server="patched").validate()
    # Both generations can run at once: different namespaces for the same cache.
    assert config.default(line="0.7").netns != config.default().netns


def test_cli_refuses_mixed_up_flags_with_a_message():
    for args, message in [(["up", "--server", "patched"], "server build of the 0.7 stack")]:
        result = subprocess.run([sys.executable, "-m", "nnsight_repro", "ndif", *args], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def _fake_ray(monkeypatch, ready_after_s):
    """Just what [A14] touches of Ray: the dashboard-address key, the KV getter, and a start_api_server that
    polls it as Ray 2.50's does (a fixed number of polls, here 20 x 0.01 s)."""
    import types

    constants = types.SimpleNamespace(DASHBOARD_ADDRESS="dashboard")
    started = time.monotonic()
    kv = types.SimpleNamespace(_internal_kv_get=lambda key, namespace=None: (
        b"127.0.0.1:8265" if key == "dashboard" and time.monotonic() - started > ready_after_s else None))

    def start_api_server():
        for _ in range(20):
            url = kv._internal_kv_get("dashboard", namespace="dashboard")
            if url is not None:
                return url
            time.sleep(0.01)
        return None

    for name, module in {"ray": types.ModuleType("ray"), "ray._private": types.SimpleNamespace(ray_constants=constants),
                         "ray._private.ray_constants": constants, "ray.experimental": types.SimpleNamespace(internal_kv=kv),
                         "ray.experimental.internal_kv": kv}.items():
        monkeypatch.setitem(sys.modules, name, module)
    return types.SimpleNamespace(start_api_server=start_api_server), kv


def test_rays_start_waits_for_a_dashboard_slower_than_its_fixed_polls_and_then_restores_the_getter(monkeypatch):
    from nnsight_repro.ndif import adaptations_0_0_1 as adaptations

    monkeypatch.setattr(adaptations, "DASHBOARD_POLL_EXTRA_S", 0.01)
    services, kv = _fake_ray(monkeypatch, ready_after_s=0.3)
    assert services.start_api_server() is None  # Ray's own budget, 0.2 s, is too short
    services, kv = _fake_ray(monkeypatch, ready_after_s=0.3)
    getter = kv._internal_kv_get
    adaptations.patient_dashboard_start(services)
    assert services.start_api_server() == b"127.0.0.1:8265"
    assert kv._internal_kv_get is getter


def test_the_dashboard_adaptation_reaches_ray_250s_own_start_api_server_and_its_fixed_polls():
    # What [A14] assumes of the 0.7 server's Ray: the loop it stretches is there, and the hook wraps it.
    env = server_env.ensure(build=False, line="0.7", extras=server_packages.SUITE)
    found = channel.run_one([str(env.python), "-c", (
        "import inspect, json, sys\n"
        "from nnsight_repro import channel\n"
        "from nnsight_repro.ndif import adaptations_0_0_1\n"
        "adaptations_0_0_1.install()\n"
        "import ray, ray._private.services as services\n"
        "wrapped = getattr(services.start_api_server, '__wrapped__', None)\n"
        "source = inspect.getsource(wrapped) if wrapped else ''\n"
        "channel.send({'ray': ray.__version__, 'wrapped': bool(wrapped),\n"
        "              'polls': 'for _ in range(200)' in source and '_internal_kv_get(' in source})\n")],
        env=env.environ(), cwd=ROOT, timeout=180, what="the 0.7 server's Ray")
    assert found == {"ray": "2.50.0", "wrapped": True, "polls": True}, found


def test_status_and_down_of_a_07_stack_that_is_not_running_say_so(tmp_path):
    # A cache of its own: the session's 0.7 stacks may be up in the lane meanwhile (tests/stack_lane.py).
    result = subprocess.run([sys.executable, "-m", "nnsight_repro", "ndif", "status", "--line", "0.7"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "NNSIGHT_REPRO_CACHE": str(tmp_path)})
    assert result.returncode == 1 and "not running" in result.stdout, result.stdout
    report = stack.down(config.default(folder=tmp_path / "ndif-0.7", line="0.7"), say=lambda m: None)
    assert report["deleted_netns"] is False


# The multimolecule extra: an RNA model and AntiBERTy ---------------------------------------------------
# The session's 0.7 stack, through the panel command's code (its batch, before everything above ran on it).
# Without the extra the same RNABERT request fails to provision: the probes declare that
# (scripts/ndif_feasibility/probes.toml, rnabert-masked-lm), observed in results/ndif_feasibility.

MULTIMOLECULE_BUILT = {"rnabert": "RnaBertForMaskedLM", "antiberty": "BertForMaskedLM"}


@pytest.mark.parametrize("trace", ["read", "write"])
@pytest.mark.parametrize("model", sorted(MULTIMOLECULE_BUILT))
def test_patched_client_runs_rnabert_and_antiberty_on_a_stock_multimolecule_server(ndif07, model, trace):
    row = ndif07["by"][(model, "patched", trace)]
    assert row["ok"], row
    assert row["built_class"] == MULTIMOLECULE_BUILT[model], row
    assert key_fields(row["key"])["automodel"] == "AutoModelForMaskedLM"
    for point in row["points"].values():
        # bfloat16 on the server; within five bf16 units at the value's own magnitude (Generation.tolerance).
        assert point["dtype"] == "torch.bfloat16" and point["max_abs_diff"] <= point["tolerance"], row["points"]
    if trace == "read":
        assert row["read_points"][0] == "first_layer: nns_output", row
    else:
        assert row["write_changes_local_output"], row


def test_stock_client_fails_on_the_multimolecule_server_where_the_key_and_envoy_bugs_predict(ndif07):
    by = ndif07["by"]
    for trace in ("read", "write"):
        # No automodel in the stock key: RNABERT asked for as AutoModelForCausalLM, which it has not.
        rna = by[("rnabert", "main", trace)]
        assert not rna["ok"] and "error provisioning the model deployment" in rna["reason"], rna
        assert "automodel" not in key_fields(rna["key"]) and rna["built_class"] is None, rna
        # AntiBERTy becomes BertLMHeadModel, and its request cannot load: the envoy bug.
        anti = by[("antiberty", "main", trace)]
        assert not anti["ok"] and HOOKED_OUTPUT in anti["reason"], anti
        assert anti["built_class"] == "BertLMHeadModel", anti
        assert rna["as_expected"] and anti["as_expected"]


def test_multimolecule_07_stack_runs_the_extras_environment_and_leaves_nothing(ndif07):
    env = str(server_env.path("0.7", server_packages.SUITE)) + "/"
    built = ndif07["built"]
    assert built and all(b["nnsight_file"].startswith(env) for b in built), built
    assert "down_error" not in ndif07, ndif07["down_error"]
    assert not ndif07["netns_left_after_down"]
    # The batch ran in a memory cgroup of its own, which saw no OOM kill and went with the stack.
    assert ndif07["memory"]["cgroup"]["oom_kills"] == 0, ndif07["memory"]
    assert not ndif07["cgroup_left_after_down"]
