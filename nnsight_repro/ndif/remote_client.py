"""What a user of a local NDIF stack runs: ``remote=True`` traces of the panel models.

Runs inside a client environment (``python -m nnsight_repro.ndif.remote_client``): ``upstream-0.8``
against the 0.8 stack, ``main`` or ``patched`` (nnsight 0.7.0) against the 0.7 stack; the nnsight line
it speaks is the interpreter's (:func:`nnsight_repro.lines.current`). It sends its result through
:mod:`nnsight_repro.channel`. ``mint`` needs no server and runs on the host; ``run`` must run inside the stack's
network namespace, with ``NDIF_HOST`` pointing at the API (nnsight reads it at import).

- ``mint --models a,b``: saves each panel model and sends ``{name: {path, task, key}}``, where ``key``
  is exactly the model key this client sends (the server must be deployed under that key).
- ``run --cases c1,c2``: sends ``{"cases": {case: record}}``, each record ``{"ok": ..., ...}`` or a
  failure record; a case that raises never stops the others. A record lists, under
  ``socket_race_retries``, every remote call sent again after the client-side socket race
  (:mod:`.socket_race`); nothing else is ever retried. A ``first:`` case sends ``{"ready": case}``
  before it (see ``stack_clients.start_client``).

Cases:

- ``trace:<model>[:<atol>]``: the check routine's subject (:class:`nnsight_repro.checks.Subject`: the
  panel model wrapped the way a user would, saving the first encoder layer's and the final hidden
  states' output) traced with ``remote=True`` and locally; ``ok`` when every value is within ``atol``
  of the local one (default 0: bit-identical). The record names the remote values' dtype.
- ``write:<model>[:<atol>]``: the first layer's output written (its first token zeroed), the model's
  output read (its logits; a base model's final hidden state), against the same write run locally; the
  record says whether the write changed that output locally (``write_changes_local_output``).
- ``error``: a trace whose body fails on the server; records the exception the client receives next to
  the one the same body raises locally.
- ``large:<bytes>``: a result bigger than ``<bytes>`` (the server's inline cap); records which way it came
  back (inline on the response, or by URL from the object store) and whether it equals the local one.
- ``first:<model>``: started while the stack is still coming up: waits until ``/status`` shows the model
  HOT (0.7 stack: until it lists a node; a model still loading is waited for by the server), then traces it
  remotely (for the cold start).
- ``timing:<model>:<n>``: ``n`` warm remote traces and ``n`` local ones (for the benchmark).

The model keys are minted the way :mod:`nnsight_repro.lines` says (the one place offline key minting is
handled), with each saved model's path as its own canonical repo id: the server loads that path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

from .. import channel, checks, lines
from . import config, socket_race

LINE = lines.current()


def subject(name: str) -> checks.Subject:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = checks.Subject(name)
    # The key is minted lazily from this cache: the server knows the model by its local path.
    LINE.seed_hub_ids({str(s.path): str(s.path)})
    return s


def mint(names) -> dict:
    out = {}
    for name in names:
        s = subject(name)
        out[name] = {"path": str(s.path), "task": s.entry.task, "key": s.model.to_model_key()}
    return out


class Transport:
    """Which way the last result came back: observed on the client, where nnsight receives it."""

    def __init__(self):
        from nnsight.intervention.backends.remote import RemoteBackend

        self.seen = []
        seen = self.seen
        if not hasattr(RemoteBackend, "download_result"):
            # 0.7.0 has no inline results: every result is fetched by URL through get_result.
            original_get = RemoteBackend.get_result

            def get_result(backend, url, *args, **kwargs):
                seen.append({"route": "object-store", "url_host": url.split("/")[2]})
                return original_get(backend, url, *args, **kwargs)

            RemoteBackend.get_result = get_result
            return
        original = RemoteBackend.download_result

        def download_result(backend, url):
            if isinstance(url, (bytes, bytearray)):
                seen.append({"route": "inline", "bytes": len(url)})
            elif url:
                seen.append({"route": "object-store", "url_host": url.split("/")[2]})
            return original(backend, url)

        RemoteBackend.download_result = download_result


def saves(s: checks.Subject, remote=None) -> dict:
    """The subject's read points saved in one trace (first layer, then final hidden states).

    Not :meth:`Subject.trace`: a remote trace hands saved values back by assigning the caller's local
    variables, so the saves must be plain locals, not entries of a dict built inside the block.
    """
    (first_label, first_envoy, first_attr), (final_label, final_envoy, final_attr) = s.read_points()
    with s.model.trace(s.ids[0], **s.inputs(s.ids[0], remote)):
        first = getattr(first_envoy, first_attr).save()
        final = getattr(final_envoy, final_attr).save()
    return {first_label: checks.hidden_states(first), final_label: checks.hidden_states(final)}


#: The key each traced model was requested under, also for a trace that failed (the server built it).
KEYS = {}

#: The socket-race retries of the case being run (:mod:`.socket_race`); ``run`` moves them into its record.
RETRIES = []


def remotely(fn):
    """``fn()``, a remote trace, sent again only after the client-side socket race."""
    return socket_race.call(fn, RETRIES)


def case_trace(name: str, atol: float = 0.0) -> dict:
    s = subject(name)
    KEYS[name] = s.model.to_model_key()
    local = saves(s)
    started = time.perf_counter()
    remote = remotely(lambda: saves(s, remote=True))
    record = {"seconds": round(time.perf_counter() - started, 3), "key": s.model.to_model_key(),
              "read_points": [f"{label}: {s.line.output_attr(envoy)}" for label, envoy, _ in s.read_points()],
              "atol": atol}
    for label in local:
        same_shape = remote[label].shape == local[label].shape
        record[label] = {"shape": list(remote[label].shape), "dtype": str(remote[label].dtype),
                         "equals_local": bool(same_shape and (remote[label] == local[label]).all()),
                         "max_abs_diff": float((remote[label].float() - local[label]).abs().max())
                         if same_shape else None,
                         "max_abs_local": float(local[label].abs().max())}
    record["ok"] = all(record[label]["max_abs_diff"] is not None and record[label]["max_abs_diff"] <= atol
                       for label in local)
    return record


def case_write(name: str, atol: float = 0.0, remote=True) -> dict:
    """A write on the server: the model's output after it (its logits; a base model's final hidden state,
    ``PanelModel.output_field``) against the same write run locally, and proof that it wrote.
    ``remote="local"`` runs the server's half through nnsight's own simulation (the offline test)."""
    from .. import wire

    s = subject(name)
    field = s.entry.output_field
    KEYS[name] = s.model.to_model_key()
    local, unwritten = wire.traced(s, "write")["output"], wire.traced(s, "read")["output"]
    started = time.perf_counter()
    remote = remotely(lambda: wire.traced(s, "write", remote=remote))["output"]
    same_shape = remote.shape == local.shape
    diff = float((remote.float() - local).abs().max()) if same_shape else None
    return {"seconds": round(time.perf_counter() - started, 3), "key": s.model.to_model_key(), "atol": atol,
            field: {"shape": list(remote.shape), "dtype": str(remote.dtype), "max_abs_diff": diff,
                    "max_abs_local": float(local.abs().max())},
            "write_changes_local_output": not bool((local == unwritten).all()),
            "ok": diff is not None and diff <= atol}


def _failing_body(s: checks.Subject, remote):
    """Index a 3-d hidden state with four indices: fails inside the block, wherever it runs."""
    kwargs = {} if remote is None else {"remote": remote}
    first = s.envoy(s.entry.first_layer)
    with s.model.trace(s.ids[0], **kwargs):
        hidden = first.output[0]
        value = hidden[0, 0, 0, 0].save()
    return value


def case_error() -> dict:
    s = subject("gpt2")
    record = {}
    for where, remote in (("local", None), ("remote", True)):
        try:
            if remote:
                remotely(lambda: _failing_body(s, remote))
            else:
                _failing_body(s, remote)
            record[where] = {"raised": False}
        except Exception as exc:  # what the user gets is the point
            record[where] = {"raised": True, "type": f"{type(exc).__module__}.{type(exc).__name__}",
                             "message": str(exc)}
    record["ok"] = record["local"]["raised"] and record["remote"]["raised"]
    return record


def _large_body(s: checks.Subject, numbers: int, remote):
    """The first layer's output plus seeded noise, ``numbers`` floats: incompressible, deterministic."""
    import torch

    kwargs = {} if remote is None else {"remote": remote}
    first = s.envoy(s.entry.first_layer)
    with s.model.trace(s.ids[0], **kwargs):
        hidden = first.output[0]
        generator = torch.Generator().manual_seed(0)
        noise = torch.randn(numbers, generator=generator)
        big = (noise + hidden.flatten()[0]).save()
    return big


