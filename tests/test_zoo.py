"""The zoo audit on its CI subset (``nnsight_repro.zoo.scan.CI_UNITS``) in main, patched and upstream-0.8.

One scan of the twelve CI units in every environment, with a segfault injected
into one unit's worker, so the same run proves the scan survives a crash. The
environments are built by ``python3 -m nnsight_repro test``; a missing one is an
error naming the command, never a skip. The full scan is
``python3 -m nnsight_repro zoo`` (results/zoo/).
"""

import pytest

from nnsight_repro.zoo import report as zoo_report, scan as zoo

ENVS = zoo.ENVS


@pytest.fixture(scope="module")
def report():
    scanned = zoo.run("ci", ENVS, parallel=len(ENVS),
                      extra_env={"NNSIGHT_REPRO_ZOO_INJECT": f"segfault={zoo.CI_CRASH_UNIT}"})
    return zoo_report.report(scanned, command="pytest tests/test_zoo.py")


def arch(report, model_type):
    return next(a for a in report["architectures"] if a["model_type"] == model_type)


def record(report, env, unit_id):
    return next(r for r in report["records"][env] if r["id"] == unit_id)


def test_every_ci_unit_has_a_record_in_every_environment(report):
    for env in ENVS:
        assert sorted(r["id"] for r in report["records"][env]) == sorted(zoo.CI_UNITS)
        assert report["environments"][env]["transformers"] == "5.22.2"
        assert report["environments"][env]["multimolecule"] == "0.2.2"


def test_collision_names_come_from_each_installed_nnsight(report):
    attributes = report["envoy_attributes"]
    for env in ENVS:
        assert {"output", "input", "inputs", "source"} <= set(attributes[env])
    # 0.8.1's Envoy serves ``save`` itself (0.7.0 mounts it on every object instead), and moves only its
    # public data descriptors; 0.7.0 moves on any attribute.
    assert "save" in attributes["upstream-0.8"] and "save" not in attributes["main"]
    assert attributes["upstream-0.8"]["output"] == "served" and attributes["upstream-0.8"]["to"] == "shadowed"
    assert {kind for name, kind in attributes["main"].items()} == {"served", "clobbered"}
    # An envoy's per-instance state is a name too: a submodule called ``path`` overwrites it on both lines.
    assert attributes["main"]["path"] == attributes["upstream-0.8"]["path"] == "clobbered"


@pytest.mark.parametrize("model_type", ["bert", "electra", "roberta", "esm", "rnabert"])
def test_encoders_collide_fail_on_the_release_and_pass_on_both_fixes(report, model_type):
    a = arch(report, model_type)
    assert a["colliding"] and a["envs"]["main"]["served_names"] == ["output"]
    assert a["failing_in"] == ["main"]
    assert a["fixed_by_series"] and a["fixed_by_0_8_1"]
    failures = [f for fs in a["envs"]["main"]["failures"].values() for f in fs]
    assert any("hooked_output" in f for f in failures), failures


@pytest.mark.parametrize("model_type", ["bert", "rnabert", "esm"])
def test_remote_local_runs_tiny_and_only_the_release_fails_it(report, model_type):
    a = arch(report, model_type)
    assert a["envs"]["main"]["remote_local"]["stage"] == "remote_trace"
    assert "hooked_output" in a["envs"]["main"]["remote_local"]["message"]
    patched, upstream = a["envs"]["patched"]["remote_local"], a["envs"]["upstream-0.8"]["remote_local"]
    assert patched["ok"] is True and upstream["ok"] is True
    # The read point is nnsight's output of an envoy whose ``output`` is a submodule: each line spells it its way.
    assert patched["read"].endswith(".nns_output") and upstream["read"].endswith(".output")


