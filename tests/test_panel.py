"""The RNA/protein panel (nnsight_repro.models.RNA_PANEL) through the check routine, in every environment.

The records come from the session's local verify (tests/verify_fixture.py), which runs every model
and check once per environment (main, patched, upstream-0.8): multimolecule is imported once per
environment and AntiBERTy's real weights are loaded once. Every outcome is compared with
``checks.expected_ok``, the prediction from two facts of each model: whether its layers have an
``output`` submodule (the envoy bug) and which class a server must rebuild (the key bug).
"""

import pytest

from nnsight_repro import checks, models, verify

PANEL = list(models.RNA_PANEL)
ENVS = ("main", "patched", "upstream-0.8")


@pytest.fixture(scope="module")
def records(local_verify):
    return local_verify.report["raw"]


def outcomes(records, env_name: str, names) -> dict:
    return {(n, c): r["ok"] for n in names for c, r in records[env_name]["models"][n].items()}


def predicted(env_name: str, names) -> dict:
    return {(n, c): checks.expected_ok(models.RNA_PANEL[n], c, fixed=env_name != "main")
            for n in names for c in checks.CHECKS + checks.EXTRA_CHECKS}


@pytest.mark.parametrize("name", PANEL)
def test_release_fails_each_panel_model_exactly_as_predicted(records, name):
    assert outcomes(records, "main", [name]) == predicted("main", [name]), records["main"]["models"][name]


@pytest.mark.parametrize("env_name", ["patched", "upstream-0.8"])
def test_fixed_lines_pass_every_panel_model(records, env_name):
    assert outcomes(records, env_name, PANEL) == predicted(env_name, PANEL), records[env_name]["models"]


def test_the_nine_are_the_multimolecule_models_the_release_cannot_send(records):
    failing = {n for n in PANEL if not records["main"]["models"][n]["remote_local"]["ok"]}
    assert failing == set(models.THE_NINE) | {"antiberty"}
    assert len(models.THE_NINE) == 9 and "rnamsm" not in models.THE_NINE


@pytest.mark.parametrize("env_name", ["patched", "upstream-0.8"])
def test_multimolecule_models_need_multimolecule_where_rebuilt(records, env_name):
    for name in PANEL:
        result = records[env_name]["models"][name]["rebuild_without_package"]
        assert result["packages_imported"] == [], result
        assert result["needs_package_where_rebuilt"] is bool(models.RNA_PANEL[name].requires), (name, result)


def test_panel_numbers_are_identical_on_main_patched_and_08(records):
    report = verify.compare(records)
    assert all(report["numbers"][name]["identical"] for name in PANEL), report["numbers"]
    for name in PANEL:
        assert len(report["numbers"][name]["digests"]["embedding_shift"]) == len(ENVS), name


@pytest.mark.parametrize("name", PANEL)
def test_shift_peaks_on_the_substituted_unit(records, name):
    shift = records["patched"]["models"][name]["embedding_shift"]
    assert shift["peak_position"] in shift["substituted_positions"], shift
    assert shift["peak_value"] > 0, shift


def test_every_panel_model_has_its_own_numbers(records):
    digests = {name: records["patched"]["models"][name]["embedding_shift"]["digest"] for name in PANEL}
    assert len(set(digests.values())) == len(PANEL), digests


def test_real_antibody_model_spreads_the_shift_beyond_the_residue(records):
    # Random tiny models keep the shift local (std-0.02 weights barely mix
    # positions); trained attention carries it along the chain.
    shift = records["patched"]["models"]["antiberty"]["embedding_shift"]
    assert shift["reach_positions"] > 0 and shift["mean_elsewhere"] > 0.01 * shift["peak_value"], shift
