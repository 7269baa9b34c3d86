"""From the zoo's raw scans to ``results/zoo/zoo.json`` and ``zoo.md``: per-architecture outcomes and counts.

Stdlib only. An architecture is a model_type; its outcome in an environment
summarizes every class of it. Words used in the counts:

- *colliding*: some module of some class is named after an attribute nnsight
  serves on every envoy (``kind == "served"``: 0.7 relocates nnsight's
  attribute to ``nns_<name>``, 0.8 the submodule to ``E_<name>``) or after an
  envoy's own per-instance state (``kind == "clobbered"``: ``path``, which the
  child envoy overwrites). Names that only shadow an Envoy method
  (``kind == "shadowed"``) are listed, not counted.
- *fails* in an environment: a built class whose envoy tree does not survive
  nnsight's serializer, whose synthesized-class check fails, whose
  ``remote="local"`` trace fails in the remote stage or differs from the local
  one, or which crashed or timed out its worker. A tiny forward the scan could
  not set up (``tiny_build``/``local_trace``) is *not run*, not a failure.
- *fixed by the series* / *by 0.8.1*: colliding, fails on ``main``, passes on
  ``patched`` / ``upstream-0.8``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List

from .. import lines, provenance

SCHEMA = "nnsight-repro/zoo/2"
#: The packages of an environment block that ``provenance.versions`` lists.
VERSIONED = ("python", "nnsight", "torch", "transformers", "multimolecule")
MAIN, PATCHED, UPSTREAM = "main", "patched", "upstream-0.8"
#: In the order a reader wants the reason: the serializer's error names the bug, the class count only counts it.
NNSIGHT_CHECKS = ("serializer_round_trip", "synthesized_classes")


def unit_failures(record: dict) -> List[str]:
    """Why this class fails in this environment (empty: it passes or was not built)."""
    if "crash" in record:
        return [f"{record['crash']['kind']}: {record['crash']['reason']}"]
    if not record.get("build", {}).get("ok"):
        return []
    found = [f"{check}: {why(record.get(check, {}))}" for check in NNSIGHT_CHECKS if not record.get(check, {}).get("ok")]
    remote = record.get("remote_local")
    if remote and remote.get("ok") is False and remote.get("stage") in ("remote_trace", "compare"):
        found.append(f"remote_local: {remote.get('error', 'differs from the local trace')} {remote.get('message', '')}".strip())
    return found


def why(result: dict) -> str:
    if result.get("error"):
        return f"{result['error']} {result.get('message', '')}".strip()
    if "reason" in result:
        return result["reason"]
    # The round trip loaded without an error, into a different tree.
    return "loads, but the envoy tree's paths or classes differ from the original"


def served_collisions(record: dict) -> List[dict]:
    return [c for c in record.get("collisions", []) if c["kind"] == "served"]



def architecture(model_type: str, units: List[dict], scans: Dict[str, dict]) -> dict:
    """One architecture's outcome per environment, from the records of all its classes."""
    per_env = {}
    for env_name, scan in scans.items():
        records = [scan["records"].get(u["id"], {"id": u["id"], "crash": {"kind": "missing", "reason": "no record"}})
                   for u in units]
        failures = {r["id"]: unit_failures(r) for r in records if unit_failures(r)}
        unbuilt = {r["id"]: f"{r['build'].get('error')}: {r['build'].get('message')}" for r in records
                   if "crash" not in r and not r["build"]["ok"]}
        remote = [r.get("remote_local") for r in records if r.get("remote_local")]
        per_env[env_name] = {
            "built": len(records) - len(unbuilt) - sum("crash" in r for r in records),
            "unbuildable": unbuilt,
            "served_names": sorted({c["name"] for r in records for c in served_collisions(r)}),
            "clobbered_names": sorted({c["name"] for r in records for c in r.get("collisions", [])
                                       if c["kind"] == "clobbered"}),
            "shadowed_names": sorted({c["name"] for r in records for c in r.get("collisions", [])
                                      if c["kind"] == "shadowed"}),
            "ok": not failures and len(unbuilt) < len(records),
            "failures": failures,
            "remote_local": remote[0] if remote else None,
            "wrappers": sorted({r.get("wrapper", {}).get("name") for r in records if r.get("wrapper")}),
        }
    colliding = any(e["served_names"] or e["clobbered_names"] for e in per_env.values())
    outcome = {"model_type": model_type, "source": units[0]["source"], "classes": [u["model_class"] for u in units],
               "representative": next(u["model_class"] for u in units if u["representative"]),
               "colliding": colliding, "envs": per_env}
    built = any(e["built"] for e in per_env.values())
    outcome["buildable"] = built
    ok = {name: e["ok"] for name, e in per_env.items()}
    outcome["fixed_by_series"] = colliding and ok.get(MAIN) is False and ok.get(PATCHED) is True
    outcome["fixed_by_0_8_1"] = colliding and ok.get(MAIN) is False and ok.get(UPSTREAM) is True
    outcome["failing_in"] = sorted(name for name, e in per_env.items() if built and not e["ok"])
    return outcome


