"""The panel command and the extras, offline: what decides a record, and bad input.

The live runs are in tests/test_remote_ndif.py and tests/test_remote_ndif_07.py (their multimolecule
sections); the whole panel is ``python3 -m nnsight_repro ndif panel``, whose real run is committed under
``results/ndif_0.7`` and ``results/ndif_0.8``.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from nnsight_repro import ROOT, models, procfs
from nnsight_repro.ndif import config, panel, server_env, server_packages


def test_tolerance_is_exact_on_08_and_five_bf16_units_at_the_values_magnitude_on_07():
    assert config.generation("0.8").tolerance(34.0) == 0.0
    # The tiny models' magnitudes (2-4) keep the negative control's 0.08; smaller ones never go below it.
    assert config.generation("0.7").tolerance(2.9) == panel.ATOL["0.7"] == 0.08
    assert config.generation("0.7").tolerance(0.3) == 0.08
    # AntiBERTy's logits (~34): one bf16 unit there is 2^-2.
    assert config.generation("0.7").tolerance(34.06) == 5 * 2 ** -2


def test_negative_control_predictions_follow_the_key_and_envoy_bugs():
    assert panel.predicted("gpt2", "main", "0.7") == {"outcome": "ok"}
    # BERT masked LMs can be rebuilt as BertLMHeadModel, and then fail on the envoy bug; ESM and every
    # multimolecule family have no causal LM, so the stock key fails to provision first.
    for name in ("bert-mlm", "antiberty"):
        assert panel.predicted(name, "main", "0.7")["bug"] == "envoy"
    for name in ("esm-mlm", "rnabert", "rnamsm", "calm", "ernierna"):
        assert panel.predicted(name, "main", "0.7") == {"outcome": "fail", "bug": "key",
                                                         "message": panel.PROVISIONING}


def test_a_base_bert_from_the_stock_key_is_predicted_to_fail_on_a_module_path_the_rebuilt_model_lacks():
    # BertLMHeadModel keeps the base model under bert.; a BertModel's request names model.embeddings.
    # (tests/test_wire.py serves the real request to a server built from the key.)
    assert panel.predicted("bert-base", "main", "0.7") == {"outcome": "fail", "bug": "key",
                                                           "message": panel.UNKNOWN_MODULE}


def test_required_pairings_are_predicted_ok_except_a_model_that_cannot_run_in_the_servers_bfloat16():
    for name in models.extended():
        assert panel.predicted(name, "upstream-0.8", "0.8") == {"outcome": "ok"}
        if name != "ernierna":
            assert panel.predicted(name, "patched", "0.7") == {"outcome": "ok"}
    assert panel.predicted("ernierna", "patched", "0.7") == {"outcome": "fail", "bug": "bfloat16",
                                                             "message": models.BF16_MIXED_DTYPE}


def test_a_model_that_fails_in_bfloat16_is_predicted_ok_with_the_extra_that_carries_its_fix():
    for name in models.extended():
        assert panel.predicted(name, "patched", "0.7", "multimolecule-patched") == {"outcome": "ok"}
    # The fix does not touch what the stock client's key and envoy bugs do.
    assert panel.predicted("ernierna", "main", "0.7", "multimolecule-patched")["bug"] == "key"


def test_a_model_that_fails_in_bfloat16_with_no_fix_is_predicted_to_fail_with_every_extra(monkeypatch):
    unfixed = dataclasses.replace(models.extended()["ernierna"], bfloat16_fix=None)
    monkeypatch.setattr(panel.panel_models, "get", lambda name: unfixed)
    for extra in panel.EXTRAS:
        assert panel.predicted("ernierna", "patched", "0.7", extra)["bug"] == "bfloat16", extra


def test_a_report_with_another_extra_goes_beside_the_default_ones_and_never_over_them(tmp_path):
    assert panel.report_path(tmp_path, "0.7") == tmp_path / "ndif_0.7" / "panel.json"
    assert panel.report_path(tmp_path, "0.7", "multimolecule-patched") == \
        tmp_path / "ndif_0.7" / "panel+multimolecule-patched.json"


def _row(record, line="0.7", trace="read", built=None):
    kind = panel.TRACES[trace]
    case = f"{kind}:rnabert:{panel.ATOL[line]}"
    client = "patched" if line == "0.7" else "upstream-0.8"
    rows = panel.model_rows("rnabert", client, "required", line, {case: record}, built or {}, None, 1)
    return {r["trace"]: r for r in rows}[trace]


def test_a_record_is_ok_only_within_tolerance_at_every_point_and_without_an_error():
    point = {"max_abs_diff": 0.05, "dtype": "torch.bfloat16", "shape": [1, 3, 32], "max_abs_local": 3.0}
    record = {"ok": True, "key": "k", "first_layer": dict(point), "final_hidden": dict(point)}
    row = _row(record, built={"k": "RnaBertForMaskedLM"})
    assert row["ok"] and row["built_class"] == "RnaBertForMaskedLM" and row["max_abs_diff"] == 0.05
    record["final_hidden"]["max_abs_diff"] = 0.2
    assert not _row(record)["ok"]
    assert not _row(record, line="0.8")["ok"]
    failed = {"ok": False, "error": "RemoteException", "message": "Traceback ...\nModule x is not whitelisted"}
    row = _row(failed)
    assert not row["ok"] and row["reason"].endswith("not whitelisted") and not row["as_expected"]


def test_a_write_that_does_not_change_the_local_logits_is_not_ok():
    logits = {"max_abs_diff": 0.0, "dtype": "torch.float32", "shape": [1, 3, 32], "max_abs_local": 1.0}
    record = {"ok": True, "key": "k", "logits": logits, "write_changes_local_output": False}
    assert not _row(record, line="0.8", trace="write")["ok"]
    record["write_changes_local_output"] = True
    assert _row(record, line="0.8", trace="write")["ok"]


def test_the_write_case_of_a_base_model_reads_its_final_hidden_state_and_matches_the_same_write_locally():
    # The client's own write case, its server half run by nnsight's local simulation (serializer and all).
    from nnsight_repro.ndif import remote_client

    record = remote_client.case_write("bert-base", remote="local")
    assert models.get("bert-base").output_field == "last_hidden_state" and "logits" not in record, record
    assert record["ok"] and record["last_hidden_state"]["max_abs_diff"] == 0.0, record
    assert record["write_changes_local_output"], record


def test_the_clients_local_traces_of_utr_lm_run_on_07():
    # 0.7's LanguageModel makes no attention mask from an input_ids tensor and UTR-LM's embeddings need one
    # (tests/test_upstream_repros.py): both local halves of the panel's cases pass the subject's inputs.
    from nnsight_repro import wire
    from nnsight_repro.ndif import remote_client

    s = remote_client.subject("utrlm")
    assert "attention_mask" in s.inputs(s.ids[0])
    assert set(remote_client.saves(s)) == {"first_layer", "final_hidden"}
    assert list(wire.traced(s, "write")) == ["output"]


def test_a_model_the_server_cannot_deploy_carries_the_servers_reason_in_both_traces():
    rows = panel.model_rows("rnabert", "upstream-0.8", "required", "0.8", {}, {},
                          "Model(s) failed to deploy:\n  rnabert: ValueError: model type 'rnabert' not recognized", 1)
    assert [r["trace"] for r in rows] == ["read", "write"]
    assert all(not r["ok"] and "model type 'rnabert'" in r["reason"] for r in rows)


def test_a_deployment_that_stalls_leaves_the_rest_of_the_batch_undeployed_and_traces_what_deployed(
        monkeypatch, tmp_path):
    from nnsight_repro.ndif import deploy, errors, memory_watch, netns, stack, stack_clients

    attempted, traced = [], []

    def deploy_models(cfg, env, minted):
        (name,) = minted
        attempted.append(name)
        if name == "rnafm":
            raise errors.StackError("Timed out after 300 s waiting for `ndif deploy` of rnafm.")
        if name == "rnabert":
            raise deploy.DeployError("Model(s) failed to deploy:\n  rnabert: ValueError: not recognized")

    def run_client(cfg, cases, client, timeout):
        traced.extend(cases)
        return {case: {"ok": False, "error": "Fake", "message": "not a real trace"} for case in cases}

    # A cache of its own: the batch holds its stack folder's lease, and the session's lane may hold the real one's.
    monkeypatch.setenv("NNSIGHT_REPRO_CACHE", str(tmp_path))
    monkeypatch.setattr(netns, "exists", lambda name: False)
    monkeypatch.setattr(stack, "up", lambda cfg, models, say: {})
    monkeypatch.setattr(stack, "down", lambda cfg, say: {})
    monkeypatch.setattr(stack, "minted_keys", lambda cfg, names: {n: {"key": n} for n in names})
    monkeypatch.setattr(stack, "deploy_models", deploy_models)
    monkeypatch.setattr(stack_clients, "run_client", run_client)
    monkeypatch.setattr(stack_clients, "built_models", lambda cfg: [])
    monkeypatch.setattr(server_env, "ensure", lambda **kw: None)
    monkeypatch.setattr(panel, "stack_memory", lambda cfg: {})
    monkeypatch.setattr(memory_watch, "memory_group", lambda cfg: None)

    result = panel.run_batch("0.8", ["rnabert", "splicebert", "rnafm", "rinalmo", "utrlm"], 1, say=lambda m: None)
    # A model the server refuses does not stop the batch; one whose deployment stalls does, at once.
    assert attempted == ["rnabert", "splicebert", "rnafm"]
    assert {case.split(":")[1] for case in traced} == {"splicebert"}
    reasons = {r["model"]: r["reason"] for r in result["rows"]}
    assert "not recognized" in reasons["rnabert"] and "Timed out after 300 s" in reasons["rnafm"]
    for name in ("rinalmo", "utrlm"):
        assert reasons[name].startswith("not deployed: the stack stopped taking models at rnafm (Timed out"), reasons
        assert "smaller --batch" in reasons[name]
    assert len(result["rows"]) == 10 and not any(r["ok"] for r in result["rows"])


def test_stack_memory_counts_every_process_and_names_the_model_actors_by_their_ray_title(monkeypatch):
    from nnsight_repro.ndif import config, netns

    # A process titled as Ray titles a model actor's worker (argv[0]), beside this one.
    actor = subprocess.Popen(["bash", "-c", f"exec -a '{panel.MODEL_ACTOR_TITLE}.execute' sleep 60"])
    try:
        for _ in range(100):  # until the exec has happened
            if (procfs.command_line(actor.pid) or [""])[0].startswith(panel.MODEL_ACTOR_TITLE):
                break
            time.sleep(0.05)
        monkeypatch.setattr(netns, "pids", lambda name: [os.getpid(), actor.pid])
        memory = panel.stack_memory(config.default(line="0.8", extras=("multimolecule",)))
    finally:
        actor.kill()
        actor.wait()
    assert memory["processes"] == 2 and len(memory["model_actor_rss_mib"]) == 1, memory
    assert memory["stack_rss_mib"] > memory["model_actor_rss_mib"][0], memory  # this process is counted too


@pytest.mark.parametrize("args, message", [
    (["--models", "nope"], "unknown model(s) nope; the panel has: bert-mlm"),
    (["--batch", "0"], "--batch must be at least 1"),
    (["--memory-limit", "0"], "--memory-limit is a positive number of MiB, not 0"),
    (["--line", "0.9"], "invalid choice: '0.9'"),
])
def test_panel_command_refuses_bad_input_before_starting_anything(args, message):
    result = subprocess.run([sys.executable, "-m", "nnsight_repro", "ndif", "panel", *args], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_server_imports_what_its_extras_name_and_a_missing_package_raises(monkeypatch):
    monkeypatch.setenv(server_packages.IMPORTS_VARIABLE, "colorsys")
    assert "colorsys" in server_packages.import_for_models()
    monkeypatch.setenv(server_packages.IMPORTS_VARIABLE, "no_such_package_for_nnsight_repro")
    with pytest.raises(ModuleNotFoundError):
        server_packages.import_for_models()


@pytest.mark.parametrize("model_type, imports", [("bert", False), ("rnabert", True), (None, True)])
def test_a_model_actor_imports_the_extras_only_for_a_model_type_transformers_does_not_know(
        monkeypatch, tmp_path, model_type, imports):
    monkeypatch.setenv(server_packages.IMPORTS_VARIABLE, "colorsys")
    monkeypatch.setattr(server_packages, "_imported", {})
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    if model_type:  # else no config.json to read: the extras are imported
        (checkpoint / "config.json").write_text(json.dumps({"model_type": model_type}))
    key = "nnsight.modeling.language.LanguageModel:" + json.dumps({"repo_id": str(checkpoint), "revision": None})
    assert ("colorsys" in server_packages.import_for_models(key)) is imports


def test_server_environment_with_an_extra_has_its_own_name_and_inputs_and_the_plain_one_keeps_its_digest():
    assert server_env.env_name("0.7", ("multimolecule",)) == "ndif-server-0.7+multimolecule"
    assert "with_pins_sha256" not in server_env.inputs("0.8")
    assert set(server_env.inputs("0.8", ("multimolecule",))["with_pins_sha256"]) == {"multimolecule"}
    with pytest.raises(server_packages.ExtraError, match="`--with` takes: multimolecule"):
        server_env.env_name("0.8", ("nope",))


def test_extra_pins_add_only_what_neither_server_has():
    def names(path):
        return {line.split("==")[0].lower().replace("_", "-") for line in path.read_text().splitlines()
                if line.strip() and not line.startswith("#")}

    extra = names(ROOT / "nnsight_repro" / "pins" / "ndif-server-multimolecule.txt")
    assert "multimolecule" in extra and "torch" not in extra and "transformers" not in extra
    assert not extra & names(ROOT / "nnsight_repro" / "pins" / "ndif-server.txt")