def test_bert_call_sites_map_each_line_spelling(report):
    sites = {s["pattern"]: s for s in report["call_sites"] if s["model_type"] == "bert"}
    layer = sites["bert.encoder.layer.N.output"]
    assert layer["0.7+series"] == {"nnsight_value": "bert.encoder.layer.N.nns_output",
                                   "submodule": "bert.encoder.layer.N.output"}
    assert layer["0.8"] == {"nnsight_value": "bert.encoder.layer.N.output",
                            "submodule": "bert.encoder.layer.N.E_output"}
    assert "bert.encoder.layer.N.attention.output" in sites
    assert "encoder.layer.N.output" in sites  # BertModel's own paths
    assert sorted(layer["classes"]) == ["BertForMaskedLM"]


@pytest.mark.parametrize("model_type", ["gpt2", "t5"])
def test_decoder_and_seq2seq_controls_do_not_collide_and_pass_everywhere(report, model_type):
    a = arch(report, model_type)
    assert not a["colliding"] and a["failing_in"] == []
    for env in ENVS:
        assert a["envs"][env]["remote_local"]["ok"] is True


def test_esm_defaults_cannot_be_built_so_it_is_built_tiny(report):
    for env in ENVS:
        build = record(report, env, "esm/EsmForMaskedLM")["build"]
        assert build["ok"] and build["config"] == "tiny" and build["defaults_failed"]["error"] == "TypeError"


def test_an_unbuildable_class_is_listed_with_its_reason(report):
    a = arch(report, "autoformer")
    assert not a["buildable"] and a["failing_in"] == []
    for env in ENVS:
        reason = a["envs"][env]["unbuildable"]["autoformer/AutoformerModel"]
        assert "prediction_length" in reason
    assert "| autoformer |" in zoo_report.markdown(report) and "cannot be built" in zoo_report.markdown(report)
    assert report["counts"]["unbuildable_architectures"] == 1


def test_a_crashing_worker_is_recorded_and_the_scan_goes_on(report):
    order = list(zoo.CI_UNITS)
    after = [u for u in order if u > zoo.CI_CRASH_UNIT]  # units are scanned in id order within a source
    assert after
    for env in ENVS:
        crashed = record(report, env, zoo.CI_CRASH_UNIT)
        assert crashed["crash"] == {"kind": "crash", "reason": "killed by SIGSEGV"}
        assert all(record(report, env, u)["build"]["ok"] for u in after if u != "autoformer/AutoformerModel")
        assert report["counts"]["worker_restarts"][env] == 1
        assert report["counts"]["crashes_or_timeouts"][env] == [zoo.CI_CRASH_UNIT]
    # The crash fails its architecture everywhere, and names why.
    assert arch(report, "llama")["envs"]["patched"]["failures"] == {
        zoo.CI_CRASH_UNIT: ["crash: killed by SIGSEGV"]}


def test_counts_no_colliding_architecture_fails_on_patched_except_by_the_injected_crash(report):
    counts = report["counts"]
    assert counts["architectures"] == 10 and counts["classes"] == 12
    assert counts["colliding"] == 6  # bert electra esm roberta rnabert vision-encoder-decoder
    assert counts["fixed_by_series"] == counts["fixed_by_0_8_1"] == counts["colliding_failing_on_main"] == 6
    assert counts["failing_on_patched_colliding"] == 0
    assert counts["failing_anywhere"]["patched"] == ["llama"]


def test_the_two_findings_beyond_output_reproduce_on_minimal_trees(report):
    """What zoo.md says about Flava, on two-module trees (nnsight_repro/zoo/minimal_trees.py), as each worker ran them."""
    found = {env: report["environments"][env]["probes"] for env in ENVS}
    # A submodule named ``path`` breaks the round trip on every line: the series does not cover it, nor does 0.8.1.
    for env in ENVS:
        assert found[env]["path_child"]["ok"] is False and "Envoy" in found[env]["path_child"]["path_types"]
    # Two colliding children on one module: the release fails; the series' chained class still round-trips.
    assert "hooked_input" in found["main"]["input_and_output_children"]["message"]
    assert found["patched"]["input_and_output_children"] == {
        "ok": True, "path_types": ["str"], "synthesized_classes": ["Envoy.Preserved.Preserved"]}
    assert found["upstream-0.8"]["input_and_output_children"]["ok"] is True
