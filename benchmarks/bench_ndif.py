"""How long a local NDIF stack takes to serve its first remote trace, and what a warm remote trace costs.

    python3 benchmarks/bench_ndif.py                       # 0.8 stack: deploys gpt2, bert-mlm, esm-mlm (the tests')
    python3 benchmarks/bench_ndif.py --models gpt2         # the smallest cold start: one model
    python3 benchmarks/bench_ndif.py --line 0.7            # 0.7 stack (ndif 0.0.1), patched server, patched client
    python3 benchmarks/bench_ndif.py --line 0.7 --server stock --models gpt2   # stock server, stock (main) client
    python3 benchmarks/bench_ndif.py --json results/benchmarks/ndif.json
    python3 benchmarks/bench_ndif.py --with multimolecule  # the multimolecule extra: a whole panel batch of RNA models

Cold start: from nothing of the server running (a new namespace, wiped logs and Ray temp dir; the cached
environments and model keys already made, and the time that took printed apart) through ``nnsight-repro
ndif up`` (services, deploy, every model HOT) to the first remote trace returning. That client is started
inside the namespace first, and the clock starts once it has imported nnsight and wrapped its model (a user
whose script is already running when the server starts; on two shared cores its imports would otherwise
compete with the server's); it polls ``/status`` until the model is HOT, then traces. ``--rounds`` cold
starts (default 3), each from nothing; the bar (first remote trace <= 40 s) is judged on their median.
After the last: a fresh client process's whole run (interpreter start and imports included), and the warm
overhead: the same trace of each model, remote and local, ``--repeat`` times each in one client process
after one untimed warm-up of each; the ratio is median remote / median local.

On the 0.7 stack the models are deployed the same way, under the keys of the client that matches the
server build: ``main`` (stock nnsight 0.7.0) against the stock server, ``patched`` against the patched
one (masked LMs work only on the latter); its first client waits for the controller to list a node, and
its request then waits for the model if it is still loading.

With ``--with multimolecule`` the stack is the one with that extra (its own folder and namespace) and the default
models are one batch of the panel's RNA models (``ndif panel``'s batch size, all deployed at start); after
the warm traces, every process's resident memory in the namespace and each model actor's
(``panel.stack_memory``), and how many such actors the machine's memory would hold beside the rest of the
stack.

The record's ``server`` keeps the old word "flavour" in two keys, ``nnsight_flavour`` (the server build) and
``flavours`` (the extras), so new records compare with the committed ones and their readers need one spelling.

Needs root (network namespace). Refuses to run while a stack is up for this cache, so the start is cold,
and always takes the stack down at the end. Not a test: on two shared cores the numbers move with load,
so the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nnsight_repro import envs, models as panel_models, procfs, provenance  # noqa: E402
from nnsight_repro.ndif import (config, deploy, errors, generations, netns, panel, server_env, stack,
                                stack_clients)  # noqa: E402


#: The local stack's bar (issue 3): cold start to the first successful remote trace.
COLD_START_BAR_S = 40.0


def cold_start(cfg: config.StackConfig, models, client: str) -> dict:
    """One round: ``up`` from nothing to the first remote trace of ``models[0]`` (see stack_clients.up_to_first_trace)."""
    load = os.getloadavg()[0]
    state = stack_clients.up_to_first_trace(cfg, models[0], client, models=models)
    return {**state["timings"], "load_average_before": round(load, 2), "server_nnsight": state.get("server_nnsight")}


def warm(cfg: config.StackConfig, models, client: str, repeat: int) -> dict:
    """On a running stack: a fresh client's whole run, then each model's warm remote and local medians."""
    started = time.time()
    # Compared within the generation's tolerance (the 0.7 server computes in bfloat16; the 0.8 one exactly).
    case = f"trace:{models[0]}:{cfg.generation.atol}"
    fresh = stack_clients.run_client(cfg, [case], client=client)[case]
    record = {"fresh_client_trace_s": round(time.time() - started, 2), "fresh_client_ok": bool(fresh.get("ok")),
              "models": {}}
    # A failed timing is recorded beside the others, not instead of them.
    cases = [f"timing:{m}:{repeat}" for m in models]
    try:
        timings = stack_clients.run_client(cfg, cases, client=client)
    except errors.StackError as exc:
        timings = {c: {"ok": False, "message": str(exc)} for c in cases}
    for m, c in zip(models, cases):
        t = timings[c]
        if not t.get("ok"):
            record["models"][m] = {"ok": False, "error": t.get("error"), "message": t.get("message", "")[-2000:]}
            continue
        record["models"][m] = {"ok": True, **stack_clients.timing_medians(t), "remote_s": t["remote_s"], "local_s": t["local_s"]}
    return record


def memory(cfg: config.StackConfig) -> dict:
    """The running stack's memory (:func:`panel.stack_memory`), and how many more model actors of the median
    size the machine's memory holds beside what the stack runs besides its actors."""
    found = panel.stack_memory(cfg)
    total = procfs.meminfo()["MemTotal"] // 1024
    actors = found["model_actor_rss_mib"]
    found["machine_total_mib"] = total
    if actors:
        found["stack_without_actors_mib"] = found["stack_rss_mib"] - sum(actors)
        found["model_actor_median_mib"] = statistics.median(actors)
        found["actors_that_fit"] = int((total - found["stack_without_actors_mib"]) // found["model_actor_median_mib"])
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--line", choices=sorted(generations.GENERATIONS), default="0.8",
                        help="which stack: 0.8 (ndif 0.1.2, the default) or 0.7 (ndif 0.0.1)")
    parser.add_argument("--server", choices=("stock", "patched"), default=None,
                        help="0.7 only: the server's nnsight (and the matching client: main or patched; "
                             "default patched)")
    parser.add_argument("--models", help="panel models to time, the first one cold (default: the 0.8 stack's "
                                         "deployed models; on 0.7 gpt2, and bert-mlm, esm-mlm with --server patched)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="cold starts, each from nothing (the bar is judged on their median)")
    parser.add_argument("--repeat", type=int, default=10, help="warm traces per model, remote and local each")
    parser.add_argument("--with", dest="extras", action="append", default=[], metavar="EXTRA",
                        help="the stack with this extra (as `ndif up --with`); default models: one panel batch "
                             "of its RNA models")
    parser.add_argument("--json", help="also write the record here")
    args = parser.parse_args(argv)
    line = args.line
    # The generation's last server build: the project's patched one where there is one.
    servers = generations.GENERATIONS[line].servers
    server = args.server or servers[-1]
    if server not in servers:
        parser.error(f"--server chooses the 0.7 stack's nnsight; the {line} stack runs {', '.join(servers)} nnsight")
    if args.rounds < 1 or args.repeat < 1:
        parser.error("--rounds and --repeat take a positive number")
    try:
        cfg = config.default(line=line, extras=args.extras, server=server)
    except config.ConfigError as exc:
        parser.error(str(exc))
    client = cfg.client
    # The patched client's keys of the masked LMs are the patched server's: they deploy at start too.
    default_models = deploy.SERVED if server == "patched" else list(cfg.generation.served)
    if cfg.extras:
        default_models = [name for name, entry in panel_models.RNA_PANEL.items()
                          if set(entry.requires) <= set(cfg.extras)][:panel.BATCH]
    models = [m for m in (args.models or ",".join(default_models)).split(",") if m]
    if netns.exists(cfg.netns):
        parser.error(f"a stack is running for this cache (namespace {cfg.netns}); a cold start needs nothing "
                     f"running: `python3 -m nnsight_repro ndif down{cfg.generation.line_option}` first")

    started = time.monotonic()
    server_env.ensure(line=line, extras=cfg.extras)
    server_env.redis_server()
    for name in cfg.generation.clients:
        envs.ensure(name)
    # The model keys too: minted once per client environment and remembered, like the environments.
    stack.minted_keys(cfg, models)
    environments_s = time.monotonic() - started

    record = {"provenance": provenance.record(
                  provenance.command_line(None if argv is None else ["benchmarks/bench_ndif.py", *argv]),
                  # As each interpreter reports them (the 0.7 server's nnsight also as `up` found it imported).
                  versions={"client": envs.reported_versions(envs.ensure(client, build=False)),
                            "server": envs.reported_versions(server_env.ensure(build=False, line=line,
                                                                               extras=cfg.extras))},
                  server={"kind": "local NDIF stack", "line": line, "ndif": cfg.generation.ndif,
                          "nnsight_flavour": cfg.server,
                          "flavours": list(cfg.extras)}),
              "load_average_before": os.getloadavg(), "line": line, "models": models,
              "environments_ready_s": round(environments_s, 2), "cold_start_bar_s": COLD_START_BAR_S,
              "rounds": []}
    failure = None
    for round_ in range(1, args.rounds + 1):
        try:
            cold = cold_start(cfg, models, client)
            print(f"round {round_}/{args.rounds}: cold start -> first remote trace {cold['first_trace_s']:.1f} s",
                  file=sys.stderr, flush=True)
            if round_ == args.rounds:
                record["warm"] = warm(cfg, models, client, args.repeat)
                record["memory"] = memory(cfg)
            record["rounds"].append(cold)
        except errors.StackError as exc:
            # A round that fails is recorded; the rounds before it are kept.
            failure = str(exc)
            record["rounds"].append({"ok": False, "error": failure[-2000:]})
            break
        finally:
            stack.down(cfg, say=lambda m: None)
    record["load_average_after"] = os.getloadavg()
    # Recorded by a generation whose server imports a build the stack links in (0.7), None elsewhere.
    if record["rounds"] and record["rounds"][0].get("server_nnsight"):
        record["provenance"]["versions"]["server"]["nnsight_imported"] = record["rounds"][0]["server_nnsight"]
    done = [r for r in record["rounds"] if "first_trace_s" in r]
    if done:
        keys = ["services_s", "first_trace_s", "first_request_s"] + (["models_hot_s"] if models else [])
        record["median"] = {key: round(statistics.median(r[key] for r in done), 2) for key in keys}
        record["bar_holds"] = record["median"]["first_trace_s"] <= COLD_START_BAR_S
    report(record, args, client)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    if failure:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    return 0 if record["warm"]["fresh_client_ok"] and all(w["ok"] for w in record["warm"]["models"].values()) else 1


def report(record: dict, args, client: str) -> None:
    server = "" if record["line"] == "0.8" else f" ({args.server} nnsight on the server)"
    # Since every results file carries one provenance record, versions and the machine live under it.
    made = record["provenance"]
    versions, cpus = made["versions"], made["machine"]["cpus"]
    print(f"local NDIF {versions['server']['ndif']}{server} / nnsight {versions['client']['nnsight']} "
          f"client ({client}), {cpus} cores, load average {record['load_average_before'][0]:.1f} before, "
          f"{record['load_average_after'][0]:.1f} after; models: {', '.join(record['models'])}")
    print(f"environments and model keys (cached): {record['environments_ready_s']:6.1f} s")
    request = "once the model was HOT" if record["line"] == "0.8" else "sent once the controller listed a node"
    hot = all("models_hot_s" in r for r in record["rounds"] if "first_trace_s" in r)
    print(f"{'cold start (client ready before the clock)':44}{'services up':>13}" + (f"{'models HOT':>13}" if hot else "")
          + f"{'first trace':>13}{'its request':>13}")
    for i, r in enumerate(record["rounds"], 1):
        if "first_trace_s" not in r:
            print(f"  round {i}: FAILED: {r['error'].strip().splitlines()[-1] if r['error'].strip() else ''}")
            continue
        label = f"round {i} (load {r['load_average_before']:.1f})"
        print(f"  {label:42}{r['services_s']:11.1f} s" + (f"{r['models_hot_s']:11.1f} s" if hot else "")
              + f"{r['first_trace_s']:11.1f} s{r['first_request_s']:11.2f} s")
    if "median" in record:
        m = record["median"]
        print(f"  {'median':42}{m['services_s']:11.1f} s" + (f"{m['models_hot_s']:11.1f} s" if hot else "")
              + f"{m['first_trace_s']:11.1f} s{m['first_request_s']:11.2f} s   ({request})")
        print(f"bar: median first remote trace <= {COLD_START_BAR_S:.0f} s from cold: "
              f"{m['first_trace_s'] / COLD_START_BAR_S:.2f} of it, holds {'yes' if record['bar_holds'] else 'NO'}")
    if "warm" not in record:
        return
    w = record["warm"]
    print(f"a fresh client process, end to end:   {w['fresh_client_trace_s']:6.1f} s   "
          f"(Python start, imports, wrapping, one remote and one local trace{'' if w['fresh_client_ok'] else '; FAILED'})")
    print(f"warm trace, median of {args.repeat}:        remote      local    remote/local")
    for m, t in w["models"].items():
        if not t["ok"]:
            lines = [line for line in t["message"].strip().splitlines() if line.strip()]
            print(f"  {m:34} FAILED: {t['error']}: {lines[-1] if lines else ''}")
            continue
        print(f"  {m:34} {t['remote_median_s'] * 1000:7.1f} ms {t['local_median_s'] * 1000:7.1f} ms {t['ratio']:8.1f}x")
    mem = record.get("memory") or {}
    if mem.get("model_actor_rss_mib"):
        print(f"memory after the warm traces: stack {mem['stack_rss_mib']} MiB in {mem['processes']} processes, "
              f"model actors {', '.join(map(str, mem['model_actor_rss_mib']))} MiB; the rest of the stack "
              f"{mem['stack_without_actors_mib']} MiB; {mem['machine_total_mib']} MiB in the machine hold "
              f"{mem['actors_that_fit']} actors of {mem['model_actor_median_mib']:.0f} MiB beside it "
              f"(memory only; {cpus} cores run them)")


if __name__ == "__main__":
    sys.exit(main())
