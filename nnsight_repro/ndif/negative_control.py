"""The negative control against a real server: nnsight 0.7.0 clients, stock and patched, against the 0.7
stack (ndif 0.0.1) with a stock and with a patched nnsight on the server.

``python3 -m nnsight_repro ndif negative-control [--out DIR]`` brings up one stack per server build,
one after the other (each brought down before the next comes up), runs every pairing's client cases in
the namespace, reads what the server built from the model actors' own records (``logs/built.jsonl``),
and writes ``DIR/negative_control.json``: the command, host, date, client and server versions, each
pairing's outcome, and each stack's cold start to first remote trace (a GPT-2 client ready before the
server starts, waiting for the stack as a user's script would).

The tests (``tests/test_remote_ndif_07.py``) run the same pairings through :func:`run_pairings`.

Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List

from .. import ROOT, envs, provenance
from . import config, errors, netns, server_env, stack, stack_clients, stack_state

#: The generation the control runs on: the only one with two server builds.
LINE = "0.7"
GENERATION = config.generation(LINE)

#: Tolerance of a trace against the local float32 run (why: generations.BF16_ATOL).
ATOL = GENERATION.atol

#: The models every pairing traces: GPT-2 (a decoder, which never takes the envoy path) is the control;
#: BERT and ESM masked LMs have an ``output`` child in every layer.
MODELS = ("gpt2", "bert-mlm", "esm-mlm")
#: Each model read (first layer and final hidden states) and written (a layer output zeroed, logits read).
CASES = [f"{kind}:{model}:{ATOL}" for model in MODELS for kind in ("trace", "write")]

#: server build -> client environment -> remote_client cases: every pairing of the generation
#: (:data:`generations.PAIRINGS`), the whole matrix client {stock, patched} x server {stock, patched}.
PAIRINGS: Dict[str, Dict[str, List[str]]] = {
    server: {p.client: CASES for p in GENERATION.pairings if p.server == server} for server in GENERATION.servers
}


def _say(message: str) -> None:
    print(f"[negative-control] {message}", file=sys.stderr, flush=True)


def run_pairings(cfg: config.StackConfig, say: Callable[[str], None] = _say) -> dict:
    """Every client's cases against the running stack of ``cfg.server``; what the server built, after."""
    clients = {}
    for client, cases in PAIRINGS[cfg.server].items():
        say(f"{client} client against the {cfg.server} server: {', '.join(cases)}")
        clients[client] = stack_clients.run_client(cfg, cases, client=client)
    return {"server": cfg.server, "clients": clients, "built": stack_clients.built_models(cfg),
            "server_nnsight": (stack_state.read_state(cfg) or {}).get("server_nnsight"),
            "interfaces": netns.interfaces(cfg.netns)}


def measure(server: str, say: Callable[[str], None] = _say) -> dict:
    """Bring up the 0.7 stack with ``server``, time cold start to a first GPT-2 trace, run the pairings, down."""
    cfg = config.default(line=LINE, server=server)
    if netns.exists(cfg.netns):
        raise errors.StackError(f"A 0.7 stack already runs in {cfg.netns}; the measurement needs a cold start "
                               f"(`nnsight-repro ndif down --line 0.7`).")
    try:
        # The first client is the stock one: GPT-2's key is the same for every 0.7 client.
        state = stack_clients.up_to_first_trace(cfg, "gpt2", "main", say=say)
        result = run_pairings(cfg, say)
        timings = state["timings"]
        timings["cold_start_to_first_trace_s"] = timings.pop("first_trace_s")
        result["timings"] = {**timings, "warm_gpt2": warm_overhead(cfg, say)}
        return result
    finally:
        stack.down(cfg, say=say)


#: Warm traces timed per side for the overhead ratio (after one untimed warm-up of each).
WARM_REPEATS = 10


