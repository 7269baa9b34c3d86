"""Evidence for upstream's two review questions on the overloaded-mount fix.

Upstream moved BERT's colliding submodule to ``E_output`` (0.8) and asked:
(a) does ``E_`` read right at a call site, and (b) does anything count on the
submodule answering to the plain name? This module measures instead of
arguing, in two parts:

- ``probes``: run inside an environment (``python -m nnsight_repro.review
  probes``), it records what each spelling does on the tiny BERT of the panel
  and on small toy modules for the nnsight it imports: attribute access in and
  out of a trace, path-based lookups (``get``, ``named_modules``, ``rename``),
  error messages, and which child names collide at all. Every entry is an
  observed value or an exception's type and first line, never an expectation.
- ``scan``: a static pass (``ast``, nothing imported) over a transformers
  ``models/`` tree that lists every class assigning a submodule to a name
  nnsight serves, and every place model code reaches such a child by
  attribute (``self.output(...)``, ``layer.attention.output.dense``). Model
  code runs on torch modules, which nnsight never renames, so these places are
  unaffected on either line; the scan says how many there are and where.

``patches/REVIEW.md`` quotes both, naming the command each number came from.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List

#: Names nnsight serves on every envoy, by line: 0.8 moves a child whose name
#: is a data descriptor of Envoy; 0.7 moves one whose name is any attribute of
#: Envoy (``hasattr``), methods included. ``probes`` re-derives both from the
#: Envoy it imports and records them, so these are only the scan's input.
SERVED_08 = ["device", "devices", "input", "inputs", "iter", "output", "parent", "root", "source"]
SERVED_07 = ["all", "clear_edits", "cpu", "cuda", "device", "devices", "edit", "export_edits", "get",
             "import_edits", "input", "inputs", "interleave", "interleaving", "iter", "modules",
             "named_modules", "next", "output", "scan", "session", "skip", "source", "to", "trace"]


def _outcome(fn) -> str:
    """What ``fn()`` did: the value's description, or the exception's type and first line."""
    try:
        value = fn()
    except Exception as exc:  # recorded, not raised: the probe is the observation
        lines = [l.strip() for l in str(exc).strip().splitlines() if l.strip()]
        # 0.7 wraps errors from a trace with the whole traceback; its last line is the error.
        first = (lines[-1] if lines[0].startswith("Traceback") else lines[0]) if lines else ""
        return f"raises {type(exc).__name__}: {first[:200]}"
    return _describe(value)


def _describe(value) -> str:
    from nnsight.intervention.envoy import Envoy

    if isinstance(value, Envoy):
        return f"{type(value).__name__} at {value.path} ({type(value._module).__name__})"
    if hasattr(value, "shape"):
        return f"tensor {list(value.shape)}"
    if isinstance(value, tuple):
        return "tuple(" + ", ".join(_describe(v) for v in value[:2]) + (", ..." if len(value) > 2 else "") + ")"
    return repr(value)[:200]


def served_names() -> Dict[str, List[str]]:
    """The child names this nnsight moves, derived from its Envoy the way its wrapper decides."""
    import inspect

    from nnsight.intervention.envoy import Envoy

    public = [n for n in dir(Envoy) if not n.startswith("_")]
    return {
        "data_descriptors": sorted(n for n in public if inspect.isdatadescriptor(getattr(Envoy, n, None))),
        "any_attribute": sorted(n for n in public if hasattr(Envoy, n)),
    }


def probes() -> dict:
    import torch
    from nnsight import NNsight

    from . import lines, models

    line = lines.current()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    bert = models.build_model(models.get("bert-mlm"))
    wrapper = NNsight(bert)
    layer = wrapper.bert.encoder.layer[0]
    value_attr = line.output_attr(layer)
    child_attr = line.child_attr()
    ids = torch.tensor([[2, 5, 6, 7, 3]])
    record: dict = {"line": line.name, "served_names": served_names(),
                    "value_attr": value_attr, "child_attr": child_attr}

    outside = {
        f"layer.{child_attr}": lambda: getattr(layer, child_attr),
        f"layer.{value_attr}": lambda: getattr(layer, value_attr),
        "layer.output.dense": lambda: layer.output.dense,
        f"layer.{child_attr}.dense.weight.shape": lambda: tuple(getattr(layer, child_attr).dense.weight.shape),
        "hasattr(layer, 'E_output')": lambda: hasattr(layer, "E_output"),
        "hasattr(layer, 'nns_output')": lambda: hasattr(layer, "nns_output"),
        "torch layer.output": lambda: type(bert.bert.encoder.layer[0].output).__name__,
    }
    record["outside_trace"] = {k: _outcome(f) for k, f in outside.items()}

    inside = {}
    with wrapper.trace(ids):
        # The child returns before its parent does: read in execution order.
        child_value = getattr(layer, child_attr).output.save()
        value = getattr(layer, value_attr).save()
    inside[f"layer.{value_attr} (saved)"] = _describe(value)
    inside[f"layer.{child_attr}.output (saved)"] = _describe(child_value)
    inside["the two are equal"] = repr(bool(torch.equal(value, child_value)))

    # No `return` inside a traced block: 0.7 runs the block's source apart
    # and waits forever for a value a returned-from block never asks for.
    def dense_inside():
        with wrapper.trace(ids):
            dense = layer.output.dense.output.save()
        return dense

    inside["layer.output.dense.output"] = _outcome(dense_inside)

    def out_of_order():
        with wrapper.trace(ids):
            later = getattr(layer, value_attr).save()
            earlier = getattr(layer.attention, line.output_attr(layer.attention)).save()
        return later, earlier

    inside["layer value, then attention value (out of order)"] = _outcome(out_of_order)

    def set_plain():
        with wrapper.trace(ids):
            layer.output = torch.zeros(1, 5, 32)
            after = getattr(wrapper.bert.encoder.layer[1], value_attr).save()
        return after

    inside["assign layer.output = zeros"] = _outcome(set_plain)
    record["in_trace"] = inside

    record["paths"] = _path_probes(bert, wrapper, layer, child_attr)

    record["other_names"] = _other_names(line)
    return record


def _path_probes(bert, wrapper, layer, child_attr: str) -> dict:
    """How a served child is reached by path and by a rename: ``get``, ``named_modules``, ``.path``, aliases."""
    from nnsight import NNsight

    paths = {
        "get('bert.encoder.layer.0.output')": lambda: wrapper.get("bert.encoder.layer.0.output"),
        f"get('bert.encoder.layer.0.{child_attr}')": lambda: wrapper.get(f"bert.encoder.layer.0.{child_attr}"),
        "named_modules() has 'model.bert.encoder.layer.0.output'":
            lambda: _describe(dict(wrapper.named_modules()).get("model.bert.encoder.layer.0.output")),
        f"layer.{child_attr}.path": lambda: getattr(layer, child_attr).path,
        # A dotted rename key binds its alias on the root envoy.
        "NNsight(rename={'bert.encoder.layer.0.output': 'ffn'}).ffn":
            lambda: NNsight(bert, rename={"bert.encoder.layer.0.output": "ffn"}).ffn,
        f"NNsight(rename={{'bert.encoder.layer.0.{child_attr}': 'ffn'}}).ffn":
            lambda: NNsight(bert, rename={f"bert.encoder.layer.0.{child_attr}": "ffn"}).ffn,
        "NNsight(rename={'output': 'out'}) then layer.out":
            lambda: NNsight(bert, rename={"output": "out"}).bert.encoder.layer[0].out,
        "repr label": lambda: next(l.strip() for l in repr(layer).splitlines()[1:] if "Output" in l),
    }
    return {k: _outcome(f) for k, f in paths.items()}


def _other_names(line) -> dict:
    """A toy module per name: what the envoy's attribute of that name is after wrapping."""
    import torch
    from nnsight import NNsight

    found = {}
    for name in ["input", "inputs", "source", "device", "next", "skip", "to", "get", "all", "scan", "modules"]:
        block = torch.nn.Module()
        setattr(block, name, torch.nn.Linear(2, 2))
        root = torch.nn.Module()
        root.block = block
        envoy = NNsight(root).block
        moved = [a for a in (f"E_{name}", f"nns_{name}") if a in dir(envoy) or a in vars(envoy)]
        found[name] = {"attribute": _outcome(lambda: getattr(envoy, name)), "moved_to": moved}
    return found


