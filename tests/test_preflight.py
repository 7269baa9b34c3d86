"""``preflight``: its verdicts against what the live runs observed, cell for cell, and its answers to a host
and to bad input.

The committed live runs are the reference: ``results/ndif_0.7/panel.json`` and
``panel+multimolecule-patched.json``, ``results/ndif_0.8/panel.json``, ``results/ndif_0.7/negative_control.json``
and the probe records in ``results/ndif_feasibility/``. Each of their (model, client, server) cells is
predicted here from nothing but the model's config (the panel's configs, written without weights) and the
server's facts as the record states them, and must match: runs or fails, the error text the client received,
the key it sent and the class the server built. A host is a tiny ``http.server`` on loopback answering
``/status`` and ``/env`` as ndif does.
"""

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nnsight_repro import ROOT, envs, models, outcomes
from nnsight_repro.ndif import config, panel
from nnsight_repro.preflight import assess, checkpoint, server

RESULTS = ROOT / "results"
PANEL_RECORDS = ["ndif_0.7/panel.json", "ndif_0.7/panel+multimolecule-patched.json", "ndif_0.8/panel.json"]
#: Probe records whose server is a stock one (the "patched" pairing's server runs our series: no client of
#: preflight's meets it), by the client each pairs.
PROBE_CLIENTS = {"main": "main", "patched-client-only": "patched", "upstream-0.8": "upstream-0.8"}
#: AntiBERTy's real config names its own class ("AntiBERTy"), which no Auto class builds: a user wraps it as
#: the panel does, and says so.
WRAPPED_AS = {"antiberty": models.get("antiberty").automodel}

WRITE_CONFIGS = """
import shutil, sys
from pathlib import Path
from nnsight_repro import channel, models
out = Path(sys.argv[1])
for name, entry in models.extended().items():
    folder = out / name
    folder.mkdir(parents=True)
    if entry.pretrained is not None:
        shutil.copy(entry.pretrained() / "config.json", folder / "config.json")
        continue
    models.import_requirements(entry)
    config = entry.config_for()
    config.architectures = [entry.model_class]  # what save_pretrained() of the model writes
    config.save_pretrained(folder)
channel.send({"written": sorted(p.name for p in out.iterdir())})
"""


def probe_records() -> dict:
    """``{file name: record}``: every probe record whose server is a stock one (refusals name no pairing)."""
    found = {}
    for path in sorted((RESULTS / "ndif_feasibility").glob("*.json")):
        record = json.loads(path.read_text())
        if record.get("client_line") in PROBE_CLIENTS:
            found[path.name] = record
    return found


def probe_job(probe: dict) -> str:
    return f"{probe['model']['panel']}@{probe['select']['0.7']['automodel']}"


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Every panel model's config.json (no weights), each in a folder of its own."""
    out = tmp_path_factory.mktemp("panel-configs")
    envs.ensure("main").run_one(["-c", WRITE_CONFIGS, str(out)], doing="writing the panel's configs", timeout=600)
    return {name: out / name for name in models.extended()}


@pytest.fixture(scope="module")
def trees(configs, tmp_path_factory):
    """``{line: {job: tree}}``: every panel config as its architectures name it, every probe's model as the
    probe wraps it, two a user wraps wrong and two no environment here can build."""
    unknown = tmp_path_factory.mktemp("unknown-type")
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-type"}))
    remote = tmp_path_factory.mktemp("remote-code")
    (remote / "config.json").write_text(json.dumps({"model_type": "custom-lm",
                                                     "auto_map": {"AutoModel": "modeling_custom.CustomModel"}}))
    jobs = [{"id": name, "config_dir": str(folder), "automodel": WRAPPED_AS.get(name)}
            for name, folder in configs.items()]
    jobs += [{"id": "unknown-type", "config_dir": str(unknown), "automodel": None},
             {"id": "remote-code", "config_dir": str(remote), "automodel": None}]
    for record in probe_records().values():
        for probe in (r["declaration"] for r in record["probes"] if r["declaration"]["kind"] == "trace"):
            jobs.append({"id": probe_job(probe), "config_dir": str(configs[probe["model"]["panel"]]),
                         "automodel": probe["select"]["0.7"]["automodel"]})
    jobs.append({"id": "antiberty-as-named", "config_dir": str(configs["antiberty"]), "automodel": None})
    jobs.append({"id": "no-such-auto", "config_dir": str(configs["bert-mlm"]), "automodel": "AutoModelForNothing"})
    jobs = list({job["id"]: job for job in jobs}.values())
    return assess.inspect(jobs)


