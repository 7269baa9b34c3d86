"""The wire, tested the way an NDIF model actor receives it.

A client compiles a trace into the exact request bytes its remote backend
would send (:func:`request`); a fresh process of *another* environment, the
server, wraps the same model first (or, with ``--from-key``, builds it from the
client's key, as NDIF does) and then deserializes the request against that
wrapper's persistent objects and executes it (:func:`actor`), as a model actor
does. Whether a patched client's requests run on a released server is
decided here, offline, by the two nnsight installs themselves.

:func:`named_globals` reads which importable names a request makes the
unpickler look up, statically, without running it.

Runs inside a test environment (torch, transformers, nnsight), except
``named_globals``, which needs only the standard library. It does not start
servers or speak HTTP: the live stacks are ``nnsight_repro.ndif``'s.
"""

from __future__ import annotations

import argparse
import pickletools
from pathlib import Path
from typing import Dict, Set, Tuple

#: The traces a request can carry: two reads and the layer output, or a write and what it changes.
TRACES = ("read", "write")


def traced(subject, kind: str, **trace_kwargs) -> Dict[str, object]:
    """Run trace ``kind`` on ``subject``; the saved values by name (none when a backend only compiles it).

    ``read`` saves the first layer's and the final hidden states' output and the model's output; ``write``
    zeroes the first token's state in the first layer's output (zeroing every position would make a tiny
    model's zero biases carry zeros to the logits, which proves little) and saves the model's output: its
    logits, or a base model's final hidden state (``PanelModel.output_field``). Values are named as the block
    names them, which is how a model actor returns them (:func:`actor`). ``trace_kwargs`` go to
    ``model.trace`` (``backend=...``, ``remote=True``), with the subject's own inputs (:meth:`Subject.inputs`).
    """
    import torch

    (_, first, attr), (_, final, final_attr) = subject.read_points()
    field = subject.entry.output_field
    # Only nnsight's objects inside the block: it is what the request carries.
    model = subject.model
    ids = subject.ids[0]
    with torch.no_grad(), model.trace(ids, **subject.inputs(ids), **trace_kwargs):
        if kind == "read":
            first_layer = getattr(first, attr).save()
            final_hidden = getattr(final, final_attr).save()
        else:
            value = getattr(first, attr)
            hidden = value[0] if isinstance(value, tuple) else value
            hidden[:, 0] = 0
        output = getattr(model.output, field).save()
    if "backend" in trace_kwargs:  # compiled into a request, not run
        return {}
    saved = {"output": output} if kind == "write" else \
        {"first_layer": first_layer, "final_hidden": final_hidden, "output": output}
    return {name: _plain(value) for name, value in saved.items()}


def request(subject, kind: str) -> bytes:
    """The bytes ``subject``'s remote backend would send for trace ``kind``."""
    from nnsight.intervention.backends.base import Backend
    from nnsight.intervention.backends.remote import pull_env
    from nnsight.schema.request import RequestModel

    class Capture(Backend):
        """Builds the request as ``RemoteBackend.request`` does, and keeps it instead of sending it."""

        def __call__(self, tracer):
            interventions = super().__call__(tracer)
            pull_env()
            self.payload = RequestModel(interventions=interventions, tracer=tracer).serialize(compress=False)

    capture = Capture()
    traced(subject, kind, backend=capture)
    return capture.payload


def actor(subject, payload: bytes, model=None) -> Dict[str, object]:
    """What a model actor returns for ``payload``: deserialize against its own wrapper (``model``; default the
    subject's, the class the client meant), execute."""
    from nnsight.schema.request import RequestModel

    model = subject.model if model is None else model
    loaded = RequestModel.deserialize(payload, model._remoteable_persistent_objects(), compress=False)
    return {name: _plain(value) for name, value in loaded.tracer.execute(loaded.interventions).items()}


def _plain(value):
    """A saved value as a tensor, as the check routine compares hidden states."""
    from .checks import hidden_states

    return hidden_states(value).detach().clone()


def named_globals(payload: bytes) -> Set[Tuple[str, str]]:
    """Every (module, name) the unpickler would import for ``payload``, read from its opcodes.

    Protocol 4 names a global with two strings pushed (or fetched from the
    memo) right before ``STACK_GLOBAL``, so tracking the strings is enough.
    """
    memo: Dict[int, object] = {}
    strings: list = []
    last = None
    found = set()
    for opcode, arg, _ in pickletools.genops(payload):
        name = opcode.name
        if name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            last = arg
            strings.append(arg)
        elif name == "MEMOIZE":
            memo[len(memo)] = last
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            last = memo.get(arg)
            strings.append(last)
        elif name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
            last = None
        elif name == "GLOBAL":
            module, _, attribute = arg.partition(" ")
            found.add((module, attribute))
            last = None
        else:
            last = None
    return found


