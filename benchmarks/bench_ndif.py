"""How long a local NDIF stack takes to serve its first remote trace, and what a warm remote trace costs.

    python3 benchmarks/bench_ndif.py                       # 0.8 stack: deploys gpt2, bert-mlm, esm-mlm (the tests')
    python3 benchmarks/bench_ndif.py --models gpt2         # the smallest cold start: one model
    python3 benchmarks/bench_ndif.py --line 0.7            # 0.7 stack (ndif 0.0.1), patched server, patched client
    python3 benchmarks/bench_ndif.py --line 0.7 --server stock --models gpt2   # stock server, stock (main) client
    python3 benchmarks/bench_ndif.py --json results/benchmarks/ndif.json

Cold start: from nothing running (no namespace, wiped logs and Ray temp dir; the cached environments
and model keys already made, and the time that took printed apart) through ``nnsight-repro ndif up`` (services, deploy,
every model HOT) to the first remote trace returning. That client is started inside the namespace as
soon as it exists (a user whose Python is already running), polls ``/status`` until the model is HOT,
then traces. A fresh client process's whole run (interpreter start and imports included) is printed
beside it. Warm overhead: the same trace of each deployed model,
remote and local, ``--repeat`` times each in one client process after one untimed warm-up of each;
the ratio is median remote / median local.

The 0.7 stack deploys a model on its first request (ndif 0.0.1), so there is no "every model HOT": its
first remote trace includes deploying the model, and the client waits only for the controller to list
a node. Its client is the environment that matches the server flavour: ``main`` (stock nnsight 0.7.0)
against the stock server, ``patched`` against the patched one; masked LMs work only on the latter.

Needs root (network namespace). Refuses to run while a stack is up for this cache, so the start is cold,
and always takes the stack down at the end. Not a test: on two shared cores the numbers move with load,
so the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nnsight_repro import envs  # noqa: E402
from nnsight_repro.ndif import config, deploy, negative_control, netns, server_env, stack  # noqa: E402


#: The local stack's bar (issue 3): cold start to the first successful remote trace.
COLD_START_BAR_S = 40.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--line", choices=sorted(config.GENERATIONS), default="0.8",
                        help="which stack: 0.8 (ndif 0.1.2, the default) or 0.7 (ndif 0.0.1)")
    parser.add_argument("--server", choices=("stock", "patched"), default="patched",
                        help="0.7 only: the server's nnsight (and the matching client: main or patched)")
    parser.add_argument("--models", help="panel models to time, the first one cold (default: the 0.8 stack's "
                                         "deployed models; on 0.7 gpt2, and bert-mlm, esm-mlm with --server patched)")
    parser.add_argument("--repeat", type=int, default=10, help="warm traces per model, remote and local each")
    parser.add_argument("--json", help="also write the record here")
    args = parser.parse_args(argv)
    line = args.line
    if line == "0.8" and args.server != "patched":
        parser.error("--server chooses the 0.7 stack's nnsight; the 0.8 stack runs stock nnsight 0.8.1")
    cfg = config.default(line=line, **({"server": args.server} if line == "0.7" else {}))
    client = cfg.generation.clients[0] if line == "0.8" else {"stock": "main", "patched": "patched"}[args.server]
    default_models = deploy.SERVED if line == "0.8" or args.server == "patched" else ["gpt2"]
    models = [m for m in (args.models or ",".join(default_models)).split(",") if m]
    if netns.exists(cfg.netns):
        down = "" if line == "0.8" else f" --line {line}"
        parser.error(f"a stack is running for this cache (namespace {cfg.netns}); a cold start needs nothing "
                     f"running: `python3 -m nnsight_repro ndif down{down}` first")

    started = time.monotonic()
    server_env.ensure(line=line)
    server_env.redis_server()
    for name in cfg.generation.clients:
        envs.ensure(name)
    if line == "0.8":
        # The model keys too: minted once per client environment and remembered, like the environments.
        deploy.minted(models, cfg.folder / "minted.json")
    environments_s = time.monotonic() - started

    record = {"command": " ".join(["python3", "benchmarks/bench_ndif.py", *(argv or sys.argv[1:])]),
              "host": platform.node(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count(),
              "load_average_before": os.getloadavg(), "line": line, "models": models,
              "versions": {"ndif": cfg.generation.ndif, "client_env": client,
                           "nnsight": envs.spec(client).nnsight,
                           "server_nnsight": "stock" if line == "0.8" else args.server},
              "environments_ready_s": round(environments_s, 2)}
    try:
        clients = []
        cold = time.time()
        # 0.0.1 deploys on the first request: its `up` deploys nothing (and takes no models).
        state = stack.up(cfg, models=models if line == "0.8" else None,
                         on_namespace=lambda c: clients.append(stack.start_client(c, [f"first:{models[0]}"],
                                                                                  client=client)))
        first = stack.client_records(cfg, clients[0])[f"first:{models[0]}"]
        if not first.get("ok"):
            raise stack.StackError(f"the first remote trace failed: {first}")
        fresh_started = time.time()
        # The 0.7 server computes in bfloat16: its traces are compared within the negative control's tolerance.
        fresh_case = f"trace:{models[0]}" + ("" if line == "0.8" else f":{negative_control.ATOL}")
        fresh = stack.run_client(cfg, [fresh_case], client=client)[fresh_case]
        if not fresh.get("ok"):
            raise stack.StackError(f"a fresh client's trace failed: {fresh}")
        record["cold_start"] = {**state["timings"],
                                "first_trace_s": round(first["done_epoch"] - cold, 2),
                                "first_request_s": first["request_s"],
                                "fresh_client_trace_s": round(time.time() - fresh_started, 2)}
        timings = stack.run_client(cfg, [f"timing:{m}:{args.repeat}" for m in models], client=client)
        record["warm"] = {}
        for m in models:
            t = timings[f"timing:{m}:{args.repeat}"]
            if not t.get("ok"):
                raise stack.StackError(f"timing {m} failed: {t}")
            remote, local = statistics.median(t["remote_s"]), statistics.median(t["local_s"])
            record["warm"][m] = {"remote_median_s": round(remote, 4), "local_median_s": round(local, 4),
                                 "ratio": round(remote / local, 1), "remote_s": t["remote_s"], "local_s": t["local_s"]}
    finally:
        stack.down(cfg)
    record["load_average_after"] = os.getloadavg()
    record["cold_start_bar_s"] = COLD_START_BAR_S

    cs = record["cold_start"]
    server = "" if line == "0.8" else f" ({args.server} nnsight on the server)"
    print(f"local NDIF {record['versions']['ndif']}{server} / nnsight {record['versions']['nnsight']} "
          f"client ({client}), "
          f"{record['cpus']} cores, load average {record['load_average_before'][0]:.1f} before, "
          f"{record['load_average_after'][0]:.1f} after; models: {', '.join(models)}")
    print(f"environments and model keys (cached): {record['environments_ready_s']:6.1f} s")
    print(f"cold start -> services up:            {cs['services_s']:6.1f} s")
    if line == "0.8":
        print(f"cold start -> every model HOT:        {cs['models_hot_s']:6.1f} s")
        request = "once the model was HOT"
    else:
        request = "deploying the model: 0.0.1 deploys on the first request"
    print(f"cold start -> first remote trace:     {cs['first_trace_s']:6.1f} s   "
          f"(client started with the stack; its request {cs['first_request_s']:.2f} s, {request})")
    print(f"bar: first remote trace <= {COLD_START_BAR_S:.0f} s from cold: "
          f"{cs['first_trace_s'] / COLD_START_BAR_S:.2f} of it, holds {'yes' if cs['first_trace_s'] <= COLD_START_BAR_S else 'NO'}")
    print(f"a fresh client process, end to end:   {cs['fresh_client_trace_s']:6.1f} s   "
          f"(Python start, imports, wrapping, one remote and one local trace)")
    print(f"warm trace, median of {args.repeat}:        remote      local    remote/local")
    for m, w in record["warm"].items():
        print(f"  {m:34} {w['remote_median_s'] * 1000:7.1f} ms {w['local_median_s'] * 1000:7.1f} ms {w['ratio']:8.1f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
