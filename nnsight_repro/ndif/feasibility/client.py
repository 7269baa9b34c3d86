"""The client half of the probe runner (:mod:`.runner`): runs validated probes with this interpreter's nnsight.

Started by the runner in a pairing's client environment (inside the stack's namespace for the local NDIF),
with ``NDIF_HOST`` / ``NDIF_API_KEY`` set the way nnsight reads them. It reads the probes (already
validated by :mod:`.declarations`) as JSON on stdin and sends one record per event through the result channel
(:mod:`nnsight_repro.channel`; nnsight's own status display keeps stdout and stderr):

    {"event": "start", "probe": id}
    {"event": "status", "probe": id, "status": "RECEIVED" | "QUEUED" | "RUNNING" | "COMPLETED" | ...}
    {"event": "done", "probe": id, "observed": {...}}
    {"event": "context", "client": {...}, "server_env": null}        (before the first probe)
    {"event": "context", "client": {...}, "server_env": {...}}        (after the last)

It knows the three probe kinds (``status``, ``trace``, ``env``), never a single probe. What differs
between nnsight lines (wrapper, key field, hub-id cache) comes from :mod:`nnsight_repro.lines`.
Deliberately does not compare observations with expectations: that is the runner's job.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback
import warnings

from nnsight_repro import channel, lines, models, settings
from nnsight_repro.ndif import socket_race

LINE = lines.current()
_current_probe = None


def emit(**event) -> None:
    # Through JSON with default=str first: an observation may hold a value JSON cannot name (a dtype).
    channel.send(json.loads(json.dumps(event, default=str)))


def watch_statuses() -> None:
    """Report every status update the server sends, as it arrives (each passes the line's status callback)."""
    from nnsight.intervention.backends.remote import RemoteBackend

    original = getattr(RemoteBackend, LINE.status_callback)

    def watched(backend, response, *args, **kwargs):
        status = getattr(response.status, "value", response.status)
        emit(event="status", probe=_current_probe, status=str(status))
        return original(backend, response, *args, **kwargs)

    setattr(RemoteBackend, LINE.status_callback, watched)


class ProbeFailure(Exception):
    """A failure the probe itself detects (not an exception nnsight raised); its class name is recorded."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def server_env() -> dict:
    from nnsight import ndif

    return ndif.get_remote_env()


def client_packages(names) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def run_status(probe: dict) -> dict:
    from nnsight import ndif

    raw = ndif.status(raw=True)
    deployments = raw.get("deployments", {}) if isinstance(raw, dict) else {}
    # An empty catalogue is an answer too: ndif 0.0.1 deploys any model it is sent on its first request.
    catalogue = sorted({entry.get("model_key") or name for name, entry in deployments.items()})
    return {"catalogue": catalogue, "note": f"{len(catalogue)} deployment(s)",
            "levels": {entry.get("model_key") or name: entry.get("deployment_level")
                       for name, entry in deployments.items()}}


def run_env(probe: dict) -> dict:
    remote = server_env()
    wanted = probe["packages"]
    local = client_packages(wanted)
    server = {name: remote.get("packages", {}).get(name) for name in wanted}
    mismatches = {name: {"client": local[name], "server": server[name]}
                  for name in wanted if local[name] != server[name]}
    detail = {"client": local, "server": server, "mismatches": mismatches,
              "client_python": sys.version.split()[0],
              "server_python": str(remote.get("python_version", "")).split()[0]}
    listed = ", ".join(f"{n} client {v['client']} / server {v['server']}" for n, v in mismatches.items())
    # Like nnsight.ndif.compare: a drift in a critical package changes what a remote trace computes; any
    # other drift is listed, not failed on.
    critical = [n for n in mismatches if n in probe.get("critical", wanted)]
    if critical:
        raise ProbeFailure("EnvMismatch", f"client and server differ in {', '.join(critical)}: {listed}")
    if listed:
        detail["note"] = f"differs (not critical): {listed}"
    return detail


def wrapped(probe: dict):
    """The probe's model wrapped the way a user of this line would, and the key it will send."""
    from transformers import AutoTokenizer

    spec = probe["model"]
    entry = models.get(spec["panel"])
    # The probe, not the panel, decides the class: probe 3 sends a BERT down the CausalLM path.
    entry = dataclasses.replace(entry, **probe["select"][LINE.name])
    path = models.saved_model(spec["panel"])
    # The key names the local saved model (the local server loads it from disk), or the hub repo the
    # probe stands in for (what a public host serves). Minting offline goes through the one place.
    LINE.seed_hub_ids({str(path): str(path) if spec.get("key", "local") == "local" else spec["repo_id"]})
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LINE.wrap(path, entry, tokenizer)
    return model


def packages_the_server_lacks(probe: dict):
    """Required packages the server's /env does not list; None when the server has no /env to ask
    (ndif 0.0.1), and then the trace itself is the answer."""
    if not probe.get("requires"):
        return []
    try:
        listed = server_env().get("packages", {})
    except Exception:
        return None
    return [p for p in probe["requires"] if p not in listed]


def run_trace(probe: dict) -> dict:
    missing = packages_the_server_lacks(probe)
    if missing:
        raise ProbeFailure("MissingServerPackage",
                           f"the server's /env has no {', '.join(missing)}; the model cannot be built there")
    model = wrapped(probe)
    key = model.to_model_key()
    # Whether the server had this key deployed before the request: a trace of a key it did not have
    # shows that a model absent from the catalogue is provisioned on request.
    try:
        deployed_before = key in run_status(probe)["catalogue"]
    except Exception:
        deployed_before = None
    hook = probe["hook"][LINE.name]
    text = probe["input"]
    def remote_trace():
        # `saved` must be a plain local of the block: a remote trace hands saves back by assigning locals.
        with model.trace(text, remote=True):
            saved = eval(hook, {"model": model}).save()
        return saved

    retries = []
    saved = socket_race.call(remote_trace, retries)
    while isinstance(saved, (tuple, list)):
        saved = saved[0]
    saved = getattr(saved, "last_hidden_state", saved)
    detail = {"key": key, "hook": hook, "shape": list(getattr(saved, "shape", [])), "deployed_before": deployed_before}
    if deployed_before is False:
        detail["note"] = "not deployed before the request: provisioned on request"
    if retries:
        detail["socket_race_retries"] = retries
    return detail


KINDS = {"status": run_status, "env": run_env, "trace": run_trace}


def observe(probe: dict) -> dict:
    global _current_probe
    _current_probe = probe["id"]
    started = time.perf_counter()
    try:
        detail = KINDS[probe["kind"]](probe)
        observed = {"status": "ok", "detail": detail}
    except ProbeFailure as exc:
        observed = {"status": "error", "error": exc.kind, "message": str(exc)}
    except Exception as exc:  # whatever the server or nnsight raised is the observation
        message = str(exc)
        observed = {"status": "error", "error": type(exc).__name__,
                    "error_module": type(exc).__module__,
                    # Head and tail of a long message: the head says what failed, the tail where.
                    "message": message if len(message) <= 6000 else message[:3000] + "\n…\n" + message[-3000:],
                    # A RemoteError's message is the server's description, traceback included.
                    "server_traceback_tail": "\n".join(message.strip().splitlines()[-12:]),
                    "client_traceback_tail": "".join(traceback.format_exc().splitlines(True)[-8:])}
    observed["seconds"] = round(time.perf_counter() - started, 3)
    return observed


def main() -> int:
    import torch

    torch.set_num_threads(1)
    probes = json.load(sys.stdin)
    # Before nnsight (as the check routine does): 0.7.0 mounts ``save`` on every object, and the typed
    # hub classes multimolecule's imports define then refuse to be created.
    for probe in probes:
        if "model" in probe:
            models.import_requirements(models.get(probe["model"]["panel"]))
    watch_statuses()
    client = {"line": LINE.name, "env": settings.setting("ENV"), "python": sys.version.split()[0],
              **client_packages(["nnsight", "transformers", "torch", "multimolecule"])}
    # The client half first, so a client killed mid-probe still leaves its versions; the server's /env only
    # after the probes, which must each meet the server as a user's first request would.
    emit(event="context", client=client, server_env=None)
    for probe in probes:
        emit(event="start", probe=probe["id"])
        emit(event="done", probe=probe["id"], observed=observe(probe))
    try:
        env = server_env()
        remote = {"python": str(env.get("python_version", "")).split()[0],
                  "packages": {n: env.get("packages", {}).get(n)
                               for n in ("nnsight", "transformers", "torch", "multimolecule")}}
    except Exception as exc:
        remote = {"error": f"{type(exc).__name__}: {exc}"}
    emit(event="context", client=client, server_env=remote)
    return 0


if __name__ == "__main__":
    sys.exit(main())
