"""Run the check routine in several environments and turn the records into one report.

The local verify (``nnsight-repro verify``), Modal (``modal_verify_patch.py``)
and the negative control all go through here: records in, one JSON report, a
markdown table and one embedding-shift plot per model out. The comparison, the
report's inputs block, the checks on input before anything runs, and the
writing each exist once, so a report from Modal and one from this machine
cannot drift apart. Stdlib only: the checks run inside each environment, the
plots are drawn in the ``tools`` environment (:mod:`nnsight_repro.plots`).

The report (``SCHEMA``), in this key order:

- ``provenance``: :mod:`nnsight_repro.provenance`'s record; ``versions`` per environment, and
  ``details`` the runner adds (how nnsight was built, the GPU asked for);
- ``inputs``: the series' base (repo, tag, commit), the series (name, digest,
  patches) and the check routine's digest;
- ``environments``: each record's environment block (versions, whether
  nnsight's C extension loaded);
- ``outcomes``: model -> check -> environment -> ok / error / message / reason;
- ``numbers``: per model, the digest of every number per environment, and
  whether they agree; ``numbers_identical`` over all models;
- ``plots``: model -> the PNG beside the JSON;
- ``raw``: the records exactly as the check routine wrote them.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import envs, fsutil, provenance, series
from .envs import sdists
from .settings import cache_dir

SCHEMA = "nnsight-repro/verify/3"
#: The packages of an environment block that ``provenance.versions`` lists.
VERSIONED = ("python", "nnsight", "torch", "transformers", "tokenizers")

#: The files whose behaviour the check routine is; their digest is recorded with every report.
CHECK_ROUTINE_FILES = ("checks.py", "rebuild_key.py", "models.py", "lines.py")


# Before anything runs --------------------------------------------------------

def selection(models: Optional[Sequence[str]] = None,
              checks: Optional[Sequence[str]] = None) -> Tuple[List[str], List[str]]:
    """The models and checks to run (default: every model and every check), refused by name before any
    environment is touched."""
    from . import checks as routine

    chosen_models = routine.expand_models(list(models or [])) or list(routine.models.extended())
    chosen_checks = [c for c in (checks or []) if c] or routine.CHECKS + routine.EXTRA_CHECKS
    try:
        routine.validate(chosen_models, chosen_checks)
    except ValueError as exc:
        raise envs.EnvError(str(exc)) from None
    return chosen_models, chosen_checks


def split(names: Optional[str]) -> Optional[List[str]]:
    """``"a,b"`` -> ``["a", "b"]``; empty or None -> None (meaning: all)."""
    return [n.strip() for n in names.split(",") if n.strip()] if names else None


def check_base(series_name: str, *, repo: Optional[str] = None, tag: Optional[str] = None,
               commit: Optional[str] = None) -> series.Base:
    """Refuse a series whose base is not the one a caller pins, or that does not apply to it.

    ``repo``/``tag``/``commit`` are what a caller builds from (Modal pins them in
    its image). The series is applied with ``git am`` to the released sdist of its
    base, once per (series digest, sdist); later calls read a marker. Raises
    ``SeriesError`` naming what to fix, before any environment is built or run.
    """
    base = series.base(series_name)
    for label, pinned, named in [("repository", repo, base.repo), ("tag", tag, base.tag),
                                 ("commit", commit, base.commit)]:
        if pinned is not None and pinned != named:
            raise series.SeriesError(
                f"The base {label} this build pins is {pinned}, but patches/{series_name}/series names "
                f"{base.describe()}. Pin the series' base, or re-cut the series onto {pinned}.")
    spec = _spec_applying(series_name)
    archive_sha = spec.sdist_sha256
    marker = cache_dir() / "base-check" / f"{series_name}-{series.digest(series_name)[:16]}-{archive_sha[:16]}.ok"
    if not marker.is_file():
        series.am_onto_tree(series_name, base_tree(series_name))
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"git am of patches/{series_name} onto {base.describe()} succeeded\n")
    return base


def _spec_applying(series_name: str) -> envs.Spec:
    for spec in envs.SPECS.values():
        if spec.series == series_name:
            return spec
    raise series.SeriesError(f"No environment applies the series {series_name!r}; "
                             f"known: {', '.join(s.series for s in envs.SPECS.values() if s.series)}.")


def base_tree(series_name: str) -> Path:
    """The released sdist of the series' base, extracted once into the cache (hash-checked by ``sdists.sdist``)."""
    spec = _spec_applying(series_name)
    return sdists.tree(spec.nnsight, spec.sdist_sha256)