def write_requests(folder: Path, models, traces=TRACES) -> None:
    """Client side: for each model and trace, the request bytes and the local trace's values."""
    import torch

    from . import checks

    for model in models:
        subject = checks.Subject(model)
        # The key the client sends, its repo id the saved model's path (the server loads that path).
        (folder / f"{model}.key").write_text(checks.rebuild_job(subject)[1])
        for kind in traces:
            (folder / f"{model}.{kind}.request").write_bytes(request(subject, kind))
            torch.save(traced(subject, kind), folder / f"{model}.{kind}.local")


def serve_requests(folders, models, traces=TRACES, from_key: bool = False) -> list:
    """Server side: every client folder's requests run as a model actor runs them, each against its local values.

    The actor's wrapper is the subject's own (the class the client meant), or with ``from_key`` the one a
    server builds from that client's key (:func:`nnsight_repro.rebuild_key.wrapper`), as NDIF does; each
    record then names the class built. A request that fails is a record, not a crash: the next one still runs.
    """
    import torch

    from . import checks, rebuild_key

    records = []
    for model in models:
        subject = checks.Subject(model)
        for folder in folders:
            server = None
            if from_key:
                server = rebuild_key.wrapper((Path(folder) / f"{model}.key").read_text(), dispatch=True)
            for kind in traces:
                record = {"client": Path(folder).name, "model": model, "trace": kind}
                if server is not None:
                    record["built_class"] = type(server._module).__name__
                try:
                    saves = actor(subject, (Path(folder) / f"{model}.{kind}.request").read_bytes(), server)
                except Exception as exc:  # the server's answer, recorded as the user would see it
                    records.append({**record, **checks.failure(exc)})
                    continue
                if (model, kind) == RELOADED:
                    record.update(reloads(subject, (Path(folder) / f"{model}.{kind}.request").read_bytes()))
                expected = torch.load(Path(folder) / f"{model}.{kind}.local")
                diffs = {name: float((saves[name] - value).abs().max())
                         for name, value in expected.items() if name in saves}
                records.append({**record, "ok": set(saves) == set(expected) and max(diffs.values()) == 0.0,
                                "saved": sorted(saves), "max_abs_diff": max(diffs.values(), default=None)})
    return records


#: The request loaded again and again by the server (:func:`reloads`), and how often.
RELOADED, RELOADS = ("bert-mlm", "read"), 1000


def live_envoy_classes() -> int:
    import gc

    from nnsight.intervention.envoy import Envoy

    gc.collect()
    found, todo = set(), [Envoy]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return len(found)


def reloads(subject, payload: bytes, count: int = RELOADS) -> dict:
    """Live Envoy classes after one load of ``payload`` and after ``count`` more, in a process that never built
    the request's classes itself: a shared model actor must not accumulate them."""
    from nnsight.schema.request import RequestModel

    persistent = subject.model._remoteable_persistent_objects()
    RequestModel.deserialize(payload, persistent, compress=False)
    before = live_envoy_classes()
    for _ in range(count):
        RequestModel.deserialize(payload, persistent, compress=False)
    return {"reloads": count, "live_envoy_classes": [before, live_envoy_classes()]}


def main(argv=None) -> int:
    """``python -m nnsight_repro.wire client|server ...``: one side of the wire, in this environment."""
    from . import channel

    parser = argparse.ArgumentParser(prog="python -m nnsight_repro.wire")
    parser.add_argument("side", choices=["client", "server"])
    parser.add_argument("--models", required=True, help="comma-separated panel names")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--from-key", action="store_true",
                        help="server: build each model from the client's key, as NDIF does")
    parser.add_argument("folders", nargs="+", type=Path,
                        help="client: the folder to write into; server: each client's folder")
    args = parser.parse_args(argv)
    models, traces = args.models.split(","), args.traces.split(",")
    if args.side == "client":
        write_requests(args.folders[0], models, traces)
        channel.send({"written": str(args.folders[0])})
    else:
        channel.send({"records": serve_requests(args.folders, models, traces, from_key=args.from_key)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