def per_line(trees, job: str) -> dict:
    return {line: found[job] for line, found in trees.items()}


def key_fields(model_key: str) -> dict:
    """A recorded key's fields without its repo_id (the stand-in's cache path, not ours)."""
    fields = json.loads(model_key.partition(":")[2])
    fields.pop("repo_id")
    return fields


def mismatches(predicted: dict, ok: bool, reason: str, key=None, built=None) -> list:
    """How a prediction differs from one observed cell: outcome, the error text, the key, the built class."""
    wrong = []
    if (predicted["verdict"] == "runs") != ok:
        wrong.append(f"predicted {predicted['verdict']}, observed {'ok' if ok else 'a failure'}: {reason[-200:]!r}")
    first = (predicted["failures"] or [{}])[0]
    if not ok and first.get("message") and first["message"] not in reason:
        wrong.append(f"predicted the error {first['message']!r}, observed {reason[-200:]!r}")
    if key is not None:
        mine = {k: v for k, v in predicted["key"]["fields"].items() if k != "repo_id"}
        if mine != key_fields(key):
            wrong.append(f"predicted the key {mine}, observed {key_fields(key)}")
    if built is not None and predicted["server_builds"]["class"] != built:
        wrong.append(f"predicted the server builds {predicted['server_builds']['class']}, observed {built}")
    return wrong


# Cell for cell against the live runs ---------------------------------------------------------------------

@pytest.mark.parametrize("record", PANEL_RECORDS)
def test_verdicts_equal_every_cell_of_the_live_panel(trees, configs, record):
    report = json.loads((RESULTS / record).read_text())
    served = report["provenance"]["server"]
    on = panel.server_facts(served["line"], served["flavour"][0])  # "flavour": the extras, old word kept in records
    wrong = {}
    for row in report["rows"]:
        predicted = assess.verdict(row["client"], str(configs[row["model"]]), per_line(trees, row["model"]), on)
        found = mismatches(predicted, row["ok"], row.get("reason") or "", row.get("key"), row.get("built_class"))
        if found:
            wrong[f"{row['model']} {row['client']} {row['trace']}"] = found
    assert len(report["rows"]) == 30 * (2 if served["line"] == "0.7" else 1)
    assert wrong == {}


def test_verdicts_equal_every_stock_server_cell_of_the_negative_control(trees, configs):
    report = json.loads((RESULTS / "ndif_0.7" / "negative_control.json").read_text())
    plain = outcomes.ServerFacts(line="0.7", dtype=config.generation("0.7").dtype, packages=frozenset())
    wrong, seen = {}, 0
    for row in (r for r in report["summary"] if r["server"] == "stock"):
        name = row["case"].split(":")[1]
        predicted = assess.verdict(row["client"], str(configs[name]), per_line(trees, name), plain)
        found = mismatches(predicted, row["outcome"].startswith("OK"), row["outcome"], built=row["server_built"])
        seen += 1
        if found:
            wrong[f"{name} {row['client']} {row['case']}"] = found
    assert seen == 12
    assert wrong == {}


