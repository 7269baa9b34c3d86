"""The probe declarations: which pairings (client x server) the probes run on, what a probe file may say,
and whether an observation matches what a probe expects.

Host-side and stdlib only (the panel names come from :mod:`nnsight_repro.models`, which imports nothing
heavy at module level). Reads and validates ``probes.toml``-style files; knows the three probe kinds
by their fields, never a single probe. Deliberately does not run anything: that is :mod:`.runner`
(the host half) and :mod:`.client` (the half inside a client environment).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Dict, List

from nnsight_repro import lines, models
from nnsight_repro.ndif.generations import PAIRINGS, Pairing


#: The pairings the probe script runs (those of :data:`nnsight_repro.ndif.generations.PAIRINGS` it probes),
#: by name.
PROBED_PAIRINGS: Dict[str, Pairing] = {p.name: p for p in PAIRINGS if p.probed}


def server_generation(pairing: str) -> str:
    declared = PROBED_PAIRINGS[pairing]
    nnsight = {"stock": "its stock nnsight", "patched": "the project's patched nnsight"}[declared.server]
    return f"local ndif {declared.generation.ndif} ({declared.line}-line stack) with {nnsight}"


KINDS = {
    "status": {"required": set(), "optional": set()},
    "env": {"required": {"packages"}, "optional": {"critical"}},
    "trace": {"required": {"model", "select", "input", "hook"}, "optional": {"requires"}},
}
COMMON = {"id", "isolates", "kind", "expect"}
#: Optional on every kind: ``expect_with.<extra>.<pairing>``, what a pairing observes when its
#: server has that extra's packages (``probe_ndif.py --with``), where it differs from ``expect``.
OPTIONAL = {"expect_with"}
MODEL_FIELDS = {"panel", "repo_id", "revision", "key"}

class ProbeFileError(Exception):
    """The probe file is malformed or contradicts itself; the message names the probe and field."""


# Loading and validating the probes --------------------------------------------------------------------

def validate_expectation(where: str, value) -> None:
    if value == "ok":
        return
    if isinstance(value, str):
        raise ProbeFileError(f"{where}: expected \"ok\" or {{error, message}}, got {value!r}")
    if not isinstance(value, dict):
        raise ProbeFileError(f"{where}: expected \"ok\" or {{error, message}}, got {type(value).__name__}")
    if value.get("status") == "ok" or value.get("ok") is True:
        # "ok" and an error in one expectation cannot both hold.
        raise ProbeFileError(f"{where} contradicts itself: it says ok and names an error {value}")
    unknown = set(value) - {"error", "message"}
    if unknown:
        raise ProbeFileError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} (allowed: error, message)")
    for field in ("error", "message"):
        if not isinstance(value.get(field), str) or not value[field]:
            raise ProbeFileError(f"{where}: an error expectation needs a non-empty {field!r}")


def validate_probe(at: int, probe) -> None:
    if not isinstance(probe, dict):
        raise ProbeFileError(f"probe #{at + 1} is not a table")
    name = f"probe {probe.get('id', f'#{at + 1}')!r}"
    kind = probe.get("kind")
    if kind not in KINDS:
        raise ProbeFileError(f"{name}: kind {kind!r} is not one of {', '.join(KINDS)}")
    allowed = COMMON | OPTIONAL | KINDS[kind]["required"] | KINDS[kind]["optional"]
    unknown = set(probe) - allowed
    if unknown:
        raise ProbeFileError(f"{name}: unknown field(s) {', '.join(sorted(unknown))} for kind {kind!r} "
                             f"(allowed: {', '.join(sorted(allowed))})")
    missing = (COMMON | KINDS[kind]["required"]) - set(probe)
    if missing:
        raise ProbeFileError(f"{name}: missing field(s) {', '.join(sorted(missing))}")
    for field in ("id", "isolates"):
        if not isinstance(probe[field], str) or not probe[field].strip():
            raise ProbeFileError(f"{name}: {field!r} must be a non-empty string")
    expect = probe["expect"]
    if not isinstance(expect, dict):
        raise ProbeFileError(f"{name}: 'expect' must map pairings to outcomes")
    unknown_pairings = set(expect) - set(PROBED_PAIRINGS)
    if unknown_pairings:
        raise ProbeFileError(f"{name}: expectation for unknown pairing(s) {', '.join(sorted(unknown_pairings))} "
                             f"(pairings: {', '.join(PROBED_PAIRINGS)})")
    missing_pairings = set(PROBED_PAIRINGS) - set(expect)
    if missing_pairings:
        raise ProbeFileError(f"{name}: no expectation for pairing(s) {', '.join(sorted(missing_pairings))}")
    for pairing, value in expect.items():
        validate_expectation(f"{name} expect.{pairing}", value)
    validate_expect_with(name, probe.get("expect_with", {}))
    if kind == "env":
        if not isinstance(probe["packages"], list) or not probe["packages"]:
            raise ProbeFileError(f"{name}: 'packages' must be a non-empty list")
        stray = set(probe.get("critical", [])) - set(probe["packages"])
        if stray:
            raise ProbeFileError(f"{name}: critical package(s) {', '.join(sorted(stray))} are not among 'packages'")
    if kind == "trace":
        validate_trace(name, probe)


def validate_expect_with(name: str, expect_with) -> None:
    from nnsight_repro.ndif import server_packages

    if not isinstance(expect_with, dict):
        raise ProbeFileError(f"{name}: 'expect_with' must map extras to {{pairing = outcome}}")
    for extra, by_pairing in expect_with.items():
        if extra not in server_packages.EXTRAS:
            raise ProbeFileError(f"{name}: expect_with.{extra}: unknown extra "
                                 f"(extras: {', '.join(server_packages.EXTRAS)})")
        if not isinstance(by_pairing, dict) or not by_pairing:
            raise ProbeFileError(f"{name}: expect_with.{extra} must map pairings to outcomes")
        unknown = set(by_pairing) - set(PROBED_PAIRINGS)
        if unknown:
            raise ProbeFileError(f"{name}: expect_with.{extra}: unknown pairing(s) {', '.join(sorted(unknown))} "
                                 f"(pairings: {', '.join(PROBED_PAIRINGS)})")
        for pairing, value in by_pairing.items():
            validate_expectation(f"{name} expect_with.{extra}.{pairing}", value)


def _installs(extra: str) -> tuple:
    from nnsight_repro.ndif import server_packages

    return server_packages.EXTRAS[extra].imports if extra in server_packages.EXTRAS else ()


def _extra_entry(probe: dict, extra: str) -> dict:
    """``probe``'s ``expect_with`` entry for ``extra``: its own, else the one named after a package it
    installs (the probes declare what a server with the package does, and ``multimolecule-patched`` has
    multimolecule too), else none."""
    declared = probe.get("expect_with", {})
    return declared.get(extra) or next((declared[m] for m in _installs(extra) if m in declared), {})


def expectation(probe: dict, pairing: str, extras=()):
    """What ``probe`` expects of ``pairing`` against a server with the packages of ``extras``: an
    extra's own expectation where it gives one (the last extra named that does), else ``expect``."""
    expected = probe["expect"][pairing]
    for extra in extras:
        expected = _extra_entry(probe, extra).get(pairing, expected)
    return expected