def case_large(min_bytes: int, transport: Transport) -> dict:
    s = subject("gpt2")
    # float32 noise barely compresses; 1.5x keeps the zstd-compressed blob above the cap.
    numbers = int(min_bytes * 1.5 / 4) + 1
    local = _large_body(s, numbers, None)
    before = len(transport.seen)
    started = time.perf_counter()
    remote = remotely(lambda: _large_body(s, numbers, True))
    seconds = time.perf_counter() - started
    routes = transport.seen[before:]
    return {"ok": bool((remote == local).all()), "seconds": round(seconds, 3), "bytes": remote.numel() * 4,
            "min_bytes": min_bytes, "equals_local": bool((remote == local).all()),
            "route": routes[-1] if routes else None}


def case_first(name: str, timeout: float = 600.0) -> dict:
    """The first remote trace of a stack that is still starting: wait until /status shows the model HOT
    (as a user's script would), then trace. Times are wall-clock epochs, to compare with the start."""
    import os
    import urllib.request

    s = subject(name)
    key = s.model.to_model_key()
    # Imports done, model wrapped: what stack_clients.start_client(ready=True) waits for.
    channel.send({"ready": f"first:{name}"})
    deadline = time.time() + timeout
    polls = 0
    while True:
        polls += 1
        try:
            with urllib.request.urlopen(os.environ["NDIF_HOST"] + "/status", timeout=10) as response:
                status = json.loads(response.read())
            deployments = status.get("deployments", {})
            if LINE.name == "0.7" and status.get("cluster", {}).get("nodes"):
                break  # ndif 0.0.1 queues a request for a model still loading: ready once a node is listed
            if any(e.get("model_key") == key and e.get("deployment_level") == "HOT"
                   and e.get("application_state") == "RUNNING" for e in deployments.values()):
                break
        except (OSError, ValueError):
            pass  # not listening yet, or 503 while the API waits for Ray
        if time.time() > deadline:
            raise TimeoutError(f"{name} was not HOT after {timeout:.0f} s")
        time.sleep(0.25)
    hot = time.time()
    result = remotely(lambda: saves(s, remote=True))
    done = time.time()
    local = saves(s)
    diff = max(float((result[k].float() - local[k]).abs().max()) for k in local)
    ok = diff <= config.generation(LINE.name).atol
    return {"ok": ok, "hot_epoch": hot, "done_epoch": done, "request_s": round(done - hot, 3), "polls": polls,
            "max_abs_diff": diff}


def case_timing(name: str, n: int) -> dict:
    s = subject(name)
    remotely(lambda: saves(s, remote=True))  # warm: the server has run this model for this client once
    saves(s)
    remote, local = [], []
    for _ in range(n):
        started = time.perf_counter()
        remotely(lambda: saves(s, remote=True))
        remote.append(time.perf_counter() - started)
        started = time.perf_counter()
        saves(s)
        local.append(time.perf_counter() - started)
    return {"ok": True, "remote_s": remote, "local_s": local}


def run(cases) -> dict:
    import torch

    torch.set_num_threads(1)
    transport = Transport()
    out = {}
    for case in cases:
        kind, _, arg = case.partition(":")
        started = time.perf_counter()
        try:
            if kind == "trace":
                name, _, atol = arg.partition(":")
                record = case_trace(name, float(atol or 0))
            elif kind == "write":
                model, _, atol = arg.partition(":")
                record = case_write(model, float(atol or 0))
            elif kind == "error":
                record = case_error()
            elif kind == "large":
                record = case_large(int(arg), transport)
            elif kind == "first":
                record = case_first(arg)
            elif kind == "timing":
                name, _, n = arg.partition(":")
                record = case_timing(name, int(n or 5))
            else:
                raise ValueError(f"unknown case {case!r}")
        except Exception as exc:
            # A server's traceback comes first in the message and the error itself last: keep both ends.
            text = str(exc)
            record = {**checks.failure(exc), "message": text if len(text) <= 6000 else text[:3000] + " ... " + text[-3000:]}
            if kind in ("trace", "write") and arg.partition(":")[0] in KEYS:
                record["key"] = KEYS[arg.partition(":")[0]]
        if RETRIES:
            record["socket_race_retries"] = RETRIES[:]
            RETRIES.clear()
        record["wall_s"] = round(time.perf_counter() - started, 3)
        out[case] = record
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nnsight_repro.ndif.remote_client")
    sub = parser.add_subparsers(dest="action", required=True)
    m = sub.add_parser("mint")
    m.add_argument("--models", required=True)
    r = sub.add_parser("run")
    r.add_argument("--cases", required=True)
    args = parser.parse_args(argv)
    if args.action == "mint":
        channel.send(mint(args.models.split(",")))
    else:
        channel.send({"cases": run(args.cases.split(","))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
