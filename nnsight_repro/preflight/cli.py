"""``python3 -m nnsight_repro preflight MODEL [--host URL] [--json]``: will MODEL run remotely, per client?

Thin: finds the config (:mod:`.checkpoint`), asks the host (:mod:`.server`), reads the module tree in the
environments (:mod:`.assess`, :mod:`.tree`), prints :func:`.assess.report` as text or JSON. Owns the exit
codes and the one-line errors. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List

from ..ndif import generations as ndif_generations
from . import assess, checkpoint, server

EXIT_OK, EXIT_HOST, EXIT_INPUT = 0, 1, 2

EPILOG = f"""\
MODEL is a checkpoint directory (what save_pretrained() wrote), its config.json, or a hub id already in the
local Hugging Face cache (HF_HUB_CACHE, HF_HOME). Only config.json is read: no weights, nothing from the hub.
The module tree is built on the meta device in the project environments {', '.join(assess.TREE_ENVS.values())}
(built first if missing); the network is touched only to ask --host.

exit status:
  {EXIT_OK}  the report was printed, whatever it says
  {EXIT_HOST}  the host does not answer, or is not an NDIF API
  {EXIT_INPUT}  bad input: MODEL, its config, or --automodel (the message says which and how to fix it);
     also a project environment that cannot be built, or whose reader died (the message names it)
"""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", metavar="MODEL", help="checkpoint directory, its config.json, or a cached hub id")
    parser.add_argument("--host", default=None, metavar="URL",
                        help="an NDIF API to ask (its /env and /status); default: NDIF_HOST, else none (offline)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--automodel", default=None, metavar="NAME",
                        help="the transformers Auto class you wrap MODEL with (default: the one that builds "
                             "config.architectures[0], else AutoModel)")
    parser.add_argument("--dtype", default=ndif_generations.NDIF_DEFAULT_DTYPE, choices=["bfloat16", "float32"],
                        help=f"the dtype the server loads models in (default {ndif_generations.NDIF_DEFAULT_DTYPE}, "
                             f"NDIF's; the project's 0.8 stack loads float32)")
    return parser


def parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(
        prog="nnsight-repro preflight", description=__doc__.splitlines()[0].split(": ", 1)[1],
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter))


def run(model: str, host_url: str | None = None, automodel: str | None = None,
        dtype: str = ndif_generations.NDIF_DEFAULT_DTYPE) -> dict:
    """The report for ``model``; raises :class:`checkpoint.InputError` or :class:`server.HostError`."""
    found = checkpoint.resolve(model)
    host = server.read(host_url) if host_url else None
    trees = assess.inspect([{"id": "model", "config_dir": str(found.folder), "automodel": automodel}])
    per_line = {line: result["model"] for line, result in trees.items()}
    refused = [t for t in per_line.values() if t.get("error") == "no_class"]
    if refused:
        raise checkpoint.InputError(f"{model}: {refused[0]['message']}")
    return assess.report(found, per_line, host, dtype,
                         environments={line: result["_environment"] for line, result in trees.items()})


def _tree_lines(report: dict) -> List[str]:
    tree = report["tree"]
    if tree is None:
        return []
    package = tree["package"]
    owner = (f"registered by {package['name']} {package['version']}: a server must import it where it builds "
             f"models" if package else "transformers' own")
    out = [f"  model_type {report['model_type']} ({owner})",
           f"  wrapped as {tree['wrapped']['class']} ({tree['wrapped']['automodel']}, from "
           f"{tree['wrapped']['chosen_by']}); {tree['modules']} modules, built on the meta device"]
    served = [c for c in tree["collisions"] if c["kind"] == "served"]
    if served:
        out.append("  submodules named like an nnsight attribute: " + "; ".join(
            f"{c['name']} x{c['count']} ({', '.join(c['patterns'][:3])})" for c in served))
    else:
        out.append("  no submodule is named like an nnsight attribute")
    if tree["bfloat16"]:
        b = tree["bfloat16"]
        out.append(f"  bfloat16: fails as the panel's {b['seen_on']} does ({b['message']}); fix: "
                   f"patches/{b['fix']}")
    return out


def render(report: dict) -> str:
    out = [f"{report['model']}: {report['config']}", *_tree_lines(report)]
    s = report["server"]
    if s is not None:
        packages = ("packages unknown (no /env)" if s["packages"] is None else
                    ", ".join(f"{n} {v or 'not installed'}" for n, v in s["packages"].items()))
        out.append(f"  server {s['url']}: nnsight {s['nnsight'] or '?'} ({s['line']} line); {packages}; "
                   f"{s['deployments']} deployment(s)")
    out += [f"  assumes: {note}" for note in report["notes"]]
    for c in report["clients"]:
        out += ["", f"{c['label']}: {c['verdict'].upper()}"]
        if "key" in c:
            out.append(f"  sends   {c['key']['wrapper']}:{json.dumps(c['key']['fields'])}")
            built = c["server_builds"]
            out.append(f"  builds  {built['from']} -> {built['class'] or 'nothing: no class for this model_type'}")
            for name, where in c["spelling"].items():
                out.append(f"  reads   a layer's {name} at .{where['nnsight']}; the submodule `{name}` is at "
                           f".{where['submodule']}")
            if c.get("caveat"):
                out.append(f"  caveat  {c['caveat']}")
            if "deployed" in c:
                level = c["deployed"]
                out.append("  deployed " + (f"{level['level']} ({level['state']})" if level else
                                            "no: not in /status (the local stacks provision a model on its first "
                                            "request; whether this host does is its operators' choice)"))
        changes = []
        for i, f in enumerate(c["failures"]):
            said = f" ({f['message']})" if f.get("message") and f["message"] != f["why"] else ""
            out.append(f"  {'fails' if i == 0 else 'then '}   {f['why']}{said}")
            if f.get("change") and f["change"] not in changes:  # one fix often removes several failures
                changes.append(f["change"])
        out += [f"  change  {change}" for change in changes]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return command(args)


def command(args) -> int:
    host = args.host or os.environ.get("NDIF_HOST") or None
    try:
        report = run(args.model, host, args.automodel, args.dtype)
    except checkpoint.InputError as exc:
        print(f"preflight: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except server.HostError as exc:
        print(f"preflight: error: {exc}", file=sys.stderr)
        return EXIT_HOST
    sys.stdout.write(json.dumps(report, indent=1) + "\n" if args.json else render(report))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