def depends_on_extras(probe: dict, extras) -> bool:
    """Whether a run of ``probe`` against a server with one of ``extras`` tells something a run against a
    plain server of the same line does not: it declares an outcome of its own for the extra (an entry
    counts for every pairing, also those it leaves to ``expect``: that the stock 0.7.0 client still
    fails there is what the extra's run shows of it), or it names a package the extra installs (what a
    trace ``requires``, what an env probe compares: a server with the extra has that package, a plain one not).

    Deliberately not counted: a probe that declares the same outcome everywhere and names none of the
    extra's packages, although a server with the extra imports those packages in every process that builds
    a model; an encoder traced there is left to whatever else runs on that server."""
    named = set(probe.get("requires", [])) | set(probe.get("packages", []))
    return any(_extra_entry(probe, extra) or named & set(_installs(extra)) for extra in extras)


def select(probes: List[dict], text: str) -> List[dict]:
    """The probes named in ``text`` (comma-separated ids), in the file's order; an unknown id is refused."""
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    known = [probe["id"] for probe in probes]
    unknown = [c for c in chosen if c not in known]
    if unknown or not chosen:
        raise ProbeFileError(f"unknown probe id(s) {', '.join(unknown) or '(none given)'}; "
                             f"the probe file declares: {', '.join(known)}")
    return [probe for probe in probes if probe["id"] in chosen]