def call_sites(units: List[dict], scans: Dict[str, dict]) -> List[dict]:
    """Every relocated submodule path (layers as N) and how a user reaches both things on each line.

    The 0.7 spelling is read from ``patched``'s records, the 0.8 one from
    ``upstream-0.8``'s: a name 0.7 relocates may only shadow a method on 0.8.
    """
    sites: Dict[tuple, dict] = {}
    reference = scans.get(PATCHED) or next(iter(scans.values()))
    upstream = scans.get(UPSTREAM, {}).get("records", {})
    for unit in units:
        record = reference["records"].get(unit["id"], {})
        kinds_08 = {c["path"]: c["kind"] for c in upstream.get(unit["id"], {}).get("collisions", [])}
        for c in served_collisions(record):
            parent, _, name = c["pattern"].rpartition(".")
            if kinds_08.get(c["path"]) == "served":
                new = {"nnsight_value": f"{parent}.{name}",
                       "submodule": f"{parent}.{lines.LINES['0.8'].moved_prefix}{name}"}
            else:
                new = {"nnsight_value": None, "submodule": c["pattern"],
                       "note": f"0.8.1 keeps the submodule at .{name}; it hides Envoy.{name} on this envoy"}
            site = sites.setdefault((unit["model_type"], c["pattern"]), {
                "model_type": unit["model_type"], "source": unit["source"], "pattern": c["pattern"],
                "name": name, "parent": parent, "classes": [],
                "0.7+series": {"nnsight_value": f"{parent}.{lines.LINES['0.7'].moved_prefix}{name}",
                               "submodule": c["pattern"]},
                "0.8": new,
            })
            if unit["model_class"] not in site["classes"]:
                site["classes"].append(unit["model_class"])
    return sorted(sites.values(), key=lambda s: (s["source"], s["model_type"], s["pattern"]))


