"""A checkpoint's module tree on the meta device, and what this environment's nnsight line makes of it.

Runs inside a project environment: ``python -m nnsight_repro.preflight.tree`` reads a JSON list of jobs
``{"id", "config_dir", "automodel": name | null}`` on stdin and sends one record ``{id: facts}`` through
:mod:`nnsight_repro.channel`. It reads ``config.json`` only: no weights, no tokenizer, nothing from the hub
(the environment is offline).

Facts per job (every name from the library that decides it, never from a list of ours):

- ``model_type`` and ``package``: transformers' own, or the package whose import registers it (the ones
  the panel's models need, :attr:`nnsight_repro.models.PanelModel.requires`); ``remote_code``: the config's
  ``auto_map``, whose code is never run here;
- ``wrapped``: the class the user wraps and the Auto class that builds it (``--automodel``, else the one
  that builds ``config.architectures[0]``, else ``AutoModel``);
- ``causal_lm``: what AutoModelForCausalLM builds from the config (what a stock 0.7.0 key makes a server
  rebuild) and the first module path of the wrapped model it lacks;
- ``task``: the first pipeline task whose model classes build the wrapped class, tried in the order nnsight
  0.8's ``TransformersModel`` tries them (its key's class field);
- ``collisions``: submodules named like an envoy attribute, by this environment's nnsight
  (:func:`nnsight_repro.zoo.worker.envoy_attribute_names`: 0.7 and 0.8 each decide for themselves);
- ``bfloat16``: a panel model of the same modeling module that fails in bfloat16
  (:attr:`nnsight_repro.models.PanelModel.fails_in_bfloat16`), where one is known.

Does not decide what any of it means for a client or a server: :mod:`nnsight_repro.outcomes` does, on the host.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import warnings
from importlib.metadata import version
from pathlib import Path

from nnsight_repro import channel, lines, models


class TreeError(Exception):
    """The tree cannot be built here; ``kind`` names why (``unknown_model_type``, ``remote_code``, ...)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def known_packages() -> list:
    """Packages that register model types with transformers on import: the ones the panel needs."""
    return sorted({p for entry in models.extended().values() for p in entry.requires})


def registering_package(model_type: str, auto_map) -> str | None:
    """None for transformers' own ``model_type``; else the package whose import registers it (imported here:
    the package of the config class transformers maps it to, once it is registered)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for package in [None, *known_packages()]:
        if package is not None:
            importlib.import_module(package)
        if model_type in CONFIG_MAPPING:
            owner = CONFIG_MAPPING[model_type].__module__.split(".")[0]
            return None if owner == "transformers" else owner
    if auto_map:
        raise TreeError("remote_code", f"model_type {model_type!r} is defined by the checkpoint's own code "
                                       f"(auto_map: {', '.join(sorted(auto_map))}), which preflight does not run")
    raise TreeError("unknown_model_type",
                    f"model_type {model_type!r} is not known to transformers {version('transformers')}, nor "
                    f"registered by {', '.join(known_packages())}")


def auto_classes() -> list:
    """Every Auto model class, the pipeline tasks' own first (in their order), so a class that several
    build is named after a task's."""
    from transformers.models.auto import modeling_auto
    from transformers.pipelines import SUPPORTED_TASKS

    found = [auto for task in SUPPORTED_TASKS.values() for auto in task["pt"]]
    found += [getattr(modeling_auto, name) for name in sorted(dir(modeling_auto))
              if name.startswith("AutoModel") and hasattr(getattr(modeling_auto, name), "_model_mapping")]
    return list(dict.fromkeys(found))


def builds(auto, config):
    """The class ``auto`` builds from ``config``, or None."""
    try:
        cls = auto._model_mapping[type(config)]
    except (KeyError, ValueError):
        return None
    return cls[0] if isinstance(cls, (tuple, list)) else cls


def wrapped(config, architectures, automodel: str | None):
    """``(Auto class, model class, where the choice came from)`` for the class the user wraps."""
    from transformers.models.auto import modeling_auto

    if automodel:
        auto = getattr(modeling_auto, automodel, None)
        if auto is None or not hasattr(auto, "_model_mapping"):
            raise TreeError("no_class", f"--automodel {automodel}: transformers has no such Auto class")
        cls = builds(auto, config)
        if cls is None:
            raise TreeError("no_class", f"{automodel} has no class for model_type {config.model_type!r}")
        return auto, cls, "--automodel"
    if architectures:
        for auto in auto_classes():
            cls = builds(auto, config)
            if cls is not None and cls.__name__ == architectures[0]:
                return auto, cls, "config.architectures"
        raise TreeError("no_class", f"config.architectures names {architectures[0]}, which no Auto class builds "
                                    f"for model_type {config.model_type!r}: pass --automodel")
    auto = modeling_auto.AutoModel
    cls = builds(auto, config)
    if cls is None:
        raise TreeError("no_class", f"the config names no architecture and AutoModel has no class for "
                                    f"model_type {config.model_type!r}: pass --automodel")
    return auto, cls, "AutoModel (the config names no architecture)"


