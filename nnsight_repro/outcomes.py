"""What a remote trace of a model gives, for one client against one server: the rule, from facts of each.

Owns the rule (:func:`failures`: every failure a client meets, in the order the server meets them), the
error text a client receives for each failure where a live run recorded it, what each failure is
(:data:`BUGS`) and the one thing that removes it (:data:`FIXES`).

Two callers give it facts: ``ndif.panel.predicted`` from what each panel model declares
(:class:`nnsight_repro.models.PanelModel`) and the server (with its extra) it runs on, and ``preflight`` from a
checkpoint's module tree built on the meta device and from the server's ``/env``. The tests hold both
against the committed live runs (``tests/test_ndif_panel.py``, ``tests/test_preflight.py``).

Does not own the facts: a model's (the panel, or preflight's tree), a server's (``ndif.generations.Generation``,
``ndif.server_packages``, a host's ``/env``), which client is which (:data:`nnsight_repro.envs.SPECS`), or
what differs between nnsight lines (:mod:`nnsight_repro.lines`). Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional

from . import envs, lines
# What a stock 0.7.0 key (no ``automodel``) makes a server rebuild: LanguageModel's default automodel.
from .checks import RELEASE_AUTOMODEL
from .ndif.generations import GENERATIONS

#: What 0.7.0 raises on a server that unpickles its synthesized envoy class (the envoy bug).
HOOKED_OUTPUT = "name 'hooked_output' is not defined"
#: What a client receives when the server cannot build the model the key names (0.7 servers, ndif 0.0.1).
PROVISIONING = "error provisioning the model deployment"
#: A request that names a module (by its path under the wrapper, ``Module:model.<path>``) the model the
#: server built does not have.
UNKNOWN_MODULE = "Unknown persistent id: Module:model."

#: What each failure is, as a report says it.
BUGS = {
    "line": "a client of one nnsight line cannot talk to a server of the other (0.7 <-> 0.8)",
    "package": "the model_type exists for transformers only after its package is imported, and the server "
               "has not got it",
    "key": "the key bug (the stock key names no model class; the server rebuilds AutoModelForCausalLM)",
    "envoy": "the envoy bug (0.7.0's synthesized envoy class cannot be rebuilt: hooked_output)",
    "task": "nnsight 0.8's key names a pipeline task, and no task builds the wrapped class",
    "bfloat16": ("the model itself fails when loaded in the server's bfloat16, also without nnsight "
                 "(models.PanelModel.fails_in_bfloat16; tests/test_upstream_repros.py; the fix, for upstream: "
                 "patches/multimolecule-v0.2.2)"),
}

FIXED_CLIENT = ("use the fixed 0.7.0 client (patches/nnsight-v0.7.0; `python3 -m nnsight_repro wheel`): its key "
                "names the automodel, and its envoy class loads on a stock server")

#: The one thing to change, per failure (``str.format`` fields: ``package``, ``server_line``, ``bfloat16_fix``).
FIXES = {
    "line": "use a client of the server's line (nnsight {server_line})",
    "package": "the server must have {package} installed and imported where it builds models (its operators' "
               "change; the project's stacks: `ndif up --with {package}`)",
    # One change removes both bugs of the release.
    "key": FIXED_CLIENT,
    "envoy": FIXED_CLIENT,
    "task": "wrap it with an Auto class a pipeline task builds (AutoModel, AutoModelForMaskedLM, ...)",
    "bfloat16": "load it in float32 on the server, or serve {package} with patches/{bfloat16_fix} applied",
}


@dataclass(frozen=True)
class ModelFacts:
    """A model as a client wraps it; what the rule needs, nothing about how it was learned."""

    #: transformers class the user wraps, and the Auto class that builds it from the config.
    wrapped_class: str
    automodel: str
    #: Some envoy has a submodule named like an attribute 0.7.0 serves (``output``): 0.7.0 synthesizes a class.
    collides: bool
    #: AutoModelForCausalLM has a class for this config (BERT: BertLMHeadModel; ESM: none).
    has_causal_lm: bool
    #: Every module path of the wrapped model exists in that causal LM (a masked LM's ``bert.*`` does; a base
    #: model's root ``embeddings`` does not).
    causal_lm_keeps_paths: bool
    #: nnsight 0.8's ``task`` for ``automodel``; None: no pipeline task builds it.
    task: Optional[str] = None
    #: Packages that register the model_type with transformers (``multimolecule``).
    requires: tuple = ()
    #: What the model raises when loaded in bfloat16, and the fix series that removes it.
    fails_in_bfloat16: Optional[str] = None
    bfloat16_fix: Optional[str] = None


@dataclass(frozen=True)
class ServerFacts:
    #: The nnsight line its clients speak (a key of :data:`nnsight_repro.lines.LINES`).
    line: str
    #: The dtype it loads models in.
    dtype: str
    #: Packages installed where it builds models; None: unknown (assumed there, and a report says so).
    packages: Optional[FrozenSet[str]] = None
    #: Fix series applied to its packages (``multimolecule-v0.2.2``).
    fixes: FrozenSet[str] = frozenset()


def releases_bugs(client: str) -> bool:
    """Whether ``client`` (an environment name) is nnsight 0.7.0 as released, with the key and envoy bugs: the
    line that synthesizes envoy classes and names the class by ``automodel``, without our series."""
    spec = envs.SPECS[client]
    line = lines.LINES[spec.line]
    return line.synthesizes_classes and line.class_field == "automodel" and spec.series is None


def _fail(bug: str, message: Optional[str]) -> dict:
    return {"outcome": "fail", "bug": bug, "message": message}


def failures(model: ModelFacts, client: str, server: ServerFacts) -> List[dict]:
    """Every failure ``client`` meets with ``model`` on ``server``, first met first; ``[]``: it runs.

    Each is ``{"outcome": "fail", "bug", "message"}``, ``message`` the fragment of the error the client
    receives as a live run recorded it, or None where no run recorded one. The order is the server's: a
    client of the other line is not understood at all (and meets nothing else); a server without the
    model's package cannot build it; the stock 0.7.0 key makes the server rebuild AutoModelForCausalLM (no
    such class: it fails to provision; a class without the wrapped model's module paths: the request fails
    on the first module it names), then its synthesized envoy class fails to load (``hooked_output``);
    last, the model's own forward in the server's dtype.
    """
    line = envs.SPECS[client].line
    if server.line != line:
        return [_fail("line", None)]  # the server cannot read the request: nothing after it is met
    found = []
    missing = [p for p in model.requires if server.packages is not None and p not in server.packages]
    if missing:
        # Observed on ndif 0.0.1 (probe_ndif.py); a probe of a server that answers /env asks it first and never
        # sends the request.
        found.append(_fail("package", None if GENERATIONS[server.line].answers_env else PROVISIONING))
    if releases_bugs(client):
        if model.automodel != RELEASE_AUTOMODEL and not model.has_causal_lm:
            found.append(_fail("key", PROVISIONING))
        elif model.automodel != RELEASE_AUTOMODEL and not model.causal_lm_keeps_paths:
            found.append(_fail("key", UNKNOWN_MODULE))
        if model.collides:
            found.append(_fail("envoy", HOOKED_OUTPUT))
    if lines.LINES[line].class_field == "task" and model.task is None:
        found.append(_fail("task", None))
    if model.fails_in_bfloat16 and server.dtype == "bfloat16" and model.bfloat16_fix not in server.fixes:
        found.append(_fail("bfloat16", model.fails_in_bfloat16))
    return found


def outcome(model: ModelFacts, client: str, server: ServerFacts) -> dict:
    """The first failure :func:`failures` finds (what the client sees), or ``{"outcome": "ok"}``."""
    found = failures(model, client, server)
    return found[0] if found else {"outcome": "ok"}