# Running the routine ---------------------------------------------------------

def record_in(env: envs.Env, models: Optional[List[str]] = None, checks: Optional[List[str]] = None) -> dict:
    """The check routine's JSON record from inside ``env`` (local cache or a Modal image alike)."""
    args = ["-m", "nnsight_repro.checks"]
    if models:
        args += ["--models", ",".join(models)]
    if checks:
        args += ["--checks", ",".join(checks)]
    return env.run_one(args, doing="the check routine", timeout=1800)


def record(env_name: str, models: Optional[List[str]] = None, checks: Optional[List[str]] = None) -> dict:
    """The check routine's JSON record from inside the cached environment ``env_name`` (which must be built)."""
    return record_in(envs.ensure(env_name, build=False), models, checks)


def records(env_names: List[str], models: List[str], checks: List[str]) -> Tuple[Dict[str, dict], Dict[str, str]]:
    """The check routine's records from each environment; one whose routine fails is recorded as failing
    every check, so the report of the others is still written. Returns (records, {env: why it failed})."""
    recs: Dict[str, dict] = {}
    failed: Dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(record, name, models, checks) for name in env_names}
        for name, future in futures.items():
            try:
                recs[name] = future.result()
            except Exception as exc:
                failed[name] = str(exc)
                outcome = {"ok": False, "error": "EnvironmentFailed", "message": str(exc).splitlines()[0][:300]}
                recs[name] = {"environment": {"env": name, "failed": str(exc)[-3000:]},
                              "models": {m: {c: dict(outcome) for c in checks} for m in models}}
    return recs, failed


# The comparison --------------------------------------------------------------

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


# The report ------------------------------------------------------------------

def check_routine_digest(package: Path = Path(__file__).resolve().parent) -> str:
    """sha256 over the check routine's files, each name and content separated, in ``CHECK_ROUTINE_FILES`` order."""
    h = hashlib.sha256()
    for name in CHECK_ROUTINE_FILES:
        h.update(name.encode() + b"\0" + (package / name).read_bytes() + b"\0")
    return h.hexdigest()


def inputs(series_name: str, routine_digest: Optional[str] = None) -> dict:
    base = series.base(series_name)
    return {
        "base": {"repo": base.repo, "tag": base.tag, "commit": base.commit},
        "series": {"name": series_name, "digest": series.digest(series_name),
                   "patches": [p.name for p in series.patches(series_name)]},
        "check_routine": {"digest": routine_digest or check_routine_digest(), "files": list(CHECK_ROUTINE_FILES)},
    }


def report(recs: Dict[str, dict], *, argv: List[str], runner: str, series_name: str,
           routine_digest: Optional[str] = None, where: Optional[dict] = None,
           details: Optional[dict] = None) -> dict:
    """The whole report from the records; the one function the local verify and Modal both call."""
    compared = compare(recs)
    return {
        "schema": compared["schema"],
        "provenance": provenance.record(" ".join(argv), runner=runner, where=where, details=details,
                                        versions={name: {k: env[k] for k in VERSIONED if k in env}
                                                  for name, env in compared["environments"].items()}),
        "inputs": inputs(series_name, routine_digest),
        **{k: v for k, v in compared.items() if k != "schema"},
    }


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