@pytest.mark.parametrize("name", sorted(probe_records()))
def test_verdicts_equal_every_trace_probe_of_each_probe_record(trees, configs, name):
    record = probe_records()[name]
    line = record["provenance"]["server"]["local"]["line"]
    client = PROBE_CLIENTS[record["client_line"]]
    # Without --with (every committed record): a plain local stack, no multimolecule (its 0.8 /env says so).
    # "client_line" and "server_flavours": the pairing and the extras, under the old words the records keep.
    extras = record.get("server_flavours") or []
    on = (panel.server_facts(line, extras[0]) if extras else
          outcomes.ServerFacts(line=line, dtype=config.generation(line).dtype, packages=frozenset()))
    wrong, seen = {}, 0
    for result in (r for r in record["probes"] if r["declaration"]["kind"] == "trace"):
        probe, observed = result["declaration"], result["observed"]
        predicted = assess.verdict(client, str(configs[probe["model"]["panel"]]), per_line(trees, probe_job(probe)),
                                   on)
        reason = f"{observed.get('error', '')}: {observed.get('message', '')}"
        found = mismatches(predicted, observed["status"] == "ok", reason, (observed.get("detail") or {}).get("key"))
        first = predicted["failures"][0] if predicted["failures"] else {}
        # ndif 0.0.1 names the model_type transformers does not know; the 0.8 probe, the package /env lacks.
        if first.get("bug") == "package" and not any(word in reason.lower() for word in
                                                    ("multimolecule", f"model type `{probe['model']['panel']}`")):
            found.append(f"predicted that the server lacks multimolecule, observed {reason[-200:]!r}")
        if client == "upstream-0.8" and predicted["key"]["fields"]["task"] != probe["select"]["0.8"]["task"]:
            found.append(f"predicted task {predicted['key']['fields']['task']}, "
                         f"the probe sent {probe['select']['0.8']}")
        seen += 1
        if found:
            wrong[probe["id"]] = found
    assert seen, f"{name} has no trace probe"
    assert wrong == {}


# The tree's facts are the panel's declared ones ----------------------------------------------------------

@pytest.mark.parametrize("line", ["0.7", "0.8"])
def test_the_tree_wraps_each_panel_config_as_the_panel_does(trees, line):
    found = {name: (trees[line][name]["wrapped"]["class"], trees[line][name]["wrapped"]["automodel"],
                    trees[line][name]["task"]) for name in models.extended()}
    assert found == {name: (e.model_class, e.automodel, e.task) for name, e in models.extended().items()}


@pytest.mark.parametrize("line", ["0.7", "0.8"])
def test_the_tree_finds_an_output_submodule_exactly_where_the_panel_declares_one(trees, line):
    found = {name: [c["name"] for c in trees[line][name]["collisions"] if c["kind"] == "served"]
             for name in models.extended()}
    assert found == {name: ["output"] if e.has_output_child else [] for name, e in models.extended().items()}


def test_the_tree_finds_a_causal_lm_for_exactly_the_encoder_families_the_panel_declares(trees):
    # Only a model wrapped as something else is rebuilt as a causal LM by the stock key: the encoders.
    encoders = {name: e for name, e in models.extended().items() if e.encoder}
    found = {name: trees["0.7"][name]["causal_lm"]["class"] is not None for name in encoders}
    assert found == {name: e.model_class.startswith(panel.CAUSAL_LM_FAMILIES) for name, e in encoders.items()}


def test_the_tree_names_the_package_and_the_bfloat16_hazard_the_panel_declares(trees):
    found = {name: ((trees["0.7"][name]["package"] or {}).get("name"),
                    (trees["0.7"][name]["bfloat16"] or {}).get("message")) for name in models.extended()}
    assert found == {name: (e.requires[0] if e.requires else None, e.fails_in_bfloat16)
                     for name, e in models.extended().items()}


def test_spelling_is_nns_output_on_07_and_E_output_on_08(trees):
    on = {line: outcomes.ServerFacts(line=line, dtype="float32") for line in ("0.7", "0.8")}
    spelled = {client: assess.verdict(client, "x", per_line(trees, "esm-mlm"), on[envs.SPECS[client].line])["spelling"]
               for client in assess.CLIENTS}
    assert spelled == {"main": {"output": {"nnsight": "nns_output", "submodule": "output"}},
                       "patched": {"output": {"nnsight": "nns_output", "submodule": "output"}},
                       "upstream-0.8": {"output": {"nnsight": "output", "submodule": "E_output"}}}


def test_a_config_naming_a_class_no_auto_class_builds_asks_for_automodel(trees):
    assert trees["0.7"]["antiberty-as-named"] == {
        "error": "no_class", "message": "config.architectures names AntiBERTy, which no Auto class builds for "
                                        "model_type 'bert': pass --automodel"}


def test_an_automodel_transformers_lacks_is_named(trees):
    assert trees["0.8"]["no-such-auto"]["message"] == \
        "--automodel AutoModelForNothing: transformers has no such Auto class"


