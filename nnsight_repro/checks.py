"""The one check routine: what the nnsight in this interpreter does with each panel model.

Run inside an environment (``python -m nnsight_repro.checks``); it prints one
JSON record. The pytest suite, the local verify, Modal and the benchmark all
read this record; none of them re-implements a check. Every check runs in its
own ``try``, so one failure is recorded and the rest still run.

Checks (each yields ``{"ok": bool, ...}`` or ``{"ok": false, "error", "message"}``):

- ``synthesized_classes``: envoy classes nnsight made up for this tree (ok: at most one);
- ``serializer_round_trip``: the wrapper through nnsight's own serializer and back;
- ``remote_local``: ``trace(..., remote="local")`` (serialize, deserialize, run)
  equals the same trace run locally;
- ``remote_key``: the key a server receives, and the class a server rebuilds from
  it offline (ok: the class the user wrapped);
- ``embedding_shift``: per-position L2 shift of the final hidden states when one
  token is substituted, to 4 d.p. with a digest (numbers, not a pass/fail).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List

from . import models

CHECKS: List[str] = ["synthesized_classes", "serializer_round_trip", "remote_local", "remote_key", "embedding_shift"]

#: Stands in for a hub repo id in recorded keys, so keys do not carry cache paths.
HUB_NAMESPACE = "nnsight-repro"


def rounded(tensor) -> List[float]:
    return [round(float(v), 4) + 0.0 for v in tensor.detach().flatten().tolist()]


def digest(values) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:16]


def failure(exc: BaseException) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)
    return {
        "ok": False,
        "error": type(exc).__name__,
        "message": str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "",
        "where": f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "",
    }


class Subject:
    """One panel model wrapped by this interpreter's nnsight, built once per check run."""

    def __init__(self, name: str):
        from transformers import AutoTokenizer

        from . import lines

        self.entry = models.get(name)
        self.line = lines.current()
        self.path = models.saved_model(name)
        self.hub_id = f"{HUB_NAMESPACE}/{name}"
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.line.seed_hub_ids({str(self.path): self.hub_id})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = self.line.wrap(self.path, self.entry, self.tokenizer)
        self.ids = [models.token_ids(self.tokenizer, s) for s in models.sentences()]

    def envoy(self, dotted: str):
        node = self.model
        for part in dotted.split("."):
            node = node[int(part)] if part.lstrip("-").isdigit() else getattr(node, part)
        return node

    def read_points(self):
        """(label, envoy, attribute) for the values a trace saves."""
        first = self.envoy(self.entry.first_layer)
        final = self.envoy(self.entry.final_hidden)
        return [
            ("first_layer", first, self.line.output_attr(first)),
            ("final_hidden", final, self.line.output_attr(final)),
        ]

    def trace(self, ids, remote=None) -> Dict[str, object]:
        """Save each read point's output; ``remote="local"`` goes through the serializer."""
        points = self.read_points()
        saved = {}
        kwargs = {} if remote is None else {"remote": remote}
        with self.model.trace(ids, **kwargs):
            for label, envoy, attr in points:
                saved[label] = getattr(envoy, attr).save()
        return {label: hidden_states(value) for label, value in saved.items()}


def hidden_states(value):
    """Layer outputs are tensors on some modules and tuples on others."""
    while isinstance(value, (tuple, list)):
        value = value[0]
    return getattr(value, "last_hidden_state", value)


def check_synthesized_classes(subject: Subject) -> dict:
    from nnsight.intervention.envoy import Envoy

    declared = {Envoy, type(subject.model)}
    # Distinct class objects, not names: 0.7.0 gives every one the same name.
    made = {t for t in map(type, subject.model.modules()) if t not in declared and "Preserved" in t.__name__}
    names = sorted({f"{t.__module__}.{t.__qualname__}" for t in made})
    overloaded = sum(1 for e in subject.model.modules() if subject.line.collides(e))
    return {"ok": len(made) <= 1, "count": len(made), "classes": names, "envoys_with_colliding_child": overloaded,
            "reason": f"{len(made)} classes for {overloaded} envoys"}