def explain_patched_failures(archs: List[dict], scans: Dict[str, dict]) -> List[dict]:
    """For each colliding architecture failing on patched, what its own records say the cause is."""
    if PATCHED not in scans:
        return []
    explained = []
    for a in archs:
        if not (a["colliding"] and PATCHED in a["failing_in"]):
            continue
        causes = []
        for unit_id in a["envs"][PATCHED]["failures"]:
            record = scans[PATCHED]["records"][unit_id]
            if "crash" in record:
                causes.append(f"{unit_id}: {record['crash']['kind']} ({record['crash']['reason']})")
                continue
            clobbered = [c["path"] for c in record.get("collisions", []) if c["kind"] == "clobbered"]
            if clobbered:
                names = sorted({p.rsplit(".", 1)[-1] for p in clobbered})
                causes.append(f"{unit_id}: submodules named {', '.join(names)} ({len(clobbered)}, e.g. "
                              f"`{clobbered[0]}`) overwrite the envoy's own per-instance attribute of that name, "
                              f"so the loaded tree differs (shown alone by `python -m nnsight_repro.zoo.minimal_trees`); "
                              f"the series relocates only names the Envoy class serves, and 0.8.1 " + ("fails the same way" if UPSTREAM in a["failing_in"]
                                                       else "passes"))
            synthesized = record.get("synthesized_classes", {})
            if synthesized.get("count", 0) > 1:
                # module.qualname; the synthesized qualnames themselves have dots (Envoy.Preserved).
                names = synthesized.get("classes", [])
                chained = [n for n in names if n.count("Preserved") > 1]
                how = (f"{', '.join(chained)} is chained on another synthesized class because one module has "
                       f"two colliding children" if chained else
                       "one class per colliding name, as the series designs it (one per base class and mount "
                       "point)")
                causes.append(f"{unit_id}: {synthesized['count']} synthesized classes ({', '.join(names)}): {how}; "
                              f"the check's 'at most one' assumes a single colliding name. "
                              + ("The round trip passes." if record.get("serializer_round_trip", {}).get("ok")
                                 else "The round trip fails (see above)."))
            if not causes or not causes[-1].startswith(unit_id):
                causes.append(f"{unit_id}: " + "; ".join(a["envs"][PATCHED]["failures"][unit_id]))
        explained.append({"model_type": a["model_type"], "causes": causes})
    return explained


def counts(archs: List[dict], units: List[dict], scans: Dict[str, dict]) -> dict:
    colliding = [a for a in archs if a["colliding"]]
    failing_patched = [a["model_type"] for a in colliding if PATCHED in a["failing_in"]]
    crashes = {env: sorted(i for i, r in scan["records"].items() if "crash" in r) for env, scan in scans.items()}
    return {
        "architectures": len(archs),
        "classes": len(units),
        "unbuildable_architectures": sum(not a["buildable"] for a in archs),
        "unbuildable_classes": len({i for s in scans.values() for i, r in s["records"].items()
                                    if "crash" not in r and not r["build"]["ok"]}),
        "colliding": len(colliding),
        "colliding_by_source": {src: sum(a["source"] == src for a in colliding)
                                for src in sorted({a["source"] for a in archs})},
        "colliding_failing_on_main": sum(MAIN in a["failing_in"] for a in colliding),
        "fixed_by_series": sum(a["fixed_by_series"] for a in colliding),
        "fixed_by_0_8_1": sum(a["fixed_by_0_8_1"] for a in colliding),
        "failing_on_patched_colliding": len(failing_patched),
        "failing_on_patched_colliding_list": failing_patched,
        "failing_anywhere": {env: sorted(a["model_type"] for a in archs if env in a["failing_in"])
                             for env in scans},
        "crashes_or_timeouts": crashes,
        "worker_restarts": {env: scan["restarts"] for env, scan in scans.items()},
    }


def report(scanned: dict, command: str) -> dict:
    units, scans = scanned["units"], scanned["scans"]
    # Keyed by source too: multimolecule and transformers both ship an ``esmc``.
    by_type: Dict[tuple, List[dict]] = {}
    for unit in units:
        by_type.setdefault((unit["source"], unit["model_type"]), []).append(unit)
    archs = sorted((architecture(t, us, scans) for (_, t), us in by_type.items()),
                   key=lambda a: (a["source"], a["model_type"]))
    environments = {env: {k: v for k, v in scan["environment"].items() if k != "envoy_attributes"}
                    for env, scan in scans.items()}
    envoy_attributes = {env: scan["environment"].get("envoy_attributes", {}) for env, scan in scans.items()}
    return {
        "schema": SCHEMA,
        "provenance": provenance.record(
            command, versions={env: {k: v[k] for k in VERSIONED if k in v} for env, v in environments.items()},
            details={"subset": scanned["subset"], "scan_started": provenance.date(scanned["started"]),
                     "duration_seconds": scanned["seconds"]}),
        "environments": environments,
        "envoy_attributes": envoy_attributes,
        "counts": counts(archs, units, scans),
        "failing_on_patched_explained": explain_patched_failures(archs, scans),
        "architectures": archs,
        "call_sites": call_sites(units, scans),
        "config_types_without_model_class": scanned["config_types_without_model_class"],
        "units": units,
        "restarts": {env: scan["restarts"] for env, scan in scans.items()},
        "records": {env: [scan["records"][u["id"]] for u in units if u["id"] in scan["records"]]
                    for env, scan in scans.items()},
    }


