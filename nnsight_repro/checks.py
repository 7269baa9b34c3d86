"""The one check routine: what the nnsight in this interpreter does with each panel model.

Run inside an environment (``python -m nnsight_repro.checks``); it sends one
JSON record through :mod:`nnsight_repro.channel` (printed when run by hand).
The pytest suite, the local verify, Modal and the benchmark all read this record; none of them re-implements a check. Every check runs in its
own ``try``, so one failure is recorded and the rest still run.

Checks (each yields ``{"ok": bool, ...}`` or ``{"ok": false, "error", "message"}``):

- ``synthesized_classes``: envoy classes nnsight made up for this tree (ok: at most one);
- ``serializer_round_trip``: the wrapper through nnsight's own serializer and back;
- ``remote_local``: ``trace(..., remote="local")`` (serialize, deserialize, run)
  equals the same trace run locally;
- ``remote_key``: the key a server receives, and the class a server rebuilds from
  it offline (ok: the class the user wrapped);
- ``embedding_shift``: per-position L2 shift of the final hidden states when one
  unit (word, nucleotide, codon, residue) is substituted, to 4 d.p. with a
  digest, plus where it peaks and how far it spreads (numbers, not a pass/fail).

Not run unless asked for (``--checks``), because it starts a process:

- ``rebuild_without_package``: the server-side rebuild from the model's key in a
  fresh interpreter that imports nothing the model needs (no multimolecule):
  shows which models need their package importable where they are rebuilt.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import sys
import time
import traceback
import warnings
from typing import Callable, Dict, List

from . import channel, models, settings

CHECKS: List[str] = ["synthesized_classes", "serializer_round_trip", "remote_local", "remote_key", "embedding_shift"]
#: Checks run only when named: each costs a fresh interpreter (shared by all models of one run).
EXTRA_CHECKS: List[str] = ["rebuild_without_package"]
#: Names ``--models`` accepts for a whole panel.
PANEL_ALIASES = {"panel": lambda: list(models.PANEL), "rna": lambda: list(models.RNA_PANEL),
                 "all": lambda: list(models.extended())}


def expand_models(names: List[str]) -> List[str]:
    """Model names with each panel alias (``panel``, ``rna``, ``all``) replaced by the models it stands for."""
    return [n for name in names if name for n in (PANEL_ALIASES[name]() if name in PANEL_ALIASES else [name])]

#: Checks that fail on nnsight 0.7.0 exactly when a layer has an ``output`` submodule (the envoy bug).
ENVOY_CHECKS = ("synthesized_classes", "serializer_round_trip", "remote_local")
#: Checks that fail on nnsight 0.7.0 exactly when a server must rebuild a class its key cannot name (the key bug).
KEY_CHECKS = ("remote_key", "rebuild_without_package")
#: What a 0.7.0 server rebuilds when the key names no class.
RELEASE_AUTOMODEL = "AutoModelForCausalLM"


def expected_ok(entry: "models.PanelModel", check: str, fixed: bool) -> bool:
    """The outcome the suite predicts for ``check`` on ``entry``, from facts of the model, never from a run.

    ``fixed``: the nnsight under test carries the fix (our series, or 0.8). Tests compare every recorded
    outcome with this, so a model that starts passing on the release is as loud as one that fails patched.
    """
    if check == "rebuild_without_package" and entry.requires:
        return False  # its config type is registered with transformers only by importing its package
    if fixed:
        return True
    if check in ENVOY_CHECKS:
        return not entry.has_output_child
    if check in KEY_CHECKS:
        return entry.automodel == RELEASE_AUTOMODEL
    return True


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
        # multimolecule registers its configs and tokenizers with the Auto classes only on import.
        models.import_requirements(self.entry)
        self.path = models.saved_model(name)
        self.hub_id = f"{HUB_NAMESPACE}/{name}"
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.line.seed_hub_ids({str(self.path): self.hub_id})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model = self.line.wrap(self.path, self.entry, self.tokenizer)
        self.ids = [models.token_ids(self.tokenizer, s) for s in models.texts_for(self.entry)]

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

    def inputs(self, ids, remote=None) -> Dict[str, object]:
        """The keywords every trace of ``ids`` passes to ``model.trace`` (``remote``, if given).

        The RNA/protein panel's models get an all-ones attention mask, as a user's tokenizer would give
        them: multimolecule 0.2.2's UTR-LM embeddings call ``attention_mask.sum(-1)`` and fail on None
        (``AttributeError: 'NoneType' object has no attribute 'sum'``, also without nnsight;
        ``tests/test_upstream_repros.py``), and 0.7's LanguageModel makes no mask from an ``input_ids``
        tensor (0.8's does). PANEL's models keep their inputs, and so every number they produce.
        """
        kwargs = {} if remote is None else {"remote": remote}
        if self.entry.tokenizer is not None:
            import torch

            kwargs["attention_mask"] = torch.ones_like(ids)
        return kwargs

    def trace(self, ids, remote=None) -> Dict[str, object]:
        """Save each read point's output; ``remote="local"`` goes through the serializer."""
        points = self.read_points()
        saved = {}
        kwargs = self.inputs(ids, remote)
        with server_modules(self.entry.requires if remote == "local" else ()):
            with self.model.trace(ids, **kwargs):
                for label, envoy, attr in points:
                    saved[label] = getattr(envoy, attr).save()
        return {label: hidden_states(value) for label, value in saved.items()}


@contextlib.contextmanager
def server_modules(packages):
    """Simulate a server that has ``packages`` installed, as a server for these models must.

    0.7's ``remote="local"`` hides every module outside a fixed server list
    while it deserializes; the request names the model's config class, so a
    multimolecule model would otherwise re-import multimolecule with ``__main__``
    hidden and fail on that, not on anything nnsight sends. 0.8's simulation has
    no such list, and then this does nothing.
    """
    try:
        from nnsight.intervention.backends import local_simulation
    except ImportError:
        local_simulation = None
    allowed = getattr(local_simulation, "SERVER_MODULES", None)
    added = [p for p in packages if allowed is not None and p not in allowed]
    allowed = allowed if allowed is not None else set()
    allowed.update(added)
    try:
        yield added
    finally:
        allowed.difference_update(added)


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
    if subject.entry.requires:
        record["server_has"] = list(subject.entry.requires)  # see server_modules()
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
    # RNA-MSM keeps an MSA-row axis: (rows, length) for one sequence; one row here.
    shift = shift.reshape(-1, shift.shape[-1])[0] if shift.dim() > 1 else shift
    values = rounded(shift)
    # The token positions whose ids differ: one for a word, nucleotide, codon or residue,
    # three for a nucleotide under overlapping 3-mers (UTR-BERT).
    changed = [int(i) for i in (subject.ids[0][0] != subject.ids[1][0]).nonzero().flatten()]
    position = changed[0] if changed else models.SUBSTITUTION[0] + (1 if subject.entry.encoder else 0)
    return {"ok": True, "values": values, "digest": digest(values), "substituted_position": position,
            "peak_position": int(shift.argmax()), **spread(shift, changed or [position])}


def spread(shift, changed: List[int]) -> dict:
    """How far the shift reaches beyond the substituted tokens (special tokens included, as positions).

    ``reach``: positions outside the substituted ones whose shift is at least a
    tenth of the peak, and the farthest of them in tokens from the substitution.
    """
    peak = float(shift.max())
    others = [i for i in range(len(shift)) if i not in changed]
    reached = [i for i in others if float(shift[i]) >= 0.1 * peak] if peak > 0 else []
    return {
        "substituted_positions": changed,
        "peak_value": round(peak, 4),
        "mean_elsewhere": round(float(shift[others].mean()), 4) if others else 0.0,
        "reach_positions": len(reached),
        "reach_tokens": max((min(abs(i - c) for c in changed) for i in reached), default=0),
    }


def rebuild_job(subject: Subject) -> list:
    """``[name, key]`` for the rebuild interpreter, with the cache directory standing in for the hub."""
    key = subject.model.to_model_key()
    import_path, _, fields = key.partition(":")
    fields = json.loads(fields)
    fields["repo_id"] = str(subject.path)
    return [subject.entry.name, f"{import_path}:{json.dumps(fields)}"]


def rebuild_without_package(jobs: List[list]) -> Dict[str, dict]:
    """One fresh interpreter rebuilds every queued key (starting one costs seconds: nnsight, transformers)."""
    where = settings.setting("ENV") or sys.prefix
    # A module of its own (nnsight_repro.rebuild_key), so the rebuild imports only nnsight and transformers.
    found = channel.run_one([sys.executable, "-m", "nnsight_repro.rebuild_key"], input=json.dumps(jobs),
                            env={**os.environ, **settings.HF_OFFLINE}, timeout=600,
                            what=f"a fresh interpreter of the {where!r} environment (rebuilding keys as a server would)")
    imported = found.pop("_imported")
    results = {}
    for name, result in found.items():
        entry = models.get(name)
        result = {**result, "packages_imported": imported, "requires": list(entry.requires),
                  "expected_class": entry.model_class}
        if result["ok"]:
            result["ok"] = result["rebuilt_class"] == entry.model_class
        # Whether this model needs its own package importable where it is rebuilt.
        result["needs_package_where_rebuilt"] = bool(entry.requires) and not result["ok"]
        results[name] = result
    return results


def check_rebuild_without_package(subject: Subject) -> dict:
    """For one model; :func:`run` batches all models of a run into one interpreter instead."""
    return rebuild_without_package([rebuild_job(subject)])[subject.entry.name]


CHECK_FUNCTIONS: Dict[str, Callable[[Subject], dict]] = {
    name: globals()[f"check_{name}"] for name in CHECKS + EXTRA_CHECKS
}


def validate(model_names: List[str], check_names: List[str]) -> None:
    known = models.extended()
    unknown_models = [m for m in model_names if m not in known]
    unknown_checks = [c for c in check_names if c not in CHECK_FUNCTIONS]
    if unknown_models or unknown_checks:
        raise ValueError(
            "; ".join(
                part for part in [
                    unknown_models and f"unknown model(s) {', '.join(unknown_models)} (models: {', '.join(known)}; "
                                     f"or a whole panel: {', '.join(PANEL_ALIASES)})",
                    unknown_checks and f"unknown check(s) {', '.join(unknown_checks)} (checks: {', '.join(CHECK_FUNCTIONS)})",
                ] if part
            )
        )


def environment() -> dict:
    import importlib.util
    from importlib.metadata import version

    import nnsight

    from . import lines

    return {
        "env": settings.setting("ENV", ""),
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
    # Before nnsight: 0.7.0 mounts ``save`` on every object, and huggingface_hub's
    # typed classes (which multimolecule's imports define) then refuse to be created.
    for name in model_names:
        models.import_requirements(models.get(name))
    record = {"environment": environment(), "models": {}}
    queued: List[list] = []
    for name in model_names:
        results = {}
        try:
            subject = Subject(name)
        except Exception as exc:  # the model could not even be wrapped: every check says so
            results = {check: failure(exc) for check in check_names}
        else:
            for check in check_names:
                try:
                    if check == "rebuild_without_package":
                        queued.append(rebuild_job(subject))  # run once for all models, below
                        continue
                    results[check] = CHECK_FUNCTIONS[check](subject)
                except Exception as exc:
                    results[check] = failure(exc)
        record["models"][name] = results
    if queued:
        try:
            rebuilt = rebuild_without_package(queued)
        except Exception as exc:
            rebuilt = {name: failure(exc) for name, _ in queued}
        for name, _ in queued:
            record["models"][name]["rebuild_without_package"] = rebuilt[name]
    for name in model_names:  # keep each model's checks in the order asked for
        results = record["models"][name]
        record["models"][name] = {c: results[c] for c in check_names if c in results}
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nnsight_repro.checks", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(models.PANEL), help="comma-separated panel models")
    parser.add_argument("--checks", default=",".join(CHECKS), help="comma-separated checks")
    args = parser.parse_args(argv)
    try:
        record = run(expand_models(args.models.split(",")), args.checks.split(","))
    except ValueError as exc:
        parser.error(str(exc))
    if channel.connected():
        channel.send(record)
    else:  # run by hand: for a person to read, never parsed
        sys.stdout.write(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
