"""``scripts/ndif_feasibility/probe_ndif.py`` end to end against the local NDIF stacks, and how it refuses bad input.

The script runs as a user runs it (a subprocess, no ``NDIF_HOST``, ``--with multimolecule``), so it finds the
session's local stacks, one per generation, both with multimolecule, and sends every probe through real
clients inside their namespaces: the upstream-0.8 pairing against the 0.8 stack (fixture ``ndif_stack``), the
stock 0.7 server's two pairings against the 0.7 stack (fixture ``ndif07_stock``, which runs the script while its
stack is up). The patched 0.7 server's pairing and servers without multimolecule are the committed records in
results/ndif_feasibility (``probe_ndif.py`` against a stack of that server build or without the extra). Bad
input must give a clear message, a recorded outcome and a non-zero exit.

Not tested: a refused API key. The local stacks run with authentication off, so no key is ever
refused there; a test of it needs a host that checks keys.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nnsight_repro.ndif.feasibility import runner
from nnsight_repro.ndif.feasibility.declarations import PROBED_PAIRINGS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ndif_feasibility" / "probe_ndif.py"
PROBES = ROOT / "scripts" / "ndif_feasibility" / "probes.toml"


def gpt2_probe(probe_id: str, isolates: str, hook: str = "model.transformer.h[0].output",
               repo: str = 'repo_id = "openai-community/gpt2", revision = "main"') -> str:
    """A probe of the tiny GPT-2 (the same hook on both lines) that every pairing expects to run."""
    return f'''
[[probe]]
id = "{probe_id}"
isolates = "{isolates}"
kind = "trace"
model = {{ panel = "gpt2", {repo} }}
select = {{ "0.7" = {{ automodel = "AutoModelForCausalLM" }}, "0.8" = {{ task = "text-generation" }} }}
input = "the big cat sat"
hook = {{ "0.7" = "{hook}", "0.8" = "{hook}" }}
expect = {{ main = "ok", patched = "ok", "patched-client-only" = "ok", "upstream-0.8" = "ok" }}
'''


CONTROL = gpt2_probe("control", "A decoder saves a hidden state: the run goes on after a failing probe.")


def run_script(*args, out: Path, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in {"NDIF_HOST", "NDIF_API_KEY"}}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], capture_output=True,
                          text=True, env=env, timeout=1200, cwd=ROOT)


def records(out: Path, prefix: str):
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{prefix}*.json"))]


def probe_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "probes.toml"
    path.write_text(text)
    return path


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The real probes against the local NDIF ----------------------------------------------------------

@pytest.fixture(scope="module")
def probe_run(ndif08):
    """The probe script's run against the 0.8 stack, every probe, ``--with multimolecule``, made by the lane
    job that brought that stack up (tests/ndif_fixture.py ``probe_script``): what it said, and its folder."""
    return ndif08["probes"], Path(ndif08["probes"]["out"])


#: How the 0.8 run's records are named: pairing, then the server's extras.
PREFIX_08 = "upstream-0.8+multimolecule-"


def test_every_probe_observation_matches_its_declaration_against_local_ndif(probe_run):
    result, out = probe_run
    assert result["returncode"] == 0, result["stdout"][-3000:] + result["stderr"][-3000:]
    (record,) = records(out, PREFIX_08)
    assert len(record["probes"]) == 8
    mismatched = [(p["id"], p["expected"], p["observed"]) for p in record["probes"] if not p["matched"]]
    assert not mismatched
    assert record["all_matched"] is True


def test_results_carry_each_declaration_verbatim_and_the_run_context(probe_run):
    import tomllib

    _, out = probe_run
    (record,) = records(out, PREFIX_08)
    declared = tomllib.loads(PROBES.read_text())["probe"]
    assert [p["declaration"] for p in record["probes"]] == declared
    context, made = record["context"], record["provenance"]
    assert context["client"]["nnsight"] == "0.8.1"
    assert context["server_env"]["packages"]["nnsight"] == "0.8.1"
    assert made["versions"]["client"]["nnsight"] == made["versions"]["server"]["nnsight"] == "0.8.1"
    assert made["command"].startswith("python3 ") and "probe_ndif.py" in made["command"]
    assert "--pairing upstream-0.8" in made["command"]
    for field in ("host", "date"):
        assert made[field]
    assert made["server"]["kind"] == "local NDIF stack" and "ndif 0.1.2" in made["server"]["generation"]
    assert (out / (sorted(out.glob(f"{PREFIX_08}*.json"))[0].stem + ".md")).is_file()


def test_remote_traces_report_their_server_statuses_live(probe_run):
    result, out = probe_run
    (record,) = records(out, PREFIX_08)
    for probe in record["probes"]:
        if probe["declaration"]["kind"] == "trace" and probe["observed"]["status"] == "ok":
            assert probe["observed"]["statuses"][0] == "RECEIVED"
            assert probe["observed"]["statuses"][-1] == "COMPLETED"
            assert f"[probe_ndif] {probe['id']}: RUNNING" in result["stdout"]


# The multimolecule extra: the RNA probes observe a remote trace --------------------------------------

MULTIMOLECULE_PROBES = ("rnabert-masked-lm", "splicebert-masked-lm")
#: The probes an extra changes (declarations.depends_on_extras), in the file's order: the RNA probes, and
#: the env probe, which compares multimolecule too.
EXTRA_CHANGES = (*MULTIMOLECULE_PROBES, "environment-alignment")
#: The pairings the session's stacks serve: the stock 0.7 server's two and 0.8's.
SERVED_PAIRINGS = ("main", "patched-client-only", "upstream-0.8")


@pytest.fixture(scope="module")
def by_pairing(ndif07_stock, probe_run):
    """Every pairing's records of the real probes with ``--with multimolecule``: the 0.7 pairings' from the
    run the 0.7 stack's lane job made while it was up (tests/ndif_fixture.py ``probe_script``), 0.8's from
    :func:`probe_run`."""
    return {**ndif07_stock["probes"]["records"], "upstream-0.8": records(probe_run[1], PREFIX_08)}


def test_the_probe_runs_cover_every_pairing_the_stacks_serve_and_exit_zero(by_pairing, ndif07_stock):
    assert sorted(by_pairing) == sorted(SERVED_PAIRINGS)
    assert all(len(found) == 1 for found in by_pairing.values()), {name: len(found) for name, found in by_pairing.items()}
    run = ndif07_stock["probes"]
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]


def test_every_probe_run_with_the_multimolecule_extra_matches_its_declaration(by_pairing):
    for name, found in by_pairing.items():
        (record,) = found
        assert record["server_flavours"] == ["multimolecule"], name
        mismatched = [(p["id"], p["expected"], p["observed"]) for p in record["probes"] if not p["matched"]]
        assert not mismatched, name


def test_rna_probes_trace_remotely_with_the_multimolecule_extra_and_both_fixes(by_pairing):
    for name in ("patched-client-only", "upstream-0.8"):
        (record,) = by_pairing[name]
        observed = {p["id"]: p["observed"] for p in record["probes"]}
        for probe_id in MULTIMOLECULE_PROBES:
            assert observed[probe_id]["status"] == "ok", (name, observed[probe_id])
            assert observed[probe_id]["statuses"][-1] == "COMPLETED", (name, observed[probe_id])


def test_the_stock_client_still_fails_to_provision_rna_models_with_the_multimolecule_extra(by_pairing):
    (record,) = by_pairing["main"]
    observed = {p["id"]: p["observed"] for p in record["probes"]}
    for probe_id in MULTIMOLECULE_PROBES:
        assert "error provisioning the model deployment" in observed[probe_id]["message"], observed[probe_id]


def test_an_extras_expectation_replaces_expect_only_for_the_pairings_it_names():
    from nnsight_repro.ndif.feasibility import declarations

    (probe,) = [p for p in declarations.load_probes(PROBES) if p["id"] == "rnabert-masked-lm"]
    assert declarations.expectation(probe, "upstream-0.8") == probe["expect"]["upstream-0.8"] != "ok"
    assert declarations.expectation(probe, "upstream-0.8", ("multimolecule",)) == "ok"
    assert declarations.expectation(probe, "main", ("multimolecule",)) == probe["expect"]["main"]


def test_the_probes_an_extra_changes_declare_an_outcome_for_it_or_name_a_package_it_installs():
    from nnsight_repro.ndif.feasibility import declarations

    probes = declarations.load_probes(PROBES)
    for extra in ("multimolecule", "multimolecule-patched"):
        changed = [p["id"] for p in probes if declarations.depends_on_extras(p, (extra,))]
        assert changed == list(EXTRA_CHANGES), extra
    assert not [p["id"] for p in probes if declarations.depends_on_extras(p, ())]


def test_an_extra_without_an_entry_of_its_own_expects_what_the_package_it_installs_expects():
    from nnsight_repro.ndif.feasibility import declarations

    (probe,) = [p for p in declarations.load_probes(PROBES) if p["id"] == "rnabert-masked-lm"]
    assert "multimolecule-patched" not in probe["expect_with"]
    for pairing in ("upstream-0.8", "main"):
        assert declarations.expectation(probe, pairing, ("multimolecule-patched",)) == \
            declarations.expectation(probe, pairing, ("multimolecule",))
    assert declarations.expectation(probe, "upstream-0.8", ("multimolecule-patched",)) == "ok"


# Failures on the server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def failing_run(ndif_stack, tmp_path_factory):
    """One run of three probes: an unprovisionable model, an exception mid-trace, then a control."""
    tmp = tmp_path_factory.mktemp("failing_run")
    text = (gpt2_probe("unprovisionable", "A key naming a hub repo the offline server cannot read.",
                       repo='repo_id = "nnsight-repro/no-such-model", revision = "main", key = "hub"')
            + gpt2_probe("raises-mid-trace", "A hook expression that indexes a 3-d hidden state with four indices.",
                         hook="model.transformer.h[0].output[0][0, 0, 0, 0]")
            + CONTROL)
    out = tmp / "out"
    result = run_script("--probes", str(probe_file(tmp, text)), "--with", "multimolecule", "--pairing", "upstream-0.8",
                        out=out)
    (record,) = records(out, PREFIX_08)
    return result, {p["id"]: p for p in record["probes"]}


def test_model_the_server_cannot_provision_is_recorded_with_the_servers_reason(failing_run):
    result, probes = failing_run
    observed = probes["unprovisionable"]["observed"]
    assert result.returncode == 1
    assert observed["status"] == "error" and observed["error"] == "RemoteError"
    assert "Could not deploy this model" in observed["message"]
    assert "nnsight-repro/no-such-model" in observed["message"]
    assert "unprovisionable: RemoteError: Could not deploy this model" in result.stdout


def test_server_side_exception_mid_trace_is_recorded_with_the_server_traceback(failing_run):
    result, probes = failing_run
    observed = probes["raises-mid-trace"]["observed"]
    assert result.returncode == 1
    assert observed["error"] == "RemoteError"
    assert "RUNNING" in observed["statuses"] and "ERROR" in observed["statuses"]
    assert "IndexError" in observed["server_traceback_tail"]
    assert not probes["raises-mid-trace"]["matched"]


def test_a_failing_probe_does_not_stop_the_ones_after_it(failing_run):
    _, probes = failing_run
    assert probes["control"]["observed"]["status"] == "ok"
    assert probes["control"]["matched"]


class StandInHost(runner.Host):
    """A host whose client is ``tests/silent_probe_client.py``."""

    def command(self, env, argv):
        return [sys.executable, str(ROOT / "tests" / "silent_probe_client.py")]


def run_stand_in(monkeypatch, ids):
    monkeypatch.setattr(runner, "NO_ANSWER_S", 1.0)
    return runner.run_pairing("patched", [{"id": i} for i in ids], StandInHost("http://stand-in", None), say=lambda m: None)


def test_a_client_silent_past_the_limit_costs_only_the_probe_it_was_on(monkeypatch):
    observed, context = run_stand_in(monkeypatch, ["first", "hangs", "after", "hangs-again", "last"])
    assert {p: o["status"] for p, o in observed.items()} == {
        "first": "ok", "hangs": "error", "after": "ok", "hangs-again": "error", "last": "ok"}
    assert observed["hangs"]["error"] == "NoAnswer"
    assert "sent nothing for 1 s (last server status: RUNNING)" in observed["hangs"]["message"]
    assert "ran in a fresh client" in observed["hangs"]["message"]
    assert context == {"client": {"line": "stand-in"}, "server_env": {"python": "3.11"}}


def test_a_client_silent_on_its_last_probe_still_leaves_its_versions(monkeypatch):
    observed, context = run_stand_in(monkeypatch, ["first", "hangs"])
    assert observed["hangs"]["error"] == "NoAnswer"
    assert "fresh client" not in observed["hangs"]["message"]
    assert context["client"] == {"line": "stand-in"}


# Bad input, refused before any request ---------------------------------------------------------------

def test_unreachable_host_is_recorded_for_every_probe(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    result = run_script("--host", url, out=tmp_path)
    assert result.returncode == 1
    assert f"NDIF host {url} is unreachable" in result.stdout
    for pairing in ("main", "patched", "patched-client-only", "upstream-0.8"):  # every pairing, each recorded
        (record,) = records(tmp_path, f"{pairing}-2")
        assert {p["observed"]["error"] for p in record["probes"]} == {"HostUnreachable"}, pairing
        assert record["provenance"]["server"]["url"] == url


def test_malformed_probe_file_is_refused_before_any_request(tmp_path):
    # An unreachable host: a request attempted would turn into exit 1, not the validation's 2.
    bad = probe_file(tmp_path, CONTROL.replace('input = "the big cat sat"', 'input = "the big cat sat"\ncolour = "red"'))
    result = run_script("--probes", str(bad), "--host", f"http://127.0.0.1:{closed_port()}", out=tmp_path / "out")
    assert result.returncode == 2
    assert "unknown field(s) colour" in result.stderr
    (refusal,) = records(tmp_path / "out", "refused-")
    assert "colour" in refusal["refused"]
    assert not list((tmp_path / "out").glob("upstream-0.8-*"))


def test_probe_file_that_is_not_toml_is_refused(tmp_path):
    bad = probe_file(tmp_path, "[[probe]\nid = ")
    result = run_script("--probes", str(bad), out=tmp_path / "out")
    assert result.returncode == 2
    assert "is not valid TOML" in result.stderr


def test_self_contradicting_expectation_is_refused(tmp_path):
    bad = probe_file(tmp_path, CONTROL.replace('"upstream-0.8" = "ok"',
                                               '"upstream-0.8" = { status = "ok", error = "RemoteError" }'))
    result = run_script("--probes", str(bad), "--host", f"http://127.0.0.1:{closed_port()}", out=tmp_path / "out")
    assert result.returncode == 2
    assert "contradicts itself" in result.stderr
    assert records(tmp_path / "out", "refused-")


def test_expectation_for_an_unknown_pairing_is_refused(tmp_path):
    bad = probe_file(tmp_path, CONTROL.replace('patched = "ok"', 'patched = "ok", "nightly" = "ok"'))
    result = run_script("--probes", str(bad), out=tmp_path / "out")
    assert result.returncode == 2
    assert "unknown pairing(s) nightly" in result.stderr


def test_expectation_for_an_unknown_extra_is_refused(tmp_path):
    bad = probe_file(tmp_path, CONTROL + '[probe.expect_with.nightly]\n"upstream-0.8" = "ok"\n')
    result = run_script("--probes", str(bad), "--host", f"http://127.0.0.1:{closed_port()}", out=tmp_path / "out")
    assert result.returncode == 2
    assert "expect_with.nightly: unknown extra (extras: multimolecule, multimolecule-patched)" in result.stderr


def test_unknown_extra_on_the_command_line_is_refused(tmp_path):
    result = run_script("--with", "nightly", "--host", f"http://127.0.0.1:{closed_port()}", out=tmp_path)
    assert result.returncode == 2
    assert "`--with` takes: multimolecule" in result.stderr
    assert records(tmp_path, "refused-")


def test_unknown_pairing_on_the_command_line_is_refused(tmp_path):
    result = run_script("--pairing", "nightly", out=tmp_path)
    assert result.returncode == 2
    assert ("unknown pairing(s) nightly; pairings: main, patched, patched-client-only, upstream-0.8"
            in result.stderr)
    assert records(tmp_path, "refused-")


@pytest.mark.parametrize("given", [["--line", "upstream-0.8"], ["--line"]])
def test_the_old_line_option_is_refused_with_its_new_name(tmp_path, given):
    """``--line`` took a pairing before "line" came to mean an nnsight release line only: a stale command
    line stops at the parser, naming ``--pairing``, before any probe file is read or request sent."""
    result = run_script(*given, "--host", f"http://127.0.0.1:{closed_port()}", out=tmp_path)
    assert result.returncode == 2
    assert ("--line is now --pairing (a client x server pairing: main, patched, patched-client-only, upstream-0.8)"
            in result.stderr)
    assert not list(tmp_path.iterdir())


def test_probe_option_runs_only_the_probes_it_names(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    result = run_script("--probe", "splicebert-masked-lm,catalogue", "--pairing", "upstream-0.8", "--host", url,
                        out=tmp_path)
    assert result.returncode == 1, result.stderr
    (record,) = records(tmp_path, "upstream-0.8-2")
    assert [p["id"] for p in record["probes"]] == ["catalogue", "splicebert-masked-lm"]  # the file's order
    assert record["provenance"]["details"]["probe_option"] == "splicebert-masked-lm,catalogue"


def test_unknown_probe_id_on_the_command_line_is_refused_before_any_request(tmp_path):
    result = run_script("--probe", "bert-masked-lm,gpt5", "--host", f"http://127.0.0.1:{closed_port()}",
                        out=tmp_path)
    assert result.returncode == 2
    assert "unknown probe id(s) gpt5; the probe file declares: catalogue, gpt2-decoder-control" in result.stderr
    (refusal,) = records(tmp_path, "refused-")
    assert refusal["provenance"]["details"]["probe_option"] == "bert-masked-lm,gpt5"
    assert not list(tmp_path.glob("upstream-0.8-*"))


# The 0.7 pairings against the 0.7 stack (ndif 0.0.1, stock server) ----------------------------------

#: The 0.7 pairings the session's 0.7 stack (stock server) serves, from the one declaration of pairings.
STOCK_07_PAIRINGS = [name for name, p in PROBED_PAIRINGS.items() if p.line == "0.7" and p.server == "stock"]


@pytest.mark.parametrize("pairing", STOCK_07_PAIRINGS)
def test_07_pairing_records_name_the_07_server_and_client(pairing, ndif07_stock):
    (record,) = ndif07_stock["probes"]["records"][pairing]
    assert "ndif 0.0.1" in record["provenance"]["server"]["generation"]
    assert record["context"]["client"]["nnsight"] == "0.7.0"


def test_probe_script_uses_the_running_07_stack_and_leaves_it_up(ndif07_stock):
    probes = ndif07_stock["probes"]
    assert probes["stack_still_up"]
    assert "bringing up" not in probes["stdout"], probes["stdout"][-2000:]


def test_patched_client_against_a_stock_server_runs_every_encoder_probe(ndif07_stock):
    """The series needs no server change: what the public NDIF runs serves a patched client's encoders."""
    (record,) = ndif07_stock["probes"]["records"]["patched-client-only"]
    observed = {p["id"]: p["observed"] for p in record["probes"]}
    for probe_id in ("gpt2-decoder-control", "bert-causal-path", "esm-masked-lm", "bert-masked-lm"):
        assert observed[probe_id]["status"] == "ok", observed[probe_id]