# The static scan ----------------------------------------------------------------

_CAMEL = re.compile(r"[A-Z]\w*$")


def _callee(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_callee(node.value)}.{node.attr}"
    return type(node).__name__


def scan(models_dir: Path, names: List[str]) -> dict:
    """Classes that assign a submodule to a served name, and model code that reaches such a child by attribute."""
    names = set(names)
    assigned = []  # (family, file, class, name, callee)
    own_uses = []  # (family, file, class, name, method, line, kind)
    chained = []  # (family, file, line, expression)
    files = sorted(models_dir.glob("*/modeling_*.py"))
    trees = {}
    for path in files:
        family = path.parent.name
        tree = ast.parse(path.read_text(), filename=str(path))
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            mine = {}
            for method in [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]:
                for node in ast.walk(method):
                    if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
                        continue
                    callee = _callee(node.value.func)
                    # A submodule is built by calling a class (BertOutput(...), nn.Linear(...)).
                    if not _CAMEL.match(callee.rsplit(".", 1)[-1]):
                        continue
                    for target in node.targets:
                        if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                                and target.value.id == "self" and target.attr in names):
                            mine[target.attr] = callee
                            assigned.append((family, path.name, cls.name, target.attr, callee))
            for method in [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"]:
                for node in ast.walk(method):
                    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                            and node.value.id == "self" and node.attr in mine):
                        own_uses.append((family, path.name, cls.name, node.attr, method.name, node.lineno))
        trees[path] = tree
    # `<expr>.<name>.<attr>` where <expr> is not `self`: code outside the class
    # reaching a child by attribute (weight init, pruning, tying). Only names
    # some class assigns a submodule to: `hidden_states.device.type` is a tensor.
    submodule_names = {a[3] for a in assigned}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr in submodule_names and not (isinstance(node.value.value, ast.Name)
                                                                    and node.value.value.id == "self")):
                chained.append((path.parent.name, path.name, node.lineno, ast.unparse(node)))
    by_name = Counter(a[3] for a in assigned)
    families = defaultdict(set)
    for family, _, cls, name, _ in assigned:
        families[name].add(family)
    return {
        "models_dir": str(models_dir),
        "modeling_files": len(files),
        "families": len({p.parent.name for p in files}),
        "names_scanned": sorted(names),
        "classes_assigning_a_served_name": {name: count for name, count in sorted(by_name.items())},
        "families_with_a_class_assigning": {name: len(f) for name, f in sorted(families.items())},
        "families_by_name": {name: sorted(f) for name, f in sorted(families.items())},
        "own_forward_uses": len(own_uses),
        "own_forward_uses_by_name": dict(Counter(u[3] for u in own_uses)),
        "classes_using_own_child": len({(u[0], u[2]) for u in own_uses}),
        "chained_uses": len(chained),
        "chained_uses_by_name": dict(Counter(c[3].split(".")[-2] for c in chained)),
        "chained": [f"{c[0]}/{c[1]}:{c[2]}: {c[3]}" for c in chained],
        "own_forward_examples": [f"{u[0]}/{u[1]}:{u[5]}: {u[2]}.{u[4]} uses self.{u[3]}" for u in own_uses[:6]],
        "assigned_examples": [f"{a[0]}/{a[1]}: {a[2]}.{a[3]} = {a[4]}(...)" for a in assigned[:12]],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nnsight_repro.review", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("probes", help="what each spelling does under this interpreter's nnsight")
    s = sub.add_parser("scan", help="static scan of a transformers models/ tree")
    s.add_argument("--models-dir", help="default: this interpreter's transformers/models")
    s.add_argument("--names", default="08", choices=["07", "08"], help="which line's served names")
    args = parser.parse_args(argv)
    if args.what == "probes":
        record = probes()
    else:
        if args.models_dir:
            models_dir = Path(args.models_dir)
        else:
            import importlib.util

            models_dir = Path(importlib.util.find_spec("transformers").origin).parent / "models"
        record = scan(models_dir, SERVED_08 if args.names == "08" else SERVED_07)
    json.dump(record, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
