"""Extras: packages added to a server, what a serving image installs, and where the server imports it.

An extra is a name given to ``ndif up --with NAME`` (:attr:`nnsight_repro.ndif.config.StackConfig.extras`).
``multimolecule``: the RNA/codon models of multimolecule 0.2.2 exist for transformers only after ``import
multimolecule`` (it registers their ``model_type`` with ``AutoConfig`` and the task Auto classes; the
checkpoints carry no ``auto_map``), so a server that rebuilds them from a model key must have the package
installed *and imported* wherever a model is built. ``multimolecule-patched``: the same release with our fix
for upstream (``patches/multimolecule-v0.2.2``) applied to the installed package, as a serving image that
carries the fix before multimolecule releases it would; it is what ERNIE-RNA needs to run in the bfloat16
NDIF loads models in (``models.PanelModel.fails_in_bfloat16``).

How, in one place:

- **installed**: the extra's pins file (``pins/ndif-server-multimolecule.txt``) is resolved together with
  the generation's own pins into a server environment of its own (``ndif-server+multimolecule``,
  ``ndif-server-0.7+multimolecule``; :mod:`nnsight_repro.ndif.server_env`), which checks that it imports. An
  extra's :attr:`Extra.series` is applied to the installed package there, before its import check.
- **imported**: every server process gets ``NNSIGHT_REPRO_NDIF_SERVER_IMPORTS`` (:func:`environ`), and the two
  kinds of process that build a model from a key call :func:`import_for_models` before they do: the
  controller (both generations size a model by building it on the meta device from its key: 0.1.2's
  evaluator through ``describe_checkpoint``, 0.0.1's through ``from_model_key``) and the model actor that
  loads it, which imports them only for a model type transformers does not know by itself. Both are ours already (``adaptations_0_1_2``, ``adaptations_0_0_1``). Not a ``.pth`` or
  ``sitecustomize`` import: that would cost every server process (Ray's dashboard, its agents, the API's
  workers) multimolecule's ~10 s and ~570 MB import, for nothing.
- **allowed in a request**: a request for an extra's model carries that model's config class
  (``multimolecule.models.rnabert.configuration_rnabert``), and ndif 0.0.1 unpickles a request under an import
  whitelist ("Module multimolecule.models.rnabert.configuration_rnabert is not whitelisted", measured): its
  adaptations add the imported packages to that whitelist, with their submodules ([A3], :func:`imported`).
  ndif 0.1.2 has no such whitelist.

Stdlib only: the host reads :data:`EXTRAS`, and server processes call :func:`import_for_models` before
anything else of theirs is imported (transformers only to tell a model actor's model type).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from ..settings import variable

#: The variable that tells a server process what to import before it builds a model (set by :func:`environ`).
IMPORTS_VARIABLE = variable("NDIF_SERVER_IMPORTS")


@dataclass(frozen=True)
class Extra:
    name: str
    #: Pins file under ``nnsight_repro/pins`` installed in the same resolution as the generation's pins.
    pins: str
    #: Top-level modules imported in every process that builds a model.
    imports: tuple
    #: A fix series (``patches/<series>``) applied to the installed package ``imports[0]``; None: as released.
    series: Optional[str] = None


EXTRAS: Dict[str, Extra] = {
    f.name: f for f in [
        Extra("multimolecule", "ndif-server-multimolecule.txt", ("multimolecule",)),
        Extra("multimolecule-patched", "ndif-server-multimolecule.txt", ("multimolecule",),
                series="multimolecule-v0.2.2"),
    ]
}

#: What every stack the test suite starts installs: with multimolecule, one stack per generation serves every
#: live check of that generation (a model that needs no package runs on it as on a plain one). ``test`` builds
#: these server environments before pytest starts.
SUITE = ("multimolecule",)


class ExtraError(ValueError):
    """An unknown extra (the message lists the known ones), or two that install the same package."""


def extras(names: Iterable[str]) -> List[Extra]:
    """The named extras, in a canonical order (so ``--with a,b`` and ``--with b,a`` are one environment)."""
    unknown = sorted(set(names) - set(EXTRAS))
    if unknown:
        raise ExtraError(f"Unknown extra(s) {', '.join(unknown)}; "
                           f"`--with` takes: {', '.join(EXTRAS)}.")
    chosen = [EXTRAS[name] for name in sorted(set(names))]
    # Two extras of one package ask for it both as released and patched, say: one venv cannot be both.
    packages = [module for extra in chosen for module in extra.imports]
    twice = sorted({module for module in packages if packages.count(module) > 1})
    if twice:
        raise ExtraError(f"Extras {', '.join(f.name for f in chosen)} each install {', '.join(twice)}; "
                           f"choose one of them.")
    return chosen


def environ(names: Iterable[str]) -> Dict[str, str]:
    """What a server process with these extras is told to import (nothing for the plain server)."""
    modules = [module for extra in extras(names) for module in extra.imports]
    return {IMPORTS_VARIABLE: ",".join(modules)} if modules else {}


def imported() -> List[str]:
    """Server side: the modules this process's extras import (from :data:`IMPORTS_VARIABLE`)."""
    return [module for module in os.environ.get(IMPORTS_VARIABLE, "").split(",") if module]


_imported: Dict[str, float] = {}


def import_for_models(model_key: Optional[str] = None) -> Dict[str, float]:
    """Server side: import what the extras' models need (once per process); ``{module: seconds}``.

    With ``model_key`` (a model actor, which builds that one model), only when transformers does not know the
    model's type by itself: an extra's package registers its own model types, and an actor that builds a BERT
    would otherwise pay multimolecule's import (some 10 s of a core) for nothing. The controller sizes every
    model it deploys, so it imports them whatever the model.

    A module that does not import raises: a server with an extra that cannot build its models must not
    start as if it could (the controller's or actor's death names the error in Ray's logs).
    """
    if model_key is not None and _transformers_knows(model_key):
        return dict(_imported)
    for module in imported():
        if module not in _imported:
            started = time.monotonic()
            importlib.import_module(module)
            _imported[module] = round(time.monotonic() - started, 2)
            print(f"[nnsight-repro] imported {module} for model builds in {_imported[module]} s "
                  f"(pid {os.getpid()})", file=sys.stderr, flush=True)
    return dict(_imported)


def _transformers_knows(model_key: str) -> bool:
    """Whether the key's checkpoint is a local folder whose ``config.json`` names a model type transformers
    registers itself; False whenever that cannot be told (the extras are imported then)."""
    try:
        repo = json.loads(model_key.split(":", 1)[1])["repo_id"]
        model_type = json.loads((Path(repo) / "config.json").read_text())["model_type"]
    except (IndexError, KeyError, OSError, TypeError, ValueError):
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES
