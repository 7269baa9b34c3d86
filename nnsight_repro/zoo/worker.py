"""The zoo's worker: scans units one at a time inside one environment, one record per finished unit.

``python -m nnsight_repro.zoo.worker`` reads a JSON list of catalog units on
stdin and sends its messages through :mod:`nnsight_repro.channel`, record by
record, so nothing a model or library prints can corrupt them. Before a unit it
sends ``{"begin": id}``, so when the process dies the parent knows which unit
killed it. ``--list`` sends the catalog instead.

Per unit, for the nnsight this interpreter imports:

- ``collisions``: modules whose own name is an attribute of this nnsight's
  ``Envoy`` (the names come from ``dir(Envoy)`` and a bare envoy's instance
  attributes, never a list of ours), each with its kind (see
  :func:`envoy_attribute_names`);
- ``synthesized_classes`` and ``serializer_round_trip``: the check routine's own
  checks, on the model built on meta;
- ``remote_local`` (representative units only): a tiny seeded model, one read
  point saved by ``trace(remote="local")`` against the same trace run locally.

``NNSIGHT_REPRO_ZOO_INJECT=segfault=<id>,hang=<id>`` makes the worker die or
hang on that unit: how the tests prove the parent survives both.
"""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import sys
import time
import types
import warnings

from .. import channel, settings


def failure(exc: BaseException) -> dict:
    """The check routine's failure record, with the error's own last line when nnsight wraps a traceback."""
    from .. import checks

    record = checks.failure(exc)
    if record["message"].startswith("Traceback"):
        record["message"] = str(exc).strip().splitlines()[-1][:300]
    return record


def envoy_attribute_names() -> dict:
    """Every name an envoy answers to, from this nnsight itself, with what a submodule of that name does to it.

    - ``served``: nnsight relocates one of the two (0.7 moves its attribute to
      ``nns_<name>`` on any ``hasattr(Envoy, name)``; 0.8 moves the submodule to
      ``E_<name>`` when the name is a public data descriptor);
    - ``shadowed``: the child envoy is set over a class attribute (a method) on that envoy only;
    - ``clobbered``: the name is per-instance state set in ``Envoy.__init__`` (``path``,
      ``interleaver``), which ``dir(Envoy)`` cannot show: the child envoy overwrites it.
    """
    import inspect

    import torch
    from nnsight.intervention.envoy import Envoy

    from .. import lines

    class_names = [n for n in dir(Envoy) if not (n.startswith("__") and n.endswith("__"))]
    instance_names = [n for n in vars(Envoy(torch.nn.Module())) if n not in class_names]
    if lines.current().synthesizes_classes:
        kinds = {n: "served" for n in class_names}
    else:
        kinds = {n: "served" if not n.startswith("_") and inspect.isdatadescriptor(getattr(Envoy, n, None))
                 else "shadowed" for n in class_names}
    kinds.update({n: "clobbered" for n in instance_names})
    return kinds


def collisions(model, names: dict) -> list:
    found = []
    for path, _ in model.named_modules():
        name = path.rsplit(".", 1)[-1]
        if path and name in names:
            found.append({"path": path, "name": name, "kind": names[name],
                          "pattern": re.sub(r"\.\d+(?=\.|$)", ".N", path)})
    return found


def wrap(model, meta: bool):
    """The line's wrapper around a built module; nnsight's base NNsight where that wrapper refuses the module."""
    from .. import lines, models

    tokenizer = models.build_tokenizer(True)
    line = lines.current()
    try:
        if line.wrapper == "LanguageModel":
            from nnsight import LanguageModel

            return LanguageModel(model, tokenizer=tokenizer), line.wrapper, None
        from nnsight.modeling.transformers import TransformersModel

        # 0.8's wrapper builds a pipeline around the module; on meta it must not move it.
        kwargs = {"device": "meta"} if meta else {}
        try:
            return TransformersModel(model, tokenizer=tokenizer, **kwargs), line.wrapper, None
        except Exception:
            # It infers a task from the class name and builds that task's pipeline: a bare backbone
            # (T5Model) has no task it knows, and an image task wants an image processor from the hub.
            # feature-extraction needs only the tokenizer, and the envoy tree is the module's either way.
            return (TransformersModel(model, tokenizer=tokenizer, task="feature-extraction", **kwargs),
                    line.wrapper, None)
    except Exception as exc:
        from nnsight import NNsight

        return NNsight(model), "NNsight", f"{type(exc).__name__}: {str(exc).strip()[:200]}"


def read_point(wrapper):
    """(label, envoy, attribute): the first envoy with an ``output`` child (the collision), else the root."""
    from .. import lines

    line = lines.current()
    for envoy in wrapper.modules():
        if line.collides(envoy):
            return envoy.path, envoy, line.output_attr(envoy)
    return "root", wrapper, "output"


def first_tensor(value):
    import torch

    while not isinstance(value, torch.Tensor):
        if hasattr(value, "to_tuple"):
            value = value.to_tuple()
        if isinstance(value, (tuple, list)) and value:
            value = value[0]
        else:
            raise TypeError(f"no tensor in a {type(value).__name__}")
    return value


