"""The probe runner (host side): sends validated probes to a live host, one pairing (client x server) at a
time, and writes one JSON (+ markdown) per pairing.

``scripts/ndif_feasibility/probe_ndif.py`` is its command line:

    python3 scripts/ndif_feasibility/probe_ndif.py [--probes FILE] [--probe ID,...] [--pairing main,patched,...]
                                                   [--with multimolecule] [--host URL] [--out DIR]

The probes (``scripts/ndif_feasibility/probes.toml`` by default) are validated by :mod:`.declarations`
before any request: an unknown field, a missing one, an expectation that contradicts itself or names an
unknown pairing, is an error and exit code 2. ``--probe`` runs only the probes it names (an id the file
does not declare is refused the same way). Then, per pairing, the probes run in its client's
environment (:mod:`.client`, inside the stack's namespace for the local NDIF), one live status line per
probe; every observation is compared with the probe's expectation for that pairing, a final table printed,
and one JSON per pairing written atomically to ``results/ndif_feasibility/`` with a markdown summary beside
it. Exit 0 only when every observation matched.

Pairings (``--pairing``; :data:`.declarations.PROBED_PAIRINGS`, default: all; the probed ones of
:data:`nnsight_repro.ndif.generations.PAIRINGS`) pair a client with the local server that serves it:
``main`` (nnsight 0.7.0 on both sides), ``patched`` (the series on both sides),
``patched-client-only`` (the series on the client, a stock 0.7.0 server: what a researcher gets against
today's NDIF) and ``upstream-0.8`` (nnsight 0.8.1 against ndif 0.1.2).

Host: ``--host``, else ``NDIF_HOST`` (with ``NDIF_API_KEY``, as nnsight reads them); with neither, the
project's local NDIF stack of each pairing (the 0.7-line stack with a stock or patched
server, the 0.8-line stack), brought up if it is not running and brought down afterwards if this run
brought it up. An unreachable host, or a local stack that does not come up, is recorded as every
probe's outcome (exit 1). A given host serves every pairing's client as it is; the expectations are those of
the local pairings.

``--with EXTRA`` (as ``ndif up --with``): the server has that extra's packages. Locally, each pairing
is served by its stack with that extra (a folder and namespace of its own, :func:`config.default`),
and every probe is judged by its ``expect_with.<extra>`` expectation where it declares one
(:func:`.declarations.expectation`); the results are named ``<pairing>+<extra>-<date>``.

``--line`` was this option's old spelling: it is refused (exit 2) with the new one's name, since "line" now
means an nnsight release line only (``0.7``, ``0.8``).

This runner knows nothing about any single probe: what a probe does is its ``kind``, handled by
:mod:`.client`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from nnsight_repro import ROOT, channel, envs, fsutil, provenance
from .declarations import (PROBED_PAIRINGS, ProbeFileError, describe, expectation, headline, load_probes, matches,
                           parse_pairings, select, server_generation)

DEFAULT_PROBES = ROOT / "scripts" / "ndif_feasibility" / "probes.toml"
DEFAULT_OUT = ROOT / "results" / "ndif_feasibility"
CLIENT_MODULE = "nnsight_repro.ndif.feasibility.client"

#: How long a probe client may send nothing before it is killed and its probe recorded as ``NoAnswer``.
#: The longest silences a working client keeps are importing torch, nnsight and transformers before its
#: first event, building a probe's model before its first request, and a server provisioning a model on
#: request: tens of seconds on a loaded machine. nnsight's own wait for a job has no end.
NO_ANSWER_S = 600.0

# Exit codes: 0 every observation matched; 1 some did not (or the host was unreachable); 2 bad input.
EXIT_MISMATCH, EXIT_BAD_INPUT = 1, 2


# Hosts ----------------------------------------------------------------------------------------------

class Host:
    """Where requests go, and how a client process reaches it."""

    def __init__(self, url: str, api_key: Optional[str], local_cfg=None):
        self.url, self.api_key, self.local_cfg = url.rstrip("/"), api_key, local_cfg

    @property
    def kind(self) -> str:
        return "local NDIF stack" if self.local_cfg else "given host"

    def command(self, env: envs.Env, argv: List[str]) -> List[str]:
        if self.local_cfg is not None:
            from nnsight_repro.ndif import stack_clients
            return stack_clients.client_command(self.local_cfg, env, argv)  # inside the stack's namespace
        return [str(env.python), *argv]

    def environ(self, env: envs.Env) -> dict:
        extra = {"NDIF_HOST": self.url}
        if self.api_key:
            extra["NDIF_API_KEY"] = self.api_key
        return env.environ(extra)

    def reachable(self) -> Optional[str]:
        """None when the API answers ``/ping``; else why not."""
        if self.local_cfg is not None:
            from nnsight_repro.ndif import health
            answer = health.http_get(self.local_cfg, "/ping")
            return None if answer.get("status") == 200 else answer.get("error") or f"HTTP {answer.get('status')}"
        try:
            with urllib.request.urlopen(self.url + "/ping", timeout=10) as response:
                return None if response.status == 200 else f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"


class LocalStacks:
    """The project's local NDIF stacks, one per pairing's server; brings down what it brought up.

    One stack per generation runs at a time per cache, so a 0.7 pairing that needs the other
    server nnsight replaces the running 0.7 stack (said out loud). The runner orders pairings so each
    stack comes up once. Each stack's folder is this run's lease (``stack_state.lease``) from its first use to
    :meth:`down`; run by a lane job, the script is covered by the job's own.
    """

    def __init__(self, say, extras=()):
        self.say, self.ours, self.extras = say, {}, tuple(extras)
        self.leases = contextlib.ExitStack()
        self.refused = {}  # stack folder -> the StackError its lease timed out with: not waited out twice

    def host(self, pairing: str) -> Host:
        from nnsight_repro.ndif import config, errors, stack, stack_state

        declared = PROBED_PAIRINGS[pairing]
        cfg = config.default(line=declared.line, server=declared.server, extras=self.extras)
        if cfg.folder in self.refused:
            raise self.refused[cfg.folder]
        try:
            self.leases.enter_context(stack_state.lease(cfg, say=self.say))
        except errors.StackError as exc:
            self.refused[cfg.folder] = exc
            raise
        if stack.ensure_up(cfg, say=self.say):
            self.ours[cfg.netns] = cfg
        return Host(cfg.api_url, None, cfg)

    def down(self) -> None:
        from nnsight_repro.ndif import netns, stack

        with self.leases:
            for cfg in self.ours.values():
                if netns.exists(cfg.netns):
                    self.say(f"bringing the local {cfg.line} stack down (this run brought it up)")
                    stack.down(cfg)


def local_server(host: Host) -> Optional[dict]:
    if host.local_cfg is None:
        return None
    from nnsight_repro.ndif import stack_state

    state = stack_state.read_state(host.local_cfg) or {}
    return {"ndif": state.get("ndif"), "line": state.get("line"), "server": state.get("server"),
            "nnsight": state.get("server_nnsight"), "netns": state.get("netns")}


def serving_order(chosen: List[str]) -> List[str]:
    """Pairings grouped by the stack that serves them, so each local stack comes up once."""
    first_seen = {}
    for name in chosen:
        first_seen.setdefault((PROBED_PAIRINGS[name].line, PROBED_PAIRINGS[name].server), len(first_seen))
    return sorted(chosen, key=lambda n: first_seen[(PROBED_PAIRINGS[n].line, PROBED_PAIRINGS[n].server)])


# Running ---------------------------------------------------------------------------------------------

def run_pairing(pairing: str, probes: List[dict], host: Host, say) -> Tuple[Dict[str, dict], dict]:
    """Observations ``{id: observed}`` and the client's context; one status line per probe as it runs.

    A client that sends nothing for :data:`NO_ANSWER_S` is killed: the probe it was on is recorded as
    ``NoAnswer`` and the probes after it run in a fresh client, so one hung request costs one probe (a
    client silent before its first probe costs them all, as ``ClientDied``).
    """
    env = envs.ensure(PROBED_PAIRINGS[pairing].client)
    observed: Dict[str, dict] = {}
    context: dict = {}
    trail: Dict[str, List[str]] = {}
    pending = list(probes)
    while pending:
        # Events come through the result channel; nnsight's progress display on stdout/stderr stays a log.
        client = channel.start(host.command(env, ["-m", CLIENT_MODULE]), env=host.environ(env), cwd=ROOT,
                               input=json.dumps(pending),
                               what=f"the {pairing} probe client in the {env.name!r} environment")
        current, started, died, silent = None, 0.0, None, False
        while True:
            try:
                event = client.next(NO_ANSWER_S)
            except channel.ChannelTimeout as exc:
                died, silent = exc, True
                break
            except channel.ChannelError as exc:
                died = exc
                break
            if event is None:
                break
            probe_id = event.get("probe")
            if event.get("event") == "start":
                current, started = probe_id, time.perf_counter()
                trail[probe_id] = []
                say(f"{probe_id}: started")
            elif event.get("event") == "status":
                trail.setdefault(probe_id, []).append(event["status"])
                say(f"{probe_id}: {event['status']}")
            elif event.get("event") == "done":
                result = event["observed"]
                result["statuses"] = trail.get(probe_id, [])
                observed[probe_id] = result
                say(f"{probe_id}: {headline(result)} ({result['seconds']} s)")
            elif event.get("event") == "context":
                context = {"client": event["client"], "server_env": event["server_env"] or context.get("server_env")}
        returncode = client.process.wait()
        stderr_tail = client.stderr_tail(15)
        client.close()
        if silent and current is not None and current not in observed:
            statuses = trail.get(current, [])
            pending = pending[[p["id"] for p in pending].index(current) + 1:]
            after = "; the probes after this one ran in a fresh client" if pending else ""
            observed[current] = {"status": "error", "error": "NoAnswer",
                                 "message": f"the {pairing} client sent nothing for {NO_ANSWER_S:g} s "
                                            f"(last server status: {statuses[-1] if statuses else 'none'}) and "
                                            f"was killed{after}",
                                 "client_stderr_tail": stderr_tail,
                                 "seconds": round(time.perf_counter() - started, 3), "statuses": statuses}
            say(f"{current}: NoAnswer after {NO_ANSWER_S:g} s of silence"
                + (after and "; the rest go to a fresh client"))
            continue
        for probe in pending:
            if probe["id"] not in observed:
                # The client died before reaching this probe: that is its observation.
                observed[probe["id"]] = {"status": "error", "error": "ClientDied",
                                         "message": f"the {pairing} client exited with code {returncode} "
                                                    f"before this probe finished"
                                                    + (f" ({died.reason})" if died else ""),
                                         "client_stderr_tail": stderr_tail,
                                         "seconds": 0.0, "statuses": trail.get(probe["id"], [])}
                say(f"{probe['id']}: ClientDied (exit {returncode})")
        pending = []
    return observed, context


def unreachable(probes: List[dict], why: str) -> Dict[str, dict]:
    return {p["id"]: {"status": "error", "error": "HostUnreachable", "message": why, "seconds": 0.0,
                      "statuses": []} for p in probes}


def table(rows: List[dict]) -> str:
    headers = ["probe", "expected", "observed", "match", "s"]
    body = [[r["id"], describe(r["expected"]), headline(r["observed"], 90),
             "yes" if r["matched"] else "NO", str(r["observed"].get("seconds", ""))] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(out)


def markdown(record: dict) -> str:
    ctx, made = record["context"], record["provenance"]
    server = made["server"]
    out = [f"# NDIF feasibility: pairing `{record['client_line']}`", "",
           f"- made by `{made['command']}` on {made['host']} at {made['date']}",
           f"- server: {server['url']} ({server['kind']}; {server['generation']}"
           # "flavours": the extras under the old word, which the records keep (see pairing_record).
           + "".join(f", with {name}" for name in server.get("flavours", [])) + ")",
           f"- local server: {json.dumps(server.get('local'))}",
           f"- client: {json.dumps(ctx.get('client'))}", f"- server /env: {json.dumps(ctx.get('server_env'))}",
           f"- all matched: **{record['all_matched']}**", "",
           "| probe | isolates | expected | observed | match | s |", "|---|---|---|---|---|---|"]
    for r in record["probes"]:
        o = r["observed"]
        seen = headline(o)
        out.append(f"| {r['id']} | {r['declaration']['isolates']} | {describe(r['expected'])} | "
                   f"{seen.replace('|', '/')} | {'yes' if r['matched'] else '**NO**'} | {o.get('seconds', '')} |")
    return "\n".join(out) + "\n"


class OldSpelling(argparse.Action):
    """``--line``, the old spelling of ``--pairing``: refused (exit 2) with the new name, not taken as an
    alias, because "line" now means an nnsight release line only (``0.7``, ``0.8``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now --pairing (a client x server pairing: {', '.join(PROBED_PAIRINGS)})")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="probe_ndif.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Can our model panel run on NDIF? Probes declared as data, sent to a live host, results as JSON.",
        epilog=f"exit status:\n"
               f"  0  every probe observed what its declaration expects\n"
               f"  {EXIT_MISMATCH}  some probe observed something else (the record says which)\n"
               f"  {EXIT_BAD_INPUT}  bad input: the probe file, --probe, --pairing or --with (recorded as refused),\n"
               f"     or --line, the old spelling of --pairing\n")
    parser.add_argument("--probes", type=Path, default=DEFAULT_PROBES,
                        help=f"the probe declarations, TOML (default: {DEFAULT_PROBES.relative_to(ROOT)}; its schema "
                             f"is at its top)")
    parser.add_argument("--probe", metavar="ID,...", help="only these probes of the file, comma-separated ids "
                                                          "(default: every probe)")
    parser.add_argument("--pairing", default=",".join(PROBED_PAIRINGS), metavar="PAIRING,...",
                        help=f"client x server pairing(s), comma-separated (default: all): "
                             f"{', '.join(PROBED_PAIRINGS)}")
    parser.add_argument("--line", action=OldSpelling, nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--with", dest="extras", action="append", default=[], metavar="EXTRA",
                        help="the server has this extra's packages (repeatable; as `ndif up --with`): "
                             "local stacks with that extra, and each probe's expect_with.<extra>")
    parser.add_argument("--host", default=None, help="NDIF API URL (default: NDIF_HOST, else the local NDIF)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"directory for the records, <pairing>-<stamp>.json and .md "
                             f"(default: {DEFAULT_OUT.relative_to(ROOT)})")
    return parser


