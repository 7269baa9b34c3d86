"""The whole panel on a live server: every panel model traced with ``remote=True`` on a server with a
multimolecule extra.

``python3 -m nnsight_repro ndif panel [--line 0.7|0.8] [--with multimolecule-patched] [--models a,b] [--batch N]
[--out-root DIR]`` runs, per line, every model of :func:`nnsight_repro.models.extended` (the four base models, the ten multimolecule RNA/codon
masked LMs, AntiBERTy with its packaged weights) through :mod:`remote_client`'s ``trace`` (first encoder layer
and final hidden states read) and ``write`` (the first layer's output written, the logits read, or a base
model's final hidden state) cases, each compared by the client with the same trace run locally, and writes
``results/ndif_<line>/panel.json`` and
``panel.md`` (``panel+<extra>.*`` for an extra other than :data:`DEFAULT_EXTRA`): one record per (model, pairing, trace) with ``ok``, the largest difference, the tolerance, the class
the server built (from the model actors' own records, :mod:`built_log`) and the provenance
(:func:`nnsight_repro.provenance.record`, the one record every results file carries).

Pairings (:data:`PAIRINGS`): on 0.8, nnsight 0.8.1 against ndif 0.1.2; on 0.7, the patched client against
the stock server (what the public NDIF runs), and the stock client against it as the negative control,
whose every failure is checked against what the envoy or the key bug predicts (:func:`predicted`).

Extras (:data:`EXTRAS`, ``--with``): ``multimolecule`` serves multimolecule 0.2.2 as released, so a model whose
release cannot run in the server's dtype is predicted to fail with its own error; ``multimolecule-patched``
serves it with our fix for upstream applied (``server_packages``), under which that model is predicted ``ok``.

Deployed on demand, in batches (:data:`BATCH`): each batch gets a cold stack of its own, which is brought down
before the next one comes up, so the stack never holds more than one batch's model actors (each actor is a
process with torch, nnsight and multimolecule imported; the stack's memory after every batch is recorded). On
0.8 each model of a batch is deployed through ``ndif deploy``, one at a time, so a model the server cannot build
is recorded with the server's reason and the next one still deploys; on 0.7 the server deploys a key on its
first request, and a model it cannot build fails that request with the server's reason. A model that runs the
stack out of memory (``--memory-limit`` caps it; :class:`memory_watch.MemoryWatch`) is recorded with that cause and
nothing more of its batch is deployed; a trace that failed while the kernel killed processes of the stack
carries that on its reason's last line.

Stdlib only: runs on the host; the clients and the server run in their environments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .. import ROOT, envs, fsutil, outcomes, procfs, provenance
from .. import models as panel_models
# The errors a failing record is matched against and what each failure is live in the rule's module (preflight
# predicts with the same rule); the report and the tests read them here as well.
from ..outcomes import BUGS, HOOKED_OUTPUT, PROVISIONING, UNKNOWN_MODULE  # noqa: F401
from . import (config, deploy, errors, generations, memcg, memory_watch, netns, server_env, server_packages, stack,
               stack_clients, stack_state)

#: The extras the panel's server runs with (those with multimolecule; :mod:`server_packages`); the release is the default.
EXTRAS = tuple(name for name, f in server_packages.EXTRAS.items() if "multimolecule" in f.imports)
DEFAULT_EXTRA = "multimolecule"

#: Per line, the pairings the panel runs (those of :data:`generations.PAIRINGS` with a ``panel_role``),
#: required first: their rows lead each model's. The server is always the line's stock server with a
#: multimolecule extra.
PAIRINGS: Dict[str, List[generations.Pairing]] = {
    line: sorted((p for p in g.pairings if p.panel_role), key=lambda p: p.panel_role != "required")
    for line, g in generations.GENERATIONS.items()
}

#: Tolerance of a remote value against the local float32 one, by line (the clients' ``atol``): the server
#: generation's own (generations.Generation.atol; why: generations.BF16_ATOL). Each value is judged at its
#: own magnitude (:meth:`generations.Generation.tolerance`).
ATOL = {line: g.atol for line, g in generations.GENERATIONS.items()}

#: Models per cold stack. Measured on this machine (2 cores, 24 GiB): see the report's ``batches``.
BATCH = 4

TRACES = {"read": "trace", "write": "write"}


def _say(message: str) -> None:
    print(f"[panel] {message}", file=sys.stderr, flush=True)


def cases(names: List[str], line: str) -> List[str]:
    return [f"{kind}:{name}:{ATOL[line]}" for name in names for kind in TRACES.values()]


#: Model classes whose family transformers can also build as AutoModelForCausalLM (BERT: BertLMHeadModel).
#: ESM has none, and none of the ten multimolecule families registers one (their ``__init__`` never calls
#: ``AutoModelForCausalLM.register``; in multimolecule 0.2.2 only HyenaDNA and ProGen2 do).
CAUSAL_LM_FAMILIES = ("Bert",)


def predicted(name: str, client: str, line: str, extra: str = DEFAULT_EXTRA) -> dict:
    """What a pairing of ``line`` should give for a model, from the model's declared facts and the server's
    (with ``extra``), by the one rule (:func:`nnsight_repro.outcomes.outcome`; preflight reads the same facts off a
    checkpoint instead).

    The stock 0.7 client's encoders fail on the first bug they meet. Its key carries no ``automodel`` (the
    key bug), so the server rebuilds the encoder as AutoModelForCausalLM: a family without one fails to
    provision. A BERT becomes BertLMHeadModel, a head over the base model at ``bert.``: a masked LM's modules
    are there too (``bert.*``; its ``cls`` head is BertLMHeadModel's), so its request loads as far as the
    envoy bug's ``hooked_output`` NameError (its layers have ``output`` children); a base model
    (``AutoModel``) keeps its modules at the root (``embeddings``, ``encoder``), a path the rebuilt model
    does not have, so its request fails to load on the first module it names, before any class is rebuilt
    (the key bug again). Every other pairing is ``ok``, except a model that cannot run in the dtype the
    server loads it in (``PanelModel.fails_in_bfloat16``, ``generations.Generation.dtype``) on a server whose ``extra``
    lacks its fix (``PanelModel.bfloat16_fix``): that fails on the server with the model's own error.
    """
    entry = panel_models.get(name)
    facts = outcomes.ModelFacts(
        wrapped_class=entry.model_class, automodel=entry.automodel, task=entry.task,
        collides=entry.has_output_child, has_causal_lm=entry.model_class.startswith(CAUSAL_LM_FAMILIES),
        # A head model keeps the base model under a prefix (``bert.``), as BertLMHeadModel does; a base model
        # (``AutoModel``) has its modules at the root.
        causal_lm_keeps_paths=entry.automodel != "AutoModel",
        requires=entry.requires, fails_in_bfloat16=entry.fails_in_bfloat16, bfloat16_fix=entry.bfloat16_fix)
    return outcomes.outcome(facts, client, server_facts(line, extra))


def server_facts(line: str, extra: str = DEFAULT_EXTRA) -> "outcomes.ServerFacts":
    """The local stack of ``line`` with ``extra``, as the rule sees a server: its dtype, the packages
    it imports where it builds models, and the fix series applied to them."""
    chosen = server_packages.extras([extra])
    return outcomes.ServerFacts(line=line, dtype=config.generation(line).dtype,
                                packages=frozenset(m for f in chosen for m in f.imports),
                                fixes=frozenset(f.series for f in chosen if f.series))


#: How a model actor's process shows in /proc: Ray titles an actor's worker ``ray::<class>`` (plus the method
#: it runs), and both generations' model actor is the adaptations' CPUModelActor (A9; 0.1.2's likewise).
MODEL_ACTOR_TITLE = "ray::CPUModelActor"


def stack_memory(cfg: config.StackConfig) -> dict:
    """Resident memory of every process in the stack's namespace and of each model actor among them, what
    the machine has left (MiB), and the stack's memory cgroup's counters (``cgroup``: OOM kills, peak, limit)."""
    rss, actors = 0, []
    pids = netns.pids(cfg.netns)
    for pid in pids:
        try:
            kib = procfs.rss_kib(pid)
            title = (procfs.command_line(pid) or [""])[0]
        except OSError:
            continue  # exited since it was listed
        rss += kib
        if title.startswith(MODEL_ACTOR_TITLE):
            actors.append(kib // 1024)
    available = procfs.meminfo().get("MemAvailable", 0)
    group = memory_watch.memory_group(cfg)
    return {"stack_rss_mib": rss // 1024, "machine_available_mib": available // 1024, "processes": len(pids),
            "model_actor_rss_mib": sorted(actors), "cgroup": memcg.counters(group) if group else None}


def model_rows(name: str, client: str, role: str, line: str, by_case: Dict[str, dict], built: Dict[str, str],
             deploy_failure: Optional[str], batch: int, extra: str = DEFAULT_EXTRA) -> List[dict]:
    generation = config.generation(line)
    out = []
    for trace, kind in TRACES.items():
        case = f"{kind}:{name}:{ATOL[line]}"
        record = by_case.get(case)
        row = {"model": name, "line": line, "client": client, "role": role, "server": f"stock+{extra}",
               "trace": trace, "batch": batch, "expected": predicted(name, client, line, extra)}
        if deploy_failure is not None:
            row.update(ok=False, max_abs_diff=None, built_class=None, error="DeployError", reason=deploy_failure)
        elif record is None:
            row.update(ok=False, max_abs_diff=None, built_class=None, error="NoRecord",
                       reason=f"the client sent no record for {case}")
        else:
            points = {k: {f: v.get(f) for f in ("max_abs_diff", "dtype", "shape", "max_abs_local")}
                      for k, v in record.items() if isinstance(v, dict) and "max_abs_diff" in v}
            for point in points.values():
                point["tolerance"] = generation.tolerance(point["max_abs_local"])
            diffs = [v["max_abs_diff"] for v in points.values() if v["max_abs_diff"] is not None]
            # The client's error is final; its values are judged here, each at its own magnitude (Generation.tolerance).
            within = bool(points) and all(v["max_abs_diff"] is not None and v["max_abs_diff"] <= v["tolerance"]
                                          for v in points.values())
            row.update(ok="error" not in record and within, max_abs_diff=max(diffs) if diffs else None,
                       client_ok=record.get("ok"), client_atol=record.get("atol"), key=record.get("key"),
                       built_class=built.get(record.get("key")), seconds=record.get("seconds"), points=points,
                       socket_race_retries=record.get("socket_race_retries", []))
            if trace == "write":
                row["write_changes_local_output"] = record.get("write_changes_local_output")
                row["ok"] = row["ok"] and bool(record.get("write_changes_local_output"))
            if trace == "read":
                row["read_points"] = record.get("read_points")
            if "error" in record:
                message = record.get("message", "")[-1500:]
                if "out_of_memory" in record:
                    # Last, where the report's one-line reason is taken from; the client's own error stays whole.
                    message += "\n" + record["out_of_memory"]
                row.update(error=record.get("error"), reason=message,
                           **({"stack_problems": record["stack_problems"]} if "stack_problems" in record else {}))
        expected = row["expected"]
        row["as_expected"] = (row["ok"] if expected["outcome"] == "ok" else
                              not row["ok"] and expected["message"] in (row.get("reason") or ""))
        out.append(row)
    return out


def name_out_of_memory(records: Dict[str, dict], watch: "memory_watch.MemoryWatch") -> None:
    """When the kernel killed processes of the stack for want of memory since ``watch`` was made, every record
    with an error carries that (``out_of_memory``): the client only saw its trace fail. (Kills only: one look
    after a whole client run cannot tell thrashing from a long, healthy run.)"""
    try:
        watch.check_kills()
    except errors.OutOfMemory as exc:
        for record in records.values():
            if "error" in record:
                record["out_of_memory"] = str(exc)


def deploy_one_by_one(cfg: config.StackConfig, names: List[str], number: int,
                      say: Callable[[str], None]) -> Dict[str, str]:
    """Each of ``names`` deployed on the running stack in turn (a generation that deploys only what it was
    given); ``{name: why}`` for each that did not deploy."""
    env = server_env.ensure(build=False, line=cfg.line, extras=cfg.extras)
    minted = stack.minted_keys(cfg, names)
    failures: Dict[str, str] = {}
    stalled = None
    for name in names:
        if stalled:
            # The stack stopped taking models (a deployment timed out, or a service died): waiting out the
            # deploy timeout once per model left would only repeat it. What deployed is still traced.
            failures[name] = f"not deployed: {stalled}"
            continue
        say(f"batch {number}: deploying {name}")
        try:
            stack.deploy_models(cfg, env, {name: minted[name]})
        except (deploy.DeployError, errors.StackError) as exc:
            failures[name] = str(exc)
            say(f"batch {number}: {name} did not deploy: {str(exc).splitlines()[-1]}")
            if isinstance(exc, errors.StackError):
                stalled = (f"the stack stopped taking models at {name} ({str(exc).splitlines()[-1]}); "
                           f"rerun the models left with a smaller --batch")
    return failures


def failed_cases(names: List[str], line: str, exc: Exception) -> Dict[str, dict]:
    """Every case of ``names`` as failed with ``exc`` (a client, or the stack, that died)."""
    return {case: {"ok": False, "error": "StackError", "message": str(exc)} for case in cases(names, line)}


def trace_with_every_client(cfg: config.StackConfig, deployable: List[str], number: int,
                            group: Optional[memcg.Cgroup], say: Callable[[str], None]) -> Dict[str, Dict[str, dict]]:
    """``{client: {case: record}}``: each pairing's client tracing ``deployable`` on the running stack."""
    by_client: Dict[str, Dict[str, dict]] = {}
    for pairing in PAIRINGS[cfg.line]:
        if not deployable:
            break
        client = pairing.client
        say(f"batch {number}: {client} client: {', '.join(deployable)}")
        watch = memory_watch.MemoryWatch(group, f"while the {client} client traced {', '.join(deployable)}")
        try:
            by_client[client] = stack_clients.run_client(cfg, cases(deployable, cfg.line), client=client,
                                                         timeout=1800)
        except errors.StackError as exc:
            # The client or the stack died: every case of this client is reported with it.
            by_client[client] = failed_cases(deployable, cfg.line, exc)
        name_out_of_memory(by_client[client], watch)
    return by_client


def measure(cfg: config.StackConfig, names: List[str], number: int, say: Callable[[str], None] = _say) -> dict:
    """``names`` on the running stack of ``cfg``, which stays up: deployed one by one where the generation
    deploys only what it was given, then traced by every pairing's client. The clients' records, the models
    that did not deploy, the stack's memory and what its model actors built."""
    group = memory_watch.memory_group(cfg)
    failures = {} if cfg.generation.deploys_on_request else deploy_one_by_one(cfg, names, number, say)
    deployable = [name for name in names if name not in failures]
    return {"by_client": trace_with_every_client(cfg, deployable, number, group, say), "deploy_failures": failures,
            "memory": stack_memory(cfg), "built": stack_clients.built_models(cfg)}


def judged(names: List[str], number: int, line: str, measured: dict, extra: str) -> List[dict]:
    """The rows of a :func:`measure`: each model, pairing and trace against its prediction."""
    built = {b["model_key"]: b["module_class"] for b in measured["built"]}
    return [row for name in names for p in PAIRINGS[line]
            for row in model_rows(name, p.client, p.panel_role, line, measured["by_client"].get(p.client, {}), built,
                                  measured["deploy_failures"].get(name), number, extra)]


def run_on_running_stack(cfg: config.StackConfig, names: List[str], number: int,
                         say: Callable[[str], None] = _say) -> dict:
    """A batch on a stack that is up and stays up (the test session's): :func:`measure` and :func:`judged`, with
    ``built`` the model actors' records for the keys the batch's clients sent."""
    started = time.monotonic()
    measured = measure(cfg, names, number, say)
    keys = {r["key"] for records in measured["by_client"].values() for r in records.values() if "key" in r}
    (extra,) = cfg.extras  # a panel server runs with one extra, as run_batch's does
    return {"batch": number, "models": names, "seconds": round(time.monotonic() - started, 1),
            "memory": measured["memory"], "built": [b for b in measured["built"] if b["model_key"] in keys],
            "rows": judged(names, number, cfg.line, measured, extra)}


def run_batch(line: str, names: List[str], number: int, say: Callable[[str], None] = _say,
              while_up: Optional[Callable[[config.StackConfig], object]] = None,
              memory_limit_mib: Optional[int] = None, extra: str = DEFAULT_EXTRA) -> dict:
    """One cold stack of ``line`` (with ``extra``): ``names`` deployed on demand and traced by every
    pairing's client (:func:`measure`); the stack is down again on return, also after a failure (a ``down``
    that fails is the result's ``down_error``: the batch's measurements stand). ``memory_limit_mib`` caps the
    stack's memory (:attr:`config.StackConfig.memory_limit_mib`).

    ``while_up``, if given, is called with the stack's config once the batch is measured and before the
    stack comes down; what it returns is the result's ``while_up``. The test session uses it to run the
    probe script and the checks that break a stack on the same cold stack instead of bringing up more; one
    that brings the stack down itself may (``down`` is idempotent). The batch holds the stack folder's
    lease (:func:`stack_state.lease`) from before it brings a leftover down until its own ``down``.
    """
    cfg = config.default(line=line, extras=(extra,), memory_limit_mib=memory_limit_mib)
    with stack_state.lease(cfg, say=say):
        group = None
        if netns.exists(cfg.netns):
            say(f"a {line} {extra} stack is running (namespace {cfg.netns}); bringing it down for a cold batch")
            stack.down(cfg)
        down_error = None
        started = time.monotonic()
        try:
            # A generation that deploys on request starts with its usual models; the other, with none,
            # then the batch's one by one, so a model that does not deploy is named with its cause.
            state = stack.up(cfg, models=None if cfg.generation.deploys_on_request else [], say=say)
            group = memory_watch.memory_group(cfg)
            measured = measure(cfg, names, number, say)
            timings = state.get("timings", {})
            also = while_up(cfg) if while_up else None
        except errors.StackError as exc:
            # The stack did not come up (or died between clients): the batch's models all carry the reason.
            say(f"batch {number}: {exc}")
            measured = {"by_client": {p.client: failed_cases(names, line, exc) for p in PAIRINGS[line]},
                        "deploy_failures": {}, "memory": {}, "built": []}
            timings, also = {}, None
        finally:
            try:
                stack.down(cfg, say=lambda m: None)
            except (errors.StackError, netns.NetnsError) as exc:
                down_error = str(exc)
                say(f"batch {number}: the stack did not come down: {exc}")
    return {"batch": number, "models": names, "seconds": round(time.monotonic() - started, 1),
            "memory": measured["memory"], "stack_timings": timings, "built": measured["built"],
            "rows": judged(names, number, line, measured, extra),
            "netns_left_after_down": netns.exists(cfg.netns),
            "cgroup_left_after_down": bool(group and group.path.exists()), **({"while_up": also} if while_up else {}),
            **({"down_error": down_error} if down_error else {})}


def run_line(line: str, names: List[str], batch: int, say: Callable[[str], None] = _say,
             memory_limit_mib: Optional[int] = None, extra: str = DEFAULT_EXTRA) -> dict:
    batches = [names[i:i + batch] for i in range(0, len(names), batch)]
    results = []
    for number, chunk in enumerate(batches, 1):
        say(f"{line}: batch {number}/{len(batches)}: {', '.join(chunk)}")
        results.append(run_batch(line, chunk, number, say, memory_limit_mib=memory_limit_mib, extra=extra))
    return {"batches": results, "rows": [row for result in results for row in result["rows"]]}


def markdown(report: dict) -> str:
    p = report["provenance"]
    d, server = p["details"], p["server"]
    clients = [pairing.client for pairing in PAIRINGS[report["line"]]]
    lines = [f"# The panel on a live NDIF server, nnsight {report['line']} line", "",
             f"`{p['command']}` on {p['host']}, {p['date']}; server {server['env']} "
             f"(ndif {server.get('ndif')}, nnsight {server.get('nnsight')}, multimolecule "
             f"{server.get('multimolecule')}"
             + "".join(f", with patches/{fix}" for fix in server.get("series", {}).values()) + "); clients: "
             + ", ".join(f"{name} (nnsight {p['versions'][name].get('nnsight')})" for name in clients) + ".", "",
             f"Tolerance against the local float32 trace: {d['tolerance']}. "
             f"Deployed on demand, {report['batch_size']} models per cold stack.", "",
             "| model | client | role | trace | ok | expected | as expected | max abs diff | server built | reason |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        reason = (row.get("reason") or "").strip().splitlines()
        diff = "" if row.get("max_abs_diff") is None else f"{row['max_abs_diff']:.4g}"
        expected = row["expected"]
        lines.append(f"| {row['model']} | {row['client']} | {row['role']} | {row['trace']} | "
                     f"{'yes' if row['ok'] else 'no'} | "
                     f"{expected['outcome'] + (' (' + expected['bug'] + ')' if 'bug' in expected else '')} | "
                     f"{'yes' if row['as_expected'] else '**no**'} | {diff} | "
                     f"{row.get('built_class') or ''} | {(reason[-1] if reason else '')[:120].replace('|', '/')} |")
    failed = [row for row in report["rows"] if row["role"] == "required" and not row["ok"]]
    if failed:
        lines += ["", "Required pairings not ok, with the error the client received:", ""]
        lines += [f"- {row['model']} {row['trace']}: `{((row.get('reason') or '').strip().splitlines() or [''])[-1]}`"
                  f" — predicted: {BUGS.get(row['expected'].get('bug'), 'ok')}" for row in failed]
    lines += ["", "| batch | models | seconds | stack RSS MiB | model actors' RSS MiB | machine available MiB "
                  "| cgroup peak MiB | OOM kills |",
              "|---|---|---|---|---|---|---|---|"]
    for b in report["batches"]:
        m = b["memory"]
        group = m.get("cgroup") or {}
        lines.append(f"| {b['batch']} | {', '.join(b['models'])} | {b['seconds']} | {m.get('stack_rss_mib', '')} | "
                     f"{', '.join(map(str, m.get('model_actor_rss_mib', [])))} | {m.get('machine_available_mib', '')} "
                     f"| {group.get('peak_mib', '')} | {group.get('oom_kills', '')} |")
    s = report["summary"]
    lines += ["", f"{s['records']} records; {s['as_expected']} as expected; required pairings ok: "
                  f"{s['required_ok']}/{s['required']}; negative control failing as predicted: "
                  f"{s['negative_as_predicted']}/{s['negative']}.", ""]
    return "\n".join(lines)


def summary(rows: List[dict]) -> dict:
    required = [r for r in rows if r["role"] == "required"]
    negative = [r for r in rows if r["role"] == "negative control"]
    return {"records": len(rows), "as_expected": sum(r["as_expected"] for r in rows),
            "required": len(required), "required_ok": sum(r["ok"] for r in required),
            "negative": len(negative), "negative_as_predicted": sum(r["as_expected"] for r in negative),
            "models": sorted({r["model"] for r in rows})}


def report_for(line: str, result: dict, command: str, batch: int, started: str,
               memory_limit_mib: Optional[int] = None, extra: str = DEFAULT_EXTRA) -> dict:
    """The report of ``line``'s panel run. Its server's ``flavour`` key (the extras, a list) keeps the old word,
    so new reports compare with the committed ones and their readers need one spelling."""
    generation = config.generation(line)
    server = server_env.ensure(build=False, line=line, extras=(extra,))
    fixes = {f.imports[0]: f.series for f in server_packages.extras([extra]) if f.series}
    packages = envs.reported_versions(server)
    versions = {p.client: envs.reported_versions(envs.ensure(p.client, build=False)) for p in PAIRINGS[line]}
    versions[server.name] = packages
    served = {"kind": "local NDIF stack", "line": line, "env": server.name, "env_digest": server.stamp["digest"],
              "flavour": [extra], **({"series": fixes} if fixes else {}),
              **{k: packages.get(k) for k in ("ndif", "nnsight", "torch", "transformers", "multimolecule")},
              "note": generation.note}
    details = {
        "started": started,
        "memory_limit_mib": memory_limit_mib,
        "memory_note": (f"{batch} models per cold stack, each batch's stack down before the next comes up; the "
                        f"stack's resident memory after each batch's traces is in `batches`"),
        "tolerance": generation.tolerance_note(),
    }
    return {"line": line, "provenance": provenance.record(command, versions=versions, server=served, details=details),
            "batch_size": batch,
            "summary": summary(result["rows"]), "rows": result["rows"], "batches": result["batches"]}


def report_path(root: Path, line: str, extra: str = DEFAULT_EXTRA) -> Path:
    """Where a line's report with ``extra`` goes: ``<root>/ndif_<line>/panel.json``, ``panel+<extra>.json``
    for an extra other than the default (the ``.md`` beside it)."""
    return root / f"ndif_{line}" / ("panel.json" if extra == DEFAULT_EXTRA else f"panel+{extra}.json")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nnsight-repro ndif panel",
                                     description="Every panel model traced with remote=True on the local NDIF "
                                                 "stack(s), their server with a multimolecule extra.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="exit status:\n"
                                            "  0  the report was written (a model that fails is a record in it)\n"
                                            "  2  usage error, or a stack could not be brought up (the message "
                                            "says why)\n")
    parser.add_argument("--line", choices=sorted(PAIRINGS), action="append",
                        help="the nnsight line (repeatable; default both)")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated panel models (default all: {','.join(panel_models.extended())})")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"models per cold stack (default {BATCH})")
    parser.add_argument("--memory-limit", type=int, default=None, metavar="MIB",
                        help="cap each batch's stack at MIB (its memory cgroup; default: no cap of its own)")
    described = [f"{name} (with patches/{server_packages.EXTRAS[name].series})" if server_packages.EXTRAS[name].series
                 else f"{name} (as released)" for name in EXTRAS]
    parser.add_argument("--with", dest="extra", choices=EXTRAS, default=DEFAULT_EXTRA,
                        help=f"the server's extra: {', '.join(described)}; default {DEFAULT_EXTRA}")
    parser.add_argument("--out-root", default=str(ROOT / "results"),
                        help="results root: writes <root>/ndif_<line>/panel.json and panel.md "
                             "(panel+<extra>.* for another --with)")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cli = parser()
    args = cli.parse_args(argv)
    known = panel_models.extended()
    names = list(known) if args.models is None else [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in known]
    if unknown or not names:
        cli.error(f"unknown model(s) {', '.join(unknown) or '(none given)'}; the panel has: {', '.join(known)}")
    if args.batch < 1:
        cli.error(f"--batch must be at least 1, not {args.batch}")
    if args.memory_limit is not None and args.memory_limit < 1:
        cli.error(f"--memory-limit is a positive number of MiB, not {args.memory_limit}")
    command = provenance.command_line(argv, program="python3 -m nnsight_repro ndif panel")
    try:
        for line in args.line or ["0.8", "0.7"]:
            started = provenance.date()
            result = run_line(line, names, args.batch, memory_limit_mib=args.memory_limit, extra=args.extra)
            report = report_for(line, result, command, args.batch, started, args.memory_limit, args.extra)
            out = report_path(Path(args.out_root), line, args.extra)
            fsutil.write_text(out, json.dumps(report, indent=1) + "\n")
            fsutil.write_text(out.with_suffix(".md"), markdown(report))
            s = report["summary"]
            print(f"{line}: {s['records']} records, {s['as_expected']} as expected; required ok "
                  f"{s['required_ok']}/{s['required']}; negative control as predicted "
                  f"{s['negative_as_predicted']}/{s['negative']} -> {out}")
    except errors.USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