def test_an_unknown_model_type_gets_an_unknown_verdict_naming_it(trees):
    found = assess.verdict("upstream-0.8", "x", per_line(trees, "unknown-type"), outcomes.ServerFacts("0.8", "float32"))
    assert (found["verdict"], found["failures"][0]["bug"]) == ("unknown", "unknown_model_type")
    assert "model_type 'no-such-type' is not known to transformers 5.22.2" in found["failures"][0]["message"]


def test_a_model_type_only_its_own_code_defines_is_not_run_and_says_so(trees):
    found = assess.verdict("patched", "x", per_line(trees, "remote-code"), outcomes.ServerFacts("0.7", "float32"))
    assert (found["verdict"], found["failures"][0]["bug"]) == ("unknown", "remote_code")
    assert "trust_remote_code" in found["failures"][0]["change"]


def test_the_command_refuses_a_config_whose_class_it_cannot_tell_as_bad_input(trees, configs, monkeypatch):
    monkeypatch.setattr(assess, "inspect", lambda jobs: {
        line: {"model": found["antiberty-as-named"], "_environment": found["_environment"]}
        for line, found in trees.items()})
    from nnsight_repro.preflight import cli as preflight_cli

    with pytest.raises(checkpoint.InputError, match="names AntiBERTy, which no Auto class builds .*: pass --automodel"):
        preflight_cli.run(str(configs["antiberty"]))


# Against a host --------------------------------------------------------------------------------------------

class FakeNdif(http.server.BaseHTTPRequestHandler):
    """Answers each path from ``routes``: ``{path: (status, body)}``; 404 for the rest."""

    routes: dict = {}

    def do_GET(self):
        status, body = self.routes.get(self.path, (404, '{"detail": "Not Found"}'))
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def host():
    """``host(routes) -> url``: a loopback server answering as ``routes`` say."""
    servers = []

    def start(routes: dict) -> str:
        handler = type("Routes", (FakeNdif,), {"routes": routes})
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}"

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def env_of(**packages) -> dict:
    return {"python_version": "3.11.7 (main)",
            "packages": {"torch": "2.13.0+cpu", "transformers": "5.22.2", **packages}}


def deployment(model_key: str) -> dict:
    return {"deployments": {f"ModelActor:{model_key}": {"model_key": model_key, "deployment_level": "HOT",
                                                      "application_state": "RUNNING"}}}


def test_an_08_host_without_multimolecule_fails_rnafm_for_each_clients_own_reason(trees, configs, host):
    url = host({"/status": (200, {"deployments": {}}), "/env": (200, env_of(nnsight="0.8.1"))})
    report = assess.report(checkpoint.resolve(str(configs["rnafm"])), per_line(trees, "rnafm"), server.read(url),
                           "float32")
    assert {c["client"]: [f["bug"] for f in c["failures"]] for c in report["clients"]} == {
        "main": ["line"], "patched": ["line"], "upstream-0.8": ["package"]}


def test_an_08_host_with_multimolecule_runs_rnafm_on_08_only(trees, configs, host):
    url = host({"/status": (200, {"deployments": {}}), "/env": (200, env_of(nnsight="0.8.1", multimolecule="0.2.2"))})
    report = assess.report(checkpoint.resolve(str(configs["rnafm"])), per_line(trees, "rnafm"), server.read(url),
                           "float32")
    assert {c["client"]: c["verdict"] for c in report["clients"]} == {
        "main": "fails", "patched": "fails", "upstream-0.8": "runs"}


def test_a_host_without_env_is_the_07_line_with_its_packages_unknown(host):
    url = host({"/status": (200, {"deployments": {}})})
    read = server.read(url)
    assert (read["line"], read["nnsight"], read["packages"]) == ("0.7", None, None)


def test_a_07_host_without_env_runs_the_fixed_client_and_says_the_package_is_assumed(trees, configs, host):
    url = host({"/status": (200, {"deployments": {}})})
    report = assess.report(checkpoint.resolve(str(configs["rnafm"])), per_line(trees, "rnafm"), server.read(url),
                           "float32")
    assert [c["verdict"] for c in report["clients"]] == ["fails", "runs", "fails"]
    assert any("multimolecule is assumed installed" in note for note in report["notes"])