def check_serializer_round_trip(subject: Subject) -> dict:
    from nnsight.intervention import serialization

    payload = serialization.dumps(subject.model)
    loaded = serialization.loads(payload, subject.model._remoteable_persistent_objects())
    paths = [e.path for e in subject.model.modules()]
    loaded_paths = [e.path for e in loaded.modules()]
    types_match = [type(a) is type(b) for a, b in zip(subject.model.modules(), loaded.modules())]
    return {"ok": paths == loaded_paths and all(types_match), "bytes": len(payload)}


def check_remote_local(subject: Subject) -> dict:
    local = subject.trace(subject.ids[0])
    started = time.perf_counter()
    remote = subject.trace(subject.ids[0], remote="local")
    record = {"seconds": round(time.perf_counter() - started, 3)}
    for label in local:
        record[label] = {"shape": list(remote[label].shape), "digest": digest(rounded(remote[label])),
                         "equals_local": bool((remote[label] == local[label]).all())}
    record["ok"] = all(record[label]["equals_local"] for label in local)
    return record


def check_remote_key(subject: Subject) -> dict:
    key = subject.model.to_model_key()
    import_path, _, fields = key.partition(":")
    # A server maps the hub id to its local copy; ours is the cache directory.
    fields = json.loads(fields)
    fields["repo_id"] = str(subject.path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rebuilt = type(subject.model).from_model_key(f"{import_path}:{json.dumps(fields)}")
    rebuilt_class = type(rebuilt._module).__name__
    return {"ok": rebuilt_class == subject.entry.model_class, "key": key,
            "rebuilt_class": rebuilt_class, "expected_class": subject.entry.model_class,
            "reason": f"rebuilt as {rebuilt_class}"}


def check_embedding_shift(subject: Subject) -> dict:
    import torch

    reference, substituted = (subject.trace(ids)["final_hidden"] for ids in subject.ids)
    shift = torch.linalg.vector_norm(substituted[0] - reference[0], dim=-1)
    values = rounded(shift)
    position = models.SUBSTITUTION[0] + (1 if subject.entry.encoder else 0)
    return {"ok": True, "values": values, "digest": digest(values), "substituted_position": position,
            "peak_position": int(shift.argmax())}


CHECK_FUNCTIONS: Dict[str, Callable[[Subject], dict]] = {
    name: globals()[f"check_{name}"] for name in CHECKS
}


def validate(model_names: List[str], check_names: List[str]) -> None:
    unknown_models = [m for m in model_names if m not in models.PANEL]
    unknown_checks = [c for c in check_names if c not in CHECK_FUNCTIONS]
    if unknown_models or unknown_checks:
        raise ValueError(
            "; ".join(
                part for part in [
                    unknown_models and f"unknown model(s) {', '.join(unknown_models)} (panel: {', '.join(models.PANEL)})",
                    unknown_checks and f"unknown check(s) {', '.join(unknown_checks)} (checks: {', '.join(CHECKS)})",
                ] if part
            )
        )


def environment() -> dict:
    import importlib.util
    from importlib.metadata import version

    import nnsight

    from . import lines

    return {
        "env": os.environ.get("NNSIGHT_REPRO_ENV", ""),
        "line": lines.current().name,
        "python": platform.python_version(),
        "nnsight": version("nnsight"),
        "nnsight_file": nnsight.__file__,
        "nnsight_c_extension": importlib.util.find_spec("nnsight._c.py_mount") is not None,
        "torch": version("torch"),
        "transformers": version("transformers"),
        "tokenizers": version("tokenizers"),
    }


def run(model_names: List[str], check_names: List[str] = CHECKS) -> dict:
    validate(model_names, check_names)
    import torch

    torch.set_num_threads(1)
    record = {"environment": environment(), "models": {}}
    for name in model_names:
        results = {}
        try:
            subject = Subject(name)
        except Exception as exc:  # the model could not even be wrapped: every check says so
            results = {check: failure(exc) for check in check_names}
        else:
            for check in check_names:
                try:
                    results[check] = CHECK_FUNCTIONS[check](subject)
                except Exception as exc:
                    results[check] = failure(exc)
        record["models"][name] = results
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nnsight_repro.checks", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(models.PANEL), help="comma-separated panel models")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated checks")
    parser.add_argument("--out", help="write the JSON record here instead of stdout")
    args = parser.parse_args(argv)
    try:
        record = run(args.models.split(","), args.checks.split(","))
    except ValueError as exc:
        parser.error(str(exc))
    text = json.dumps(record, indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