def write(report: dict, out_dir: Path, stem: str) -> Path:
    """JSON and markdown side by side (each written to a temporary name first, then renamed), then the plots."""
    from . import plots

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {k: v for k, v in report.items() if k not in ("plots", "raw")} | {
        "plots": plots.file_names(report, stem), "raw": report["raw"]}
    target = out_dir / f"{stem}.json"
    for path, text in [(target, json.dumps(report, indent=1, sort_keys=False)),
                       (out_dir / f"{stem}.md", _md_with_provenance(report))]:
        fsutil.write_text(path, text)
    plots.draw_beside(target)
    return target


def _md_with_provenance(report: dict) -> str:
    p, i = report["provenance"], report["inputs"]
    versions = ["| environment | nnsight | C extension | torch | transformers | python |", "|---|---|---|---|---|---|"]
    versions += [f"| {e} | FAILED: the check routine did not run (see the JSON) | | | | |" if v.get("failed") else
                 f"| {e} | {v['nnsight']} | {'present' if v.get('nnsight_c_extension') else 'absent'} | "
                 f"{v['torch']} | {v['transformers']} | {v['python']} |" for e, v in report["environments"].items()]
    details = "".join(f"- {k}: {json.dumps(v) if not isinstance(v, str) else v}\n" for k, v in p["details"].items())
    where = p["machine"]
    plot_lines = "".join(f"![{model}]({name})\n\n" for model, name in report.get("plots", {}).items())
    return (f"# Verify: check routine across environments\n\n"
            f"Made by `{p['command']}` ({p['runner']}) on {p['host']} at {p['date']}; checks ran on "
            f"{where['hostname']} ({where['cpu']}, {where['cpus']} CPUs"
            f"{', GPUs: ' + '; '.join(where['gpus']) if where['gpus'] else ''}).\n\n"
            f"- base: {i['base']['repo']} {i['base']['tag']} `{i['base']['commit']}`\n"
            f"- series {i['series']['name']}: digest `{i['series']['digest']}` ({len(i['series']['patches'])} patches)\n"
            f"- check routine ({', '.join(i['check_routine']['files'])}): digest `{i['check_routine']['digest']}`\n"
            + details + "\n" + "\n".join(versions) + "\n\n" + markdown(report) + "\n" + plot_lines)


# The local verify ------------------------------------------------------------

def main(args) -> int:
    names = args.envs.split(",")
    specs = [envs.spec(name) for name in names]  # unknown environment: error before building anything
    models, checks = selection(split(args.models), split(args.checks))
    for s in specs:
        if getattr(s, "series", None):
            check_base(s.series)
    envs.ensure_all([*names, "tools"])
    started = time.monotonic()
    recs, failed = records(names, models, checks)
    applied = next((s.series for s in specs if getattr(s, "series", None)), envs.spec("patched").series)
    details = {
        "nnsight_source": {s.name: f"nnsight-{s.nnsight}.tar.gz (sha256 {s.sdist_sha256})"
                                   + (f" + git apply of patches/{s.series}" if s.series else "")
                           for s in specs},
        "check_seconds": round(time.monotonic() - started, 1),
    }
    rep = report(recs, argv=["python3 -m nnsight_repro", *sys.argv[1:]], runner="local",
                 series_name=applied, details=details)
    stem = "local-" + provenance.stamp()
    path = write(rep, Path(args.out), stem)
    print(markdown(rep))
    print(f"wrote {path}, {path.with_suffix('.md')} and {len(plots_of(path))} plots beside them")
    for name, why in failed.items():
        print(f"error: the check routine failed in {name!r}; its checks are recorded as failed:\n{why}",
              file=sys.stderr)
    return 1 if failed else 0


def plots_of(report_json: Path) -> List[Path]:
    written = json.loads(Path(report_json).read_text()).get("plots", {})
    return [Path(report_json).parent / name for name in written.values()]
