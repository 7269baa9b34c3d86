"""What the zoo scans: every model class transformers ships, and every multimolecule family's classes.

Runs inside an environment (it imports transformers and multimolecule).

The unit is one record per (model_type, model class). A model_type (``bert``,
``esm``, ``rnabert``) is the *architecture*: the counts and the table are per
architecture. Every class of it is scanned because a head can add a submodule
of its own (a ``pooler``, a ``generator``); the collisions of an architecture
are the union over its classes. The classes are the union of all of
transformers' Auto mappings (``modeling_auto.*_MAPPING_NAMES``): that is every
class the library makes reachable by model_type, so a class missing from it is
one no user gets from ``AutoModel*``. multimolecule registers its families
into the same Auto classes when imported; those are read from the mappings'
registered extras, tagged ``multimolecule``.

One class per architecture is its *representative* (masked LM, else causal
LM, else the base model, else the first class by name): only it gets the tiny
forward, which is what bounds the scan's time.
"""

from __future__ import annotations

from typing import Dict, List

#: Representative preference: the encoders our users study first.
ROLE_MAPPINGS = (
    ("masked_lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("causal_lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("base", "MODEL_MAPPING_NAMES"),
)


def _names(value) -> List[str]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def transformers_classes() -> Dict[str, Dict[str, str]]:
    """model_type -> {class name: role}; role is a ROLE_MAPPINGS key or 'other'."""
    from transformers.models.auto import modeling_auto

    found: Dict[str, Dict[str, str]] = {}
    mappings = [n for n in dir(modeling_auto) if n.startswith("MODEL") and n.endswith("_MAPPING_NAMES")]
    for mapping in sorted(mappings):
        for model_type, names in getattr(modeling_auto, mapping).items():
            for name in _names(names):
                found.setdefault(model_type, {}).setdefault(name, "other")
    for role, mapping in reversed(ROLE_MAPPINGS):  # the first role listed wins
        for model_type, names in getattr(modeling_auto, mapping).items():
            for name in _names(names):
                found[model_type][name] = role
    return found


def multimolecule_classes() -> Dict[str, Dict[str, str]]:
    """Families multimolecule registered into transformers' Auto classes on import."""
    import multimolecule  # noqa: F401  (its import is the registration)
    from transformers.models.auto import modeling_auto

    role_of = {id(getattr(modeling_auto, auto)._model_mapping): role for auto, role in
               (("AutoModelForMaskedLM", "masked_lm"), ("AutoModelForCausalLM", "causal_lm"), ("AutoModel", "base"))}
    found: Dict[str, Dict[str, str]] = {}
    for mapping_name in dir(modeling_auto):
        mapping = getattr(modeling_auto, mapping_name)
        for config_class, model_class in getattr(mapping, "_extra_content", {}).items():
            if not model_class.__module__.startswith("multimolecule"):
                continue
            classes = found.setdefault(config_class.model_type, {})
            role = role_of.get(id(mapping), "other")
            if classes.get(model_class.__name__, "other") == "other":
                classes[model_class.__name__] = role
    return found


def representative(classes: Dict[str, str]) -> str:
    for role, _ in ROLE_MAPPINGS:
        chosen = sorted(name for name, r in classes.items() if r == role)
        if chosen:
            return chosen[0]
    return sorted(classes)[0]


def catalog() -> List[dict]:
    """Every scan unit, sorted by source, model_type and class, with a stable id."""
    units = []
    for source, per_type in (("transformers", transformers_classes()), ("multimolecule", multimolecule_classes())):
        for model_type, classes in sorted(per_type.items()):
            chosen = representative(classes)
            for name, role in sorted(classes.items()):
                units.append({"id": f"{model_type}/{name}", "source": source, "model_type": model_type,
                              "model_class": name, "role": role, "representative": name == chosen})
    return units


def config_types_without_model_class() -> List[str]:
    """Config model_types no Auto mapping gives a class: the parts of composite models (a CLIP's text tower).

    They are listed, not scanned: their modules are scanned inside the architectures that hold them.
    """
    from transformers.models.auto import configuration_auto

    return sorted(set(configuration_auto.CONFIG_MAPPING_NAMES) - set(transformers_classes()))