def cell(env: dict, built: bool) -> str:
    if not built:
        return "not built"
    if env["ok"]:
        remote = env["remote_local"]
        if remote and remote.get("ok") is True:
            return "ok (remote=local ok)"
        return "ok"
    first = next(iter(env["failures"].values()))[0]
    return f"FAIL ({len(env['failures'])}): {first[:90]}"


def markdown(rep: dict) -> str:
    c, p = rep["counts"], rep["provenance"]
    # A re-rendered report's scan is described by the provenance of the run that scanned.
    scan = p["details"].get("records_from", p)
    d = scan.get("details", scan)
    envs = list(rep["environments"])
    out = [
        "# Zoo audit: which architectures collide with nnsight's Envoy attributes, per environment",
        "",
        f"Written by `{p['command']}` on {p['host']} at {p['date']}"
        + (f" from the records of `{scan['command']}` ({scan['date']})" if scan is not p else "")
        + f", a scan of {d['duration_seconds']:.0f} s (subset `{d['subset']}`). Versions: " + "; ".join(
            f"{e}: nnsight {v.get('nnsight')}, transformers {v.get('transformers')}, "
            f"multimolecule {v.get('multimolecule')}" for e, v in rep["environments"].items()) + ".",
        "",
        "Definitions (colliding, fails, fixed) are in `nnsight_repro/zoo/report.py`; the records in `zoo.json`.",
        "",
        "| count | |",
        "|---|---|",
        f"| architectures (model_types) scanned | {c['architectures']} ({c['classes']} classes) |",
        f"| cannot be built at all | {c['unbuildable_architectures']} architectures, {c['unbuildable_classes']} classes |",
        f"| colliding | {c['colliding']} ({', '.join(f'{k}: {v}' for k, v in c['colliding_by_source'].items())}) |",
        f"| colliding and failing on main | {c['colliding_failing_on_main']} |",
        f"| fixed by the series (patched) | {c['fixed_by_series']} |",
        f"| fixed by 0.8.1 | {c['fixed_by_0_8_1']} |",
        f"| colliding and failing on patched | {c['failing_on_patched_colliding']} "
        f"{', '.join(c['failing_on_patched_colliding_list'])} |",
    ]
    for env in envs:
        failing = c["failing_anywhere"].get(env, [])
        out.append(f"| failing on {env} (any reason) | {len(failing)} |")
    for env in envs:
        out.append(f"| crashes/timeouts on {env} | {len(c['crashes_or_timeouts'][env])} "
                   f"{', '.join(c['crashes_or_timeouts'][env])} |")
    out += ["", "| family | architecture | classes | colliding names | " + " | ".join(envs) + " |",
            "|---|---|---|---|" + "---|" * len(envs)]
    for a in rep["architectures"]:
        names = sorted({n for e in a["envs"].values() for n in e["served_names"]}) + sorted(
            {f"{n} (clobbered)" for e in a["envs"].values() for n in e["clobbered_names"]})
        unbuilt = not a["buildable"]
        note = ""
        if unbuilt:
            reasons = {r for e in a["envs"].values() for r in e["unbuildable"].values()}
            note = "cannot be built: " + "; ".join(sorted(reasons))[:160]
        cells = [note if unbuilt else cell(a["envs"][e], True) for e in envs]
        out.append(f"| {a['source']} | {a['model_type']} | {len(a['classes'])} | {', '.join(names) or '-'} | "
                   + " | ".join(x.replace("|", "/") for x in cells) + " |")
    out += explained_section(rep) + failures_section(rep) + call_sites_section(rep)
    return "\n".join(out) + "\n"


