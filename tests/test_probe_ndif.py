"""``scripts/ndif_feasibility/probe_ndif.py`` end to end against the local NDIF, and how it refuses bad input.

The script runs as a user runs it (a subprocess, no ``NDIF_HOST``), so it finds the session's local
stack (fixture ``ndif_stack``) and sends the probes through a real nnsight 0.8.1 client inside the
stack's namespace. Bad input must give a clear message, a recorded outcome and a non-zero exit.

Not tested: a refused API key. The local ndif 0.1.2 runs with authentication off, so no key is ever
refused there; a test of it needs a host that checks keys.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ndif_feasibility" / "probe_ndif.py"
PROBES = ROOT / "scripts" / "ndif_feasibility" / "probes.toml"

CONTROL = '''
[[probe]]
id = "control"
isolates = "A decoder saves a hidden state: the run goes on after a failing probe."
kind = "trace"
model = { panel = "gpt2", repo_id = "openai-community/gpt2", revision = "main" }
select = { "0.7" = { automodel = "AutoModelForCausalLM" }, "0.8" = { task = "text-generation" } }
input = "the big cat sat"
hook = { "0.7" = "model.transformer.h[0].output", "0.8" = "model.transformer.h[0].output" }
expect = { main = "ok", patched = "ok", "upstream-0.8" = "ok" }
'''


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
def probe_run(ndif_stack, tmp_path_factory):
    out = tmp_path_factory.mktemp("probe_run")
    result = run_script("--line", "upstream-0.8", out=out)
    return result, out


def test_every_probe_observation_matches_its_declaration_against_local_ndif(probe_run):
    result, out = probe_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (record,) = records(out, "upstream-0.8-")
    assert len(record["probes"]) == 8
    mismatched = [(p["id"], p["expected"], p["observed"]) for p in record["probes"] if not p["matched"]]
    assert not mismatched
    assert record["all_matched"] is True


def test_results_carry_each_declaration_verbatim_and_the_run_context(probe_run):
    import tomllib

    _, out = probe_run
    (record,) = records(out, "upstream-0.8-")
    declared = tomllib.loads(PROBES.read_text())["probe"]
    assert [p["declaration"] for p in record["probes"]] == declared
    context = record["context"]
    assert context["client"]["nnsight"] == "0.8.1"
    assert context["server_env"]["packages"]["nnsight"] == "0.8.1"
    for field in ("host", "date", "command", "server_generation"):
        assert context[field]
    assert (out / (sorted(out.glob("upstream-0.8-*.json"))[0].stem + ".md")).is_file()


def test_remote_traces_report_their_server_statuses_live(probe_run):
    result, out = probe_run
    (record,) = records(out, "upstream-0.8-")
    for probe in record["probes"]:
        if probe["declaration"]["kind"] == "trace" and probe["observed"]["status"] == "ok":
            assert probe["observed"]["statuses"][0] == "RECEIVED"
            assert probe["observed"]["statuses"][-1] == "COMPLETED"
            assert f"[probe_ndif] {probe['id']}: RUNNING" in result.stdout


# Failures on the server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def failing_run(ndif_stack, tmp_path_factory):
    """One run of three probes: an unprovisionable model, an exception mid-trace, then a control."""
    tmp = tmp_path_factory.mktemp("failing_run")
    text = '''
[[probe]]
id = "unprovisionable"
isolates = "A key naming a hub repo the offline server cannot read."
kind = "trace"
model = { panel = "gpt2", repo_id = "nnsight-repro/no-such-model", revision = "main", key = "hub" }
select = { "0.7" = { automodel = "AutoModelForCausalLM" }, "0.8" = { task = "text-generation" } }
input = "the big cat sat"
hook = { "0.7" = "model.transformer.h[0].output", "0.8" = "model.transformer.h[0].output" }
expect = { main = "ok", patched = "ok", "upstream-0.8" = "ok" }

[[probe]]
id = "raises-mid-trace"
isolates = "A hook expression that indexes a 3-d hidden state with four indices."
kind = "trace"
model = { panel = "gpt2", repo_id = "openai-community/gpt2", revision = "main" }
select = { "0.7" = { automodel = "AutoModelForCausalLM" }, "0.8" = { task = "text-generation" } }
input = "the big cat sat"
hook = { "0.7" = "model.transformer.h[0].output[0][0, 0, 0, 0]", "0.8" = "model.transformer.h[0].output[0][0, 0, 0, 0]" }
expect = { main = "ok", patched = "ok", "upstream-0.8" = "ok" }
''' + CONTROL
    out = tmp / "out"
    result = run_script("--probes", str(probe_file(tmp, text)), out=out)
    (record,) = records(out, "upstream-0.8-")
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


# Bad input, refused before any request ---------------------------------------------------------------

def test_unreachable_host_is_recorded_for_every_probe(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    result = run_script("--host", url, out=tmp_path)
    assert result.returncode == 1
    assert f"NDIF host {url} is unreachable" in result.stdout
    (record,) = records(tmp_path, "upstream-0.8-")
    assert {p["observed"]["error"] for p in record["probes"]} == {"HostUnreachable"}
    assert record["context"]["host"] == url


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


def test_expectation_for_an_unknown_client_line_is_refused(tmp_path):
    bad = probe_file(tmp_path, CONTROL.replace('patched = "ok"', 'patched = "ok", "nightly" = "ok"'))
    result = run_script("--probes", str(bad), out=tmp_path / "out")
    assert result.returncode == 2
    assert "unknown client line(s) nightly" in result.stderr


def test_unknown_client_line_on_the_command_line_is_refused(tmp_path):
    result = run_script("--line", "nightly", out=tmp_path)
    assert result.returncode == 2
    assert "unknown client line(s) nightly; client lines: main, patched, upstream-0.8" in result.stderr
    assert records(tmp_path, "refused-")


@pytest.mark.parametrize("line", ["main", "patched"])
def test_07_client_lines_name_the_missing_server_generation(tmp_path, line):
    result = run_script("--line", line, out=tmp_path)
    assert result.returncode == 3
    assert "issue 3 phase 2" in result.stderr and line in result.stderr
    assert not list(tmp_path.glob(f"{line}-*"))
