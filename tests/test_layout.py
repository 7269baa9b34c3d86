"""The package's layout rules, checked on the source: no import cycle, no subsystem spread over top-level
modules, no test that edits the import path."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nnsight_repro"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT) -> set:
    """The project modules ``path`` imports anywhere in it (a function-level import counts: a cycle through
    a lazy import is still a cycle)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, the module mod.
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m.split(".")[0] == "nnsight_repro"}


def cycles(edges: dict) -> list:
    state, found = {}, []

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                found.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def package_graph() -> dict:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_no_import_cycle_inside_the_package():
    assert cycles(package_graph()) == []


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_a_lazy_relative_import_counts(tmp_path):
    module = tmp_path / "nnsight_repro" / "ndif" / "a.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from .. import models\n    from . import stack\n")
    assert imports(module, tmp_path) >= {"nnsight_repro.models", "nnsight_repro.ndif.stack"}


def spread(names) -> dict:
    """Top-level names sharing a prefix word (``zoo_worker`` with ``zoo`` or ``zoo_report``): a subsystem."""
    groups = {}
    for name in names:
        groups.setdefault(name.split("_")[0], []).append(name)
    return {word: sorted(group) for word, group in groups.items() if len(group) > 1}


def test_no_subsystem_is_spread_over_top_level_modules():
    modules = [p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")]
    assert spread(modules + [p.parent.name for p in PACKAGE.glob("*/__init__.py")]) == {}


def test_a_subsystem_spread_over_modules_is_found():
    assert spread(["zoo", "zoo_worker", "envs", "env_versions", "checks"]) == {"zoo": ["zoo", "zoo_worker"]}


def test_no_test_edits_the_import_path():
    edits = ("sys.path." + "insert", "sys.path." + "append")
    assert [p.name for p in (ROOT / "tests").glob("*.py") if any(e in p.read_text() for e in edits)] == []