def explained_section(rep: dict) -> List[str]:
    out = ["", "## Colliding architectures that fail on patched, and why (from their records)", ""]
    for item in rep.get("failing_on_patched_explained", []):
        out += [f"- `{item['model_type']}`:"] + [f"  - {cause}" for cause in item["causes"]]
    return out + ([] if rep.get("failing_on_patched_explained") else ["None."])


def failures_section(rep: dict) -> List[str]:
    """Every failing (architecture, environment) and why, one line per failing class."""
    out = ["", "## Every failure, per environment", ""]
    for env in rep["environments"]:
        failing = [a for a in rep["architectures"] if env in a["failing_in"]]
        out.append(f"**{env}**: {len(failing)} architectures" + (":" if failing else "."))
        out.append("")
        for a in failing:
            reasons = sorted({f for fs in a["envs"][env]["failures"].values() for f in fs})
            classes = len(a["envs"][env]["failures"])
            out.append(f"- `{a['model_type']}` ({classes} of {len(a['classes'])} classes): "
                       + "; ".join(r[:160].replace("|", "/") for r in reasons))
        out.append("")
    return out


def call_sites_section(rep: dict) -> List[str]:
    """The migration table for the representative class of each colliding architecture (all classes: zoo.json)."""
    representative = {(a["source"], a["model_type"]): a["representative"] for a in rep["architectures"]}
    out = ["## Call sites: colliding submodules of each architecture's representative class", "",
           "Layer indices are `N`. Every class's sites, and the classes sharing each one, are in "
           "`zoo.json` under `call_sites`.", "",
           "| architecture | class | submodule (0.7 + series) | nnsight's value (0.7 + series) | "
           "submodule (0.8.1) | nnsight's value (0.8.1) |", "|---|---|---|---|---|---|"]
    for site in rep["call_sites"]:
        chosen = representative.get((site["source"], site["model_type"]))
        if chosen not in site["classes"]:
            continue
        old, new = site["0.7+series"], site["0.8"]
        value = f"`{new['nnsight_value']}`" if new["nnsight_value"] else new["note"]
        out.append(f"| {site['model_type']} | {chosen} | `{old['submodule']}` | `{old['nnsight_value']}` | "
                   f"`{new['submodule']}` | {value} |")
    return out


def write(rep: dict, out: Path) -> None:
    (out / "zoo.json").write_text(json.dumps(rep, indent=1) + "\n")
    (out / "zoo.md").write_text(markdown(rep))


def rerender(path: Path, command: str) -> dict:
    """The report again from a zoo.json's own records (after a change to this module), provenance kept.

    Nothing is scanned: counts, tables and call sites are recomputed from the
    records the original run wrote, and ``rendered_by`` says so.
    """
    old = json.loads(path.read_text())
    scanned_by = old["provenance"].get("details", {}).get("records_from", old["provenance"])
    # Files written before nnsight_repro.provenance kept the scan's fields at the top level.
    scan = scanned_by.get("details", scanned_by)
    scans = {env: {"environment": {**old["environments"][env], "envoy_attributes": old["envoy_attributes"][env]},
                   "records": {r["id"]: r for r in old["records"][env]}, "restarts": old["counts"]["worker_restarts"][env]}
             for env in old["environments"]}
    scanned = {"subset": scan["subset"], "units": old["units"], "scans": scans, "started": time.time(),
               "seconds": scan["duration_seconds"],
               "config_types_without_model_class": old["config_types_without_model_class"]}
    rep = report(scanned, command=command)
    rep["provenance"]["details"] = {"records_from": scanned_by}
    return rep