def warm_overhead(cfg: config.StackConfig, say: Callable[[str], None] = _say) -> dict:
    """The same GPT-2 trace, remote and local, in one stock-client process: medians and remote/local."""
    case = f"timing:gpt2:{WARM_REPEATS}"
    say(f"main client against the {cfg.server} server: {case}")
    record = stack_clients.run_client(cfg, [case], client="main")[case]
    if not record.get("ok"):
        return record
    medians = stack_clients.timing_medians(record)
    return {"ok": True, "repeats": WARM_REPEATS, "remote_median_s": medians["remote_median_s"],
            "local_median_s": medians["local_median_s"], "remote_over_local": medians["ratio"]}


def outcome(record: dict) -> str:
    """One line per case: OK with the largest deviation, or the error's last line."""
    if record.get("ok"):
        diffs = [v["max_abs_diff"] for v in record.values() if isinstance(v, dict) and "max_abs_diff" in v]
        return f"OK (max |remote - local| {max(diffs):.4g})" if diffs else "OK"
    lines = [line for line in record.get("message", "").strip().splitlines() if line.strip()]
    return f"{record.get('error')}: {lines[-1] if lines else ''}"


def summary(results: Dict[str, dict]) -> List[dict]:
    rows = []
    for server, result in results.items():
        built = {b["model_key"]: b["module_class"] for b in result["built"]}
        for client, records in result["clients"].items():
            for case, record in records.items():
                row = {"server": server, "client": client, "case": case, "outcome": outcome(record)}
                if record.get("key") or built:
                    key = record.get("key")
                    row["server_built"] = built.get(key) if key else None
                rows.append(row)
    return rows


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nnsight-repro ndif negative-control",
                                     description="The negative control end to end against the 0.7 stack "
                                                 "(ndif 0.0.1): stock and patched nnsight 0.7.0 on both sides.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="exit status:\n"
                                            "  0  negative_control.json was written (a failing pairing is a result)\n"
                                            "  2  usage error, or the stack could not be brought up (the message "
                                            "says why)\n")
    parser.add_argument("--out", default=str(ROOT / "results" / "ndif_0.7"), help="output directory")
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    started = provenance.date()
    results = {}
    try:
        for server in PAIRINGS:
            results[server] = measure(server)
    except errors.USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The server's nnsight as each server build imported it (recorded by `up`); the rest as its interpreter reports.
    server = server_env.ensure(build=False, line=LINE)
    server_packages = envs.reported_versions(server)
    report = {
        "provenance": provenance.record(
            " ".join(["python3 -m nnsight_repro ndif negative-control", *(argv or [])]),
            versions={**{name: envs.reported_versions(envs.ensure(name, build=False)) for name in GENERATION.clients},
                      server.name: server_packages},
            server={"kind": "local NDIF stack", "ndif": server_packages.get("ndif"), "env": server.name,
                    "env_digest": server.stamp["digest"],
                    "nnsight": {server: results[server]["server_nnsight"] for server in results},
                    "note": GENERATION.note},
            details={"started": started}),
        "tolerance": {"atol": ATOL, "why": "the server computes in bfloat16 (see nnsight_repro/ndif/generations.py "
                                          "BF16_ATOL)"},
        "summary": summary(results),
        "timings": {server: result["timings"] for server, result in results.items()},
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "negative_control.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    for row in report["summary"]:
        built = f"  [server built {row['server_built']}]" if row.get("server_built") else ""
        print(f"{row['server']:8} server, {row['client']:8} client, {row['case']:20} {row['outcome'][:110]}{built}")
    for server, timings in report["timings"].items():
        warm = timings.get("warm_gpt2") or {}
        overhead = (f"; warm GPT-2 trace remote/local {warm['remote_over_local']}x "
                    f"({warm['remote_median_s']} s / {warm['local_median_s']} s)" if warm.get("ok") else "")
        print(f"{server} server: cold start to first remote trace {timings['cold_start_to_first_trace_s']} s{overhead}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