def test_the_08_key_deployed_on_the_host_is_found_and_no_other(trees, configs, host):
    folder = str(configs["bert-mlm"])
    model_key = ("nnsight.modeling.transformers.TransformersModel:"
                 + json.dumps({"repo_id": folder, "revision": None, "task": "fill-mask"}))
    url = host({"/status": (200, deployment(model_key)), "/env": (200, env_of(nnsight="0.8.1"))})
    report = assess.report(checkpoint.resolve(folder), per_line(trees, "bert-mlm"), server.read(url), "float32")
    assert {c["client"]: c["deployed"] for c in report["clients"]} == {
        "main": None, "patched": None, "upstream-0.8": {"level": "HOT", "state": "RUNNING"}}


def test_a_07_deployment_stored_with_revision_main_matches_the_stock_key(trees, configs, host):
    folder = str(configs["gpt2"])
    model_key = "nnsight.modeling.language.LanguageModel:" + json.dumps({"repo_id": folder, "revision": "main"})
    url = host({"/status": (200, deployment(model_key))})
    report = assess.report(checkpoint.resolve(folder), per_line(trees, "gpt2"), server.read(url), "bfloat16")
    assert [c["deployed"] is not None for c in report["clients"]] == [True, True, False]


def test_a_bfloat16_host_fails_ernierna_on_every_client_that_reaches_the_model(trees, configs):
    bf16 = {line: outcomes.ServerFacts(line=line, dtype="bfloat16") for line in ("0.7", "0.8")}
    bugs = {client: [f["bug"] for f in assess.verdict(client, "x", per_line(trees, "ernierna"),
                                                      bf16[envs.SPECS[client].line])["failures"]]
            for client in assess.CLIENTS}
    assert bugs == {"main": ["key", "envoy", "bfloat16"], "patched": ["bfloat16"], "upstream-0.8": ["bfloat16"]}


# The command ---------------------------------------------------------------------------------------------

def preflight(*args, env=None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "NDIF_HOST"}
    return subprocess.run([sys.executable, "-m", "nnsight_repro", "preflight", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env={**environ, **(env or {})})


def bert_config(folder: Path) -> Path:
    """A BERT checkpoint's config.json, as save_pretrained() of a small BertForMaskedLM writes its essentials."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 100}))
    return folder


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unseen_bert_checkpoint_gets_a_verdict_per_client_offline(tmp_path):
    result = preflight(str(bert_config(tmp_path / "ckpt")), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {c["client"]: (c["verdict"], [f["bug"] for f in c["failures"]]) for c in report["clients"]} == {
        "main": ("fails", ["envoy"]), "patched": ("runs", []), "upstream-0.8": ("runs", [])}


def test_a_hub_id_not_in_the_cache_is_refused_in_one_line_with_exit_2(tmp_path):
    result = preflight("someone/never-cached-model", env={"HF_HUB_CACHE": str(tmp_path)})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "'someone/never-cached-model'" in result.stderr and "config.json" in result.stderr


def test_a_cached_hub_id_is_read_from_its_snapshot(tmp_path, monkeypatch):
    repo = tmp_path / "models--org--tiny-bert"
    snapshot = bert_config(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    found = checkpoint.resolve("org/tiny-bert")
    assert (found.folder, found.repo_id, found.model_type) == (snapshot, "org/tiny-bert", "bert")


def test_a_config_without_model_type_is_named_with_exit_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    result = preflight(str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "has no model_type" in result.stderr and str(tmp_path / "config.json") in result.stderr


def test_a_host_that_does_not_answer_is_named_with_its_url_and_exit_1(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    result = preflight(str(bert_config(tmp_path)), "--host", url)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"host {url} does not answer" in result.stderr


def test_ndif_host_is_the_host_asked_when_no_host_flag_is_given(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    result = preflight(str(bert_config(tmp_path)), env={"NDIF_HOST": url})
    assert result.returncode == 1 and f"host {url} does not answer" in result.stderr


def test_a_host_that_is_not_ndif_is_named_with_its_url_and_exit_1(tmp_path, host):
    url = host({"/status": (200, "<html>a web page</html>")})
    result = preflight(str(bert_config(tmp_path)), "--host", url)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"host {url} is not an NDIF API" in result.stderr