def pipeline_task(cls, config) -> dict:
    """The first pipeline task that builds ``cls``: each task's model classes are tried in order and the
    first that has a class for the config is the one built, as nnsight 0.8's meta load does."""
    from transformers.pipelines import SUPPORTED_TASKS

    for task, spec in SUPPORTED_TASKS.items():
        built = next(filter(None, (builds(auto, config) for auto in spec["pt"])), None)
        if built is cls:
            return {"task": task, "builds": cls.__name__}
    return {"task": None, "builds": None}


def module_paths(model) -> list:
    return [path for path, _ in model.named_modules() if path]


def causal_lm(cls, config, wrapped_paths) -> dict:
    """What AutoModelForCausalLM builds from the config, and the first wrapped module path it lacks."""
    from transformers import AutoModelForCausalLM

    from nnsight_repro.zoo import build

    causal = builds(AutoModelForCausalLM, config)
    if causal is None:
        return {"class": None, "missing_path": None}
    if causal is cls:
        return {"class": causal.__name__, "missing_path": None}
    present = set(module_paths(build.on_meta(causal, config)))
    missing = next((p for p in wrapped_paths if p not in present), None)
    return {"class": causal.__name__, "missing_path": missing}


def collisions(model, names: dict) -> list:
    """Submodules named like an envoy attribute, one entry per (name, kind): how many, and where (layer
    indices folded into ``N``)."""
    from nnsight_repro.zoo import worker

    grouped = {}
    for found in worker.collisions(model, names):
        entry = grouped.setdefault((found["name"], found["kind"]),
                                   {"name": found["name"], "kind": found["kind"], "count": 0, "patterns": []})
        entry["count"] += 1
        if found["pattern"] not in entry["patterns"]:
            entry["patterns"].append(found["pattern"])
    return list(grouped.values())


def bfloat16_hazard(cls) -> dict | None:
    """A panel model defined in the same modeling module as ``cls`` that fails in bfloat16, if any.

    Only panel models whose packages are imported already are compared: importing one costs seconds, and a
    model whose package is not imported cannot share ``cls``'s module."""
    for entry in models.extended().values():
        if not entry.fails_in_bfloat16 or not all(p in sys.modules for p in entry.requires):
            continue
        known = getattr(importlib.import_module(entry.module), entry.model_class)
        if known.__module__ == cls.__module__:
            return {"message": entry.fails_in_bfloat16, "fix": entry.bfloat16_fix, "seen_on": entry.name,
                    "package": entry.requires[0] if entry.requires else "transformers"}
    return None


def inspect(job: dict, names: dict) -> dict:
    from transformers import AutoConfig

    from nnsight_repro.zoo import build

    folder = Path(job["config_dir"])
    raw = json.loads((folder / "config.json").read_text())
    package = registering_package(raw["model_type"], raw.get("auto_map"))
    config = AutoConfig.from_pretrained(str(folder))
    auto, cls, chosen_by = wrapped(config, raw.get("architectures"), job.get("automodel"))
    try:
        model = build.on_meta(cls, config)
    except Exception as exc:
        raise TreeError("build", f"{cls.__name__} cannot be built from this config: {type(exc).__name__}: "
                                 f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}") from None
    paths = module_paths(model)
    return {
        "model_type": raw["model_type"],
        "package": {"name": package, "version": version(package)} if package else None,
        "remote_code": sorted(raw.get("auto_map") or {}),
        "wrapped": {"class": cls.__name__, "automodel": auto.__name__, "chosen_by": chosen_by},
        "modules": len(paths),
        "causal_lm": causal_lm(cls, config, paths),
        **pipeline_task(cls, config),
        "collisions": collisions(model, names),
        "bfloat16": bfloat16_hazard(cls),
    }


def package_of(job: dict) -> None:
    """Import what registers the job's model_type now, before nnsight is imported: 0.7.0 mounts ``save`` on
    every object, and the typed hub classes multimolecule's imports define then refuse to be created."""
    try:
        raw = json.loads((Path(job["config_dir"]) / "config.json").read_text())
        registering_package(raw["model_type"], raw.get("auto_map"))
    except Exception:
        pass  # inspect() meets the same error and records it


def main() -> int:
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    from nnsight_repro.zoo import worker

    jobs = json.loads(sys.stdin.read())
    for job in jobs:
        package_of(job)
    line = lines.current()
    names = worker.envoy_attribute_names()
    out = {"_environment": {"line": line.name, "nnsight": version("nnsight"),
                            "transformers": version("transformers")}}
    for job in jobs:
        try:
            out[job["id"]] = inspect(job, names)
        except TreeError as exc:
            out[job["id"]] = {"error": exc.kind, "message": str(exc)}
        except Exception as exc:  # transformers refused the config: the finding, not a crash
            message = re.sub(r"\s+", " ", str(exc)).strip()[:300]
            out[job["id"]] = {"error": "config", "message": f"{type(exc).__name__}: {message}"}
    channel.send(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
