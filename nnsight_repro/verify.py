"""Run the check routine in several environments and compare what they recorded.

The same comparison serves the local verify (``nnsight-repro verify``), the
negative control in the suite and Modal: records in, one JSON report and one
markdown table out. Stdlib only; the checks themselves run inside each
environment.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

from . import envs

SCHEMA = "nnsight-repro/verify/1"


def record(env_name: str, models: Optional[List[str]] = None, checks: Optional[List[str]] = None) -> dict:
    """The check routine's JSON record from inside ``env_name`` (which must be built)."""
    env = envs.ensure(env_name, build=False)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "record.json"
        args = ["-m", "nnsight_repro.checks", "--out", str(out)]
        if models:
            args += ["--models", ",".join(models)]
        if checks:
            args += ["--checks", ",".join(checks)]
        result = env.run(args, timeout=1800)
        if result.returncode or not out.is_file():
            raise RuntimeError(f"the check routine failed in {env_name!r} (exit {result.returncode}):\n"
                               f"{result.stderr.strip()[-3000:]}")
        return json.loads(out.read_text())


def records(env_names: List[str], models=None, checks=None) -> Dict[str, dict]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(record, name, models, checks) for name in env_names}
        return {name: future.result() for name, future in futures.items()}


def compare(recs: Dict[str, dict]) -> dict:
    """Check outcomes side by side, and whether every number agrees across environments."""
    env_names = list(recs)
    model_names = list(next(iter(recs.values()))["models"])
    outcomes: Dict[str, Dict[str, Dict[str, dict]]] = {}
    numbers: Dict[str, dict] = {}
    for model in model_names:
        per_check = {}
        for check in next(iter(recs.values()))["models"][model]:
            per_check[check] = {}
            for env in env_names:
                result = recs[env]["models"][model].get(check, {"ok": False, "error": "NotRun"})
                per_check[check][env] = {k: result[k] for k in ("ok", "error", "message", "reason") if k in result}
        outcomes[model] = per_check
        numbers[model] = _numbers(model, recs)
    return {
        "schema": SCHEMA,
        "environments": {env: rec["environment"] for env, rec in recs.items()},
        "outcomes": outcomes,
        "numbers": numbers,
        "numbers_identical": all(n["identical"] for n in numbers.values()),
        "raw": recs,
    }


def _numbers(model: str, recs: Dict[str, dict]) -> dict:
    """Digests of every number a check produced, per environment; identical where all produced them."""
    seen: Dict[str, Dict[str, str]] = {}
    for env, rec in recs.items():
        results = rec["models"][model]
        shift = results.get("embedding_shift", {})
        if shift.get("ok"):
            seen.setdefault("embedding_shift", {})[env] = shift["digest"]
        remote = results.get("remote_local", {})
        for label in ("first_layer", "final_hidden"):
            if isinstance(remote.get(label), dict):
                seen.setdefault(f"remote_local.{label}", {})[env] = remote[label]["digest"]
    identical = all(len(set(per_env.values())) == 1 for per_env in seen.values())
    return {"digests": seen, "identical": identical}


def markdown(report: dict) -> str:
    envs_ = list(report["environments"])
    lines = [
        "| model | check | " + " | ".join(envs_) + " |",
        "|---|---|" + "---|" * len(envs_),
    ]
    for model, per_check in report["outcomes"].items():
        for check, per_env in per_check.items():
            cells = ["✓" if per_env[e]["ok"] else
                     f"✗ {per_env[e].get('error') or per_env[e].get('reason', '')}".strip() for e in envs_]
            lines.append(f"| {model} | {check} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Numbers identical across environments: **{'yes' if report['numbers_identical'] else 'NO'}**")
    for model, n in report["numbers"].items():
        for name, per_env in n["digests"].items():
            lines.append(f"- {model} {name}: " + ", ".join(f"{e} `{d}`" for e, d in per_env.items()))
    return "\n".join(lines) + "\n"


def provenance(argv: List[str]) -> dict:
    return {
        "command": " ".join(argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "runner": "local",
    }


def write(report: dict, out_dir: Path, stem: str) -> Path:
    """JSON and markdown side by side; each written to a temporary name first, then renamed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{stem}.json"
    for path, text in [(target, json.dumps(report, indent=1, sort_keys=False)),
                       (out_dir / f"{stem}.md", _md_with_provenance(report))]:
        staging = path.with_name(f".{path.name}.tmp")
        staging.write_text(text)
        os.replace(staging, path)
    return target


def _md_with_provenance(report: dict) -> str:
    p = report.get("provenance", {})
    versions = "; ".join(f"{e}: nnsight {v['nnsight']}, torch {v['torch']}, transformers {v['transformers']}"
                         for e, v in report["environments"].items())
    return (f"# Verify: check routine across environments\n\n"
            f"Made by `{p.get('command', '?')}` on {p.get('host', '?')} at {p.get('date', '?')}.\n"
            f"Versions: {versions}.\n\n" + markdown(report))


def main(args) -> int:
    names = args.envs.split(",")
    for name in names:
        envs.spec(name)  # unknown environment: error before building anything
    models = args.models.split(",") if args.models else None
    checks = args.checks.split(",") if args.checks else None
    _validate(models, checks)
    for name in names:
        envs.ensure(name)
    report = compare(records(names, models, checks))
    report["provenance"] = provenance(["python3 -m nnsight_repro", *sys.argv[1:]])
    stem = "local-" + time.strftime("%Y%m%d-%H%M%S")
    path = write(report, Path(args.out), stem)
    print(markdown(report))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


def _validate(models, checks) -> None:
    """Unknown names are rejected here, before any environment is built or run."""
    from . import checks as routine

    try:
        routine.validate(models or list(routine.models.PANEL), checks or routine.CHECKS)
    except ValueError as exc:
        raise envs.EnvError(str(exc)) from None