def host_for(pairing: str, given: Optional[Host], local: LocalStacks):
    """``(host, why)``: where ``pairing``'s probes go, and why none can (None: they can)."""
    try:
        host = given or local.host(pairing)
    except Exception as exc:  # the local stack did not come up: that is every probe's outcome
        return (Host("(local NDIF stack)", None),
                f"the local NDIF stack for {pairing} did not come up: {type(exc).__name__}: {exc}")
    why = host.reachable()
    return host, why and f"NDIF host {host.url} is unreachable: {why}"


def pairing_record(pairing: str, probes: List[dict], extras: tuple, observed: dict, context: dict) -> dict:
    """One pairing's record: each probe's expectation beside what was observed (its keys in the order
    the records have always had; the caller adds ``seconds`` and ``provenance``).

    The keys keep their old words (``client_line`` for the pairing, ``server_flavours`` for the extras, and
    the provenance's ``server.flavours``), so new records compare with the committed ones and their readers
    need one spelling."""
    rows = []
    for probe in probes:
        expected = expectation(probe, pairing, extras)
        rows.append({"id": probe["id"], "declaration": probe, "expected": expected,
                     "observed": observed[probe["id"]], "matched": matches(expected, observed[probe["id"]])})
    return {"client_line": pairing, "server_flavours": list(extras),
            "all_matched": all(r["matched"] for r in rows), "probes": rows, "seconds": None,
            "context": {"pairing": PROBED_PAIRINGS[pairing].shows, **context}, "provenance": None}