def remote_local(unit: dict) -> dict:
    """The tiny trace through ``remote="local"`` against the same trace run locally.

    ``stage`` says where it stopped: ``tiny_build`` and ``local_trace`` mean the
    scan could not run this model tiny at all (nothing about nnsight's remote
    path); only ``remote_trace`` or a mismatch is a failure of the remote path.
    """
    from .. import checks
    from . import build

    stage = "tiny_build"
    try:
        model = build.build_tiny(unit)
        inputs = build.forward_inputs(model)
        if inputs is None:
            return {"ok": None, "stage": stage, "skipped": "the forward takes no input_ids"}
        wrapper, wrapper_name, _ = wrap(model, meta=False)
        label, envoy, attribute = read_point(wrapper)
        ids = inputs.pop("input_ids")

        def traced(**remote):
            with checks.server_modules(("multimolecule",) if unit["source"] == "multimolecule" else ()):
                with wrapper.trace(ids, **inputs, **remote):
                    saved = getattr(envoy, attribute).save()
            return first_tensor(getattr(saved, "value", saved))

        stage = "local_trace"
        local = traced()
        stage = "remote_trace"
        remote = traced(remote="local")
    except Exception as exc:
        return {**failure(exc), "stage": stage}
    same = bool(local.shape == remote.shape and (local == remote).all())
    return {"ok": same, "stage": "compare", "read": f"{label}.{attribute}", "wrapper": wrapper_name,
            "shape": list(local.shape)}


def scan(unit: dict, names: dict, environment: dict) -> dict:
    from .. import checks
    from . import build

    record = {"id": unit["id"]}
    try:
        model, config, default_error = build.build_meta(unit)
    except Exception as exc:
        record["build"] = {**failure(exc), "reason": "cannot be built from its config's defaults, nor tiny"}
        return record
    record["build"] = {"ok": True, "config": config, "device": "meta", "parameters": build.parameters(model)}
    if default_error is not None:
        record["build"]["defaults_failed"] = failure(default_error)
    record["collisions"] = collisions(model, names)
    wrapper, wrapper_name, refused = wrap(model, meta=True)
    record["wrapper"] = {"name": wrapper_name, **({"line_wrapper_refused": refused} if refused else {})}
    root_children = {name for name, _ in model.named_children()}
    record["wrapper"]["root_children_named_like_wrapper_attributes"] = sorted(
        root_children & (set(dir(type(wrapper))) - set(names)) - set(dir(object)))
    subject = types.SimpleNamespace(model=wrapper, line=environment["line_object"])
    for check in ("synthesized_classes", "serializer_round_trip"):
        try:
            record[check] = checks.CHECK_FUNCTIONS[check](subject)
        except Exception as exc:
            record[check] = failure(exc)
    del wrapper, model, subject
    if unit["representative"]:
        record["remote_local"] = remote_local(unit)
    return record


def injected(unit_id: str) -> None:
    for item in filter(None, settings.setting("ZOO_INJECT", "").split(",")):
        kind, _, target = item.partition("=")
        if target == unit_id and kind == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        if target == unit_id and kind == "hang":
            time.sleep(10 ** 6)


def worker_commit() -> str:
    """The project commit this worker's code is from (``+dirty`` when the tree differs), for provenance."""
    import subprocess

    from .. import ROOT

    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return head + ("+dirty" if git("status", "--porcelain", "--", "nnsight_repro") else "")


def environment_block() -> dict:
    from importlib.metadata import version

    from .. import checks, lines
    from . import minimal_trees

    block = checks.environment()
    block["multimolecule"] = version("multimolecule")
    block["worker_commit"] = worker_commit()
    block["envoy_attributes"] = envoy_attribute_names()
    # Costs milliseconds here, where nnsight is already imported; a process of its own costs seconds.
    block["probes"] = {name: minimal_trees.round_trip(tree) for name, tree in minimal_trees.probe_trees().items()}
    block["line_object"] = lines.current()
    return block


def main() -> int:
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)
    # Before nnsight: 0.7.0 mounts ``save`` on every object, and the typed classes
    # multimolecule's imports define then refuse to be created.
    import multimolecule  # noqa: F401
    import transformers

    transformers.logging.set_verbosity_error()
    from . import catalog

    if "--list" in sys.argv:
        channel.send({"catalog": catalog.catalog(), "config_types_without_model_class":
                        catalog.config_types_without_model_class()})
        return 0
    units = json.loads(sys.stdin.read())
    environment = environment_block()
    names = environment["envoy_attributes"]
    channel.send({"environment": {k: v for k, v in environment.items() if k != "line_object"}})
    for unit in units:
        channel.send({"begin": unit["id"]})
        injected(unit["id"])
        started = time.perf_counter()
        record = scan(unit, names, environment)
        record["seconds"] = round(time.perf_counter() - started, 3)
        channel.send({"record": record})
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