def validate_trace(name: str, probe: dict) -> None:
    model = probe["model"]
    if not isinstance(model, dict) or "panel" not in model or "repo_id" not in model:
        raise ProbeFileError(f"{name}: 'model' needs 'panel' (the local stand-in) and 'repo_id'")
    unknown = set(model) - MODEL_FIELDS
    if unknown:
        raise ProbeFileError(f"{name}: unknown model field(s) {', '.join(sorted(unknown))}")
    known = models.extended()
    if model["panel"] not in known:
        raise ProbeFileError(f"{name}: panel model {model['panel']!r} is not in the panel ({', '.join(known)})")
    if model.get("key", "local") not in ("local", "hub"):
        raise ProbeFileError(f"{name}: model.key must be \"local\" or \"hub\"")
    for field in ("select", "hook"):
        if not isinstance(probe[field], dict) or set(probe[field]) != set(lines.LINES):
            raise ProbeFileError(f"{name}: {field!r} must give exactly the nnsight lines {', '.join(lines.LINES)}")
    for line_name, choice in probe["select"].items():
        # lines.py says which key field carries the model class on each line (automodel / task).
        field = lines.LINES[line_name].class_field
        if not isinstance(choice, dict) or set(choice) != {field}:
            raise ProbeFileError(f"{name}: select.{line_name} must be {{ {field} = ... }} "
                                 f"(the {line_name} line chooses the model class by {field!r})")
    for line_name, expression in probe["hook"].items():
        try:
            compile(expression, f"{name} hook.{line_name}", "eval")
        except SyntaxError as exc:
            raise ProbeFileError(f"{name}: hook.{line_name} is not an expression: {exc}") from None
    if not isinstance(probe["input"], str):
        raise ProbeFileError(f"{name}: 'input' must be a string")
    requires = probe.get("requires", [])
    if not isinstance(requires, list):
        raise ProbeFileError(f"{name}: 'requires' must be a list of package names")


def load_probes(path: Path) -> List[dict]:
    """The probes of ``path``, validated; :class:`ProbeFileError` before anything is sent."""
    try:
        with open(path, "rb") as fh:
            data = json.load(fh) if path.suffix == ".json" else tomllib.load(fh)
    except FileNotFoundError:
        raise ProbeFileError(f"no probe file at {path}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ProbeFileError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}") from None
    if not isinstance(data, dict) or set(data) != {"probe"} or not isinstance(data["probe"], list) or not data["probe"]:
        raise ProbeFileError(f"{path}: expected one or more [[probe]] tables and nothing else")
    seen = set()
    for at, probe in enumerate(data["probe"]):
        validate_probe(at, probe)
        if probe["id"] in seen:
            raise ProbeFileError(f"{path}: probe id {probe['id']!r} appears twice")
        seen.add(probe["id"])
    return data["probe"]


def parse_pairings(text: str) -> List[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [c for c in chosen if c not in PROBED_PAIRINGS]
    if unknown or not chosen:
        raise ProbeFileError(f"unknown pairing(s) {', '.join(unknown) or '(none given)'}; "
                             f"pairings: {', '.join(PROBED_PAIRINGS)}")
    return chosen


# Matching --------------------------------------------------------------------------------------------

def matches(expected, observed: dict) -> bool:
    if expected == "ok":
        return observed.get("status") == "ok"
    # The fragment matches regardless of case: ndif 0.0.1 lowercases the exception text it relays.
    return (observed.get("status") == "error" and observed.get("error") == expected["error"]
            and expected["message"].lower() in (observed.get("message") or "").lower())


def headline(observed: dict, width: int = 160) -> str:
    """One line for a table: "ok" (with the probe's note), or the error and the line of its message
    that names it (a server traceback ends with it)."""
    if observed.get("status") == "ok":
        note = (observed.get("detail") or {}).get("note")
        return f"ok ({note})"[:width] if note else "ok"
    text = [line for line in (observed.get("message") or "").strip().splitlines() if line.strip()]
    line = text[-1] if text and text[0].startswith("Traceback") else (text[0] if text else "")
    return f"{observed.get('error')}: {line}"[:width]


def describe(expected) -> str:
    return "ok" if expected == "ok" else f"{expected['error']}: …{expected['message']}…"