def main(argv=None) -> int:
    args = parser().parse_args(argv)

    def say(message: str) -> None:
        print(f"[probe_ndif] {message}", flush=True)

    command = provenance.command_line()

    def refuse(message: str, code: int) -> int:
        # Refused before any request, and recorded like a run: the refusal is the outcome. Its "lines" detail
        # is the chosen pairings under the old word, kept so new refusals read like the committed ones.
        print(f"probe_ndif: error: {message}", file=sys.stderr)
        fsutil.write_text(args.out / f"refused-{provenance.stamp()}.json", json.dumps(
            {"refused": message, "exit_code": code,
             "provenance": provenance.record(command, details={"probe_file": str(args.probes), "lines": args.pairing,
                                                               "probe_option": args.probe})},
            indent=1) + "\n")
        return code

    from nnsight_repro.ndif import server_packages

    try:
        chosen = parse_pairings(args.pairing)
        probes = load_probes(args.probes)
        if args.probe is not None:
            probes = select(probes, args.probe)
        extras = tuple(f.name for f in server_packages.extras(args.extras))
    except (ProbeFileError, server_packages.ExtraError) as exc:
        return refuse(str(exc), EXIT_BAD_INPUT)

    url = args.host or os.environ.get("NDIF_HOST")
    api_key = os.environ.get("NDIF_API_KEY")
    given = Host(url, api_key) if url else None
    local = LocalStacks(say, extras)
    suffix = "".join(f"+{name}" for name in extras)
    exit_code = 0
    try:
        for pairing in serving_order(chosen):
            started = time.perf_counter()
            host, why = host_for(pairing, given, local)
            say(f"pairing {pairing} ({PROBED_PAIRINGS[pairing].shows}) -> {host.url} ({host.kind})")
            if why:
                say(why)
                observed, context = unreachable(probes, why), {}
            else:
                observed, context = run_pairing(pairing, probes, host, say)
            record = pairing_record(pairing, probes, extras, observed, context)
            record["seconds"] = round(time.perf_counter() - started, 3)
            record["provenance"] = provenance.record(
                command,
                versions={"client": context.get("client") or {},
                          "server": (context.get("server_env") or {}).get("packages")
                          or (local_server(host) or {}).get("nnsight") or {}},
                server={"url": host.url, "kind": host.kind, "api_key_given": bool(host.api_key),
                        "generation": server_generation(pairing) if not given else "as the host reports",
                        "flavours": list(extras),
                        # What the local server runs, read from the stack's own state (ndif 0.0.1 has no /env).
                        "local": local_server(host)},
                details={"probe_file": str(args.probes), "probe_option": args.probe})
            target = args.out / f"{pairing}{suffix}-{provenance.stamp()}.json"
            fsutil.write_text(target, json.dumps(record, indent=1, default=str) + "\n")
            fsutil.write_text(target.with_suffix(".md"), markdown(record))
            print(table(record["probes"]), flush=True)
            all_matched = record["all_matched"]
            say(f"{pairing}: {'every observation matched' if all_matched else 'MISMATCH'}; wrote {target}")
            if not all_matched:
                exit_code = EXIT_MISMATCH
    finally:
        local.down()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
