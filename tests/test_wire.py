"""The 0.7 line's wire: every client x server pairing, as an NDIF model actor receives a request.

A client process of one environment writes the exact bytes its remote backend would send, with its own
local trace's values; a server process of the other environment wraps the same model first, then
deserializes each request against that wrapper's persistent objects and executes it
(``nnsight_repro.wire``). The public NDIF runs stock nnsight 0.7.0, the ``main`` environment here, so
"patched client, released server" is the pairing that decides whether the series helps anyone today.
"""

import pytest

from nnsight_repro import envs, wire
from nnsight_repro.ndif import panel

CLIENTS = SERVERS = ("main", "patched")
MODELS = ("gpt2", "bert-mlm", "esm-mlm")
ENCODERS = ("bert-mlm", "esm-mlm")
#: What a released 0.7.0 server answers a released client's encoder request with.
HOOKED_OUTPUT = "name 'hooked_output' is not defined"


@pytest.fixture(scope="module")
def wire_run(tmp_path_factory):
    """Both clients' requests, and every server's records for them: {(server, client, model, trace): record}."""
    base = tmp_path_factory.mktemp("wire")
    folders = {name: base / name for name in CLIENTS}
    args = ["-m", "nnsight_repro.wire", "--models", ",".join(MODELS)]
    # Two cores: both clients at once, then both servers at once.
    clients = [envs.ensure(name).start([*args[:2], "client", *args[2:], str(folders[name])],
                                       doing="writing wire requests") for name in CLIENTS]
    for folder in folders.values():
        folder.mkdir()
    for stream in clients:
        with stream:
            stream.records(timeout=600)
    servers = {name: envs.ensure(name).start([*args[:2], "server", *args[2:], *map(str, folders.values())],
                                             doing="serving wire requests as a model actor") for name in SERVERS}
    records = {}
    for server, stream in servers.items():
        with stream:
            (found,) = stream.records(timeout=900)
        for record in found["records"]:
            records[server, record["client"], record["model"], record["trace"]] = record
    return folders, records


#: The BERT family, which a released client's key has a stock server rebuild as BertLMHeadModel.
KEYED = ("bert-mlm", "bert-base")


@pytest.fixture(scope="module")
def keyed_run(tmp_path_factory):
    """The released client's BERT read requests, served as the public NDIF serves them: by a released
    server that builds each model from the client's key. {model: record}."""
    folder = tmp_path_factory.mktemp("keyed") / "main"
    folder.mkdir()
    env = envs.ensure("main")
    args = ["-m", "nnsight_repro.wire", "--models", ",".join(KEYED), "--traces", "read"]
    env.run_one([*args[:2], "client", *args[2:], str(folder)], doing="writing wire requests", timeout=600)
    found = env.run_one([*args[:2], "server", "--from-key", *args[2:], str(folder)],
                        doing="serving wire requests as a model actor built from the key", timeout=900)
    return {record["model"]: record for record in found["records"]}


@pytest.mark.parametrize("model", KEYED)
def test_released_client_bert_request_fails_on_a_server_built_from_its_key_where_the_panel_predicts(
        keyed_run, model):
    """A masked LM's request loads into BertLMHeadModel as far as the envoy bug; a base model's names a
    module at a path BertLMHeadModel does not have (``panel.predicted``, the live negative control's)."""
    record = keyed_run[model]
    expected = panel.predicted(model, "main", "0.7")
    assert record["built_class"] == "BertLMHeadModel", record
    assert not record["ok"] and expected["message"] in record["message"], (expected, record)


@pytest.mark.parametrize("trace", wire.TRACES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("server", SERVERS)
def test_patched_client_runs_on_every_server(wire_run, server, model, trace):
    """The released server ("main") is the one that matters: the public NDIF runs it."""
    record = wire_run[1][server, "patched", model, trace]
    assert record["ok"] and record["max_abs_diff"] == 0.0, record


@pytest.mark.parametrize("server", SERVERS)
def test_loading_a_patched_request_again_and_again_leaves_live_envoy_classes_constant(wire_run, server):
    """A model actor serves many requests: by-value classes must not pile up (10,000: the benchmark)."""
    record = wire_run[1][(server, "patched", *wire.RELOADED)]
    before, after = record["live_envoy_classes"]
    assert record["reloads"] == wire.RELOADS and after == before, record


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("model", ENCODERS)
def test_released_client_encoder_request_fails_on_every_server(wire_run, server, model):
    """The negative control, and no server-side rescue: the stock request itself cannot be rebuilt."""
    for trace in wire.TRACES:
        record = wire_run[1][server, "main", model, trace]
        assert not record["ok"] and record["error"] == "NameError", record
        assert HOOKED_OUTPUT in record["message"], record


@pytest.mark.parametrize("server", SERVERS)
def test_released_client_decoder_request_runs_on_every_server(wire_run, server):
    for trace in wire.TRACES:
        record = wire_run[1][server, "main", "gpt2", trace]
        assert record["ok"] and record["max_abs_diff"] == 0.0, record


@pytest.mark.parametrize("model", MODELS)
def test_write_changes_the_logits(wire_run, model):
    """Otherwise "the write's logits equal the local trace's" would hold for a write that did nothing."""
    import torch

    folder = wire_run[0]["patched"]
    read, write = (torch.load(folder / f"{model}.{trace}.local")["output"] for trace in ("read", "write"))
    assert not torch.equal(read, write)


@pytest.mark.parametrize("model", ENCODERS)
def test_patched_request_names_nothing_a_released_request_does_not(wire_run, model):
    """Nothing new reachable from unpickling: the class still goes by value, and its builtin properties
    are what the released class already carried beside its eproperty."""
    folders = wire_run[0]
    named = {client: wire.named_globals((folders[client] / f"{model}.read.request").read_bytes())
             for client in CLIENTS}
    assert {("builtins", "property"), ("nnsight.intervention.envoy", "Envoy")} <= named["patched"]
    assert named["patched"] <= named["main"], named["patched"] - named["main"]


def test_decoder_request_names_the_same_globals_from_either_client(wire_run):
    folders = wire_run[0]
    named = [wire.named_globals((folders[client] / "gpt2.read.request").read_bytes()) for client in CLIENTS]
    assert named[0] == named[1]
