"""``nnsight-repro ndif up|down|status [--line 0.7 [--server stock|patched]] [--with multimolecule]`` and
``ndif panel`` (also ``python3 -m nnsight_repro.ndif``): thin over :mod:`stack` and :mod:`health`. Without ``--line``, the 0.8
stack; ``--with`` names an extra (:mod:`server_packages`), a stack of its own."""

from __future__ import annotations

import argparse
import json
import sys

from . import config, errors, health, server_packages, stack
from .generations import GENERATIONS


def _print_status(report: dict) -> None:
    if not report["running"]:
        print(f"not running (namespace {report['netns']}); logs of the last run: {report['logs']}")
    else:
        state = report.get("state") or {}
        server = f", {state['server']} nnsight on the server" if state.get("line") == "0.7" else ""
        server += "".join(f", with {name}" for name in state.get("with") or ())
        print(f"{report['line']} stack (ndif {state.get('ndif', '?')}{server}) running in namespace {report['netns']} "
              f"since {state.get('started', '?')} (phase: {state.get('phase', '?')}); "
              f"API {report['api_url']} inside it: {report.get('api')}")
        for name, info in (report.get("services") or {}).items():
            print(f"  {name:6} pid {info['pid']:<8} {'alive' if info['alive'] else 'DEAD':6} {info['log']}")
        for name, level in (report.get("models") or {}).items():
            print(f"  model {name:10} {level['level']} {level['state'] or ''}")
        timings = state.get("timings") or {}
        if timings:
            print("  timings: " + ", ".join(f"{k} {v}" for k, v in timings.items()))
        print(f"  logs: {report['logs']}")
    for problem in report["problems"]:
        print(f"  problem: {problem}")


#: Exit statuses of ``up``, ``down`` and ``status``; ``negative-control`` and ``panel`` say their own.
EXITS = """exit status:
  0  done (status: the stack runs and reports no problem)
  1  status: the stack is not running, or reports a problem
  2  usage error, or the stack could not be brought up or down (the message says why)
"""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nnsight-repro ndif",
                                     description="A local NDIF server in a private network namespace, with the "
                                                 "project's tiny models:\nndif 0.1.2 serving nnsight 0.8 clients "
                                                 "(default), or with --line 0.7 ndif 0.0.1 plus backports\nserving "
                                                 "nnsight 0.7.0 clients.",
                                     epilog=EXITS, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION", help="one of:")

    def action(name: str, help: str, **kwargs):
        return sub.add_parser(name, help=help, description=help, epilog=EXITS,
                              formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def stack_options(command):
        command.add_argument("--line", default="0.8", choices=sorted(GENERATIONS),
                             help="the nnsight line the stack serves (default 0.8)")
        command.add_argument("--with", dest="extras", action="append", default=[], choices=sorted(server_packages.EXTRAS),
                             help="an extra: its packages installed in the server environment and imported "
                                  "where models are built (nnsight_repro/ndif/server_packages.py); a stack of its own")
        return command

    u = stack_options(action("up", "start the stack, deploy the models, wait until they are HOT"))
    u.add_argument("--models", default=None,
                   help=f"comma-separated panel models to deploy at start, under the keys the stack's own client "
                        f"mints (default: {','.join(GENERATIONS['0.8'].served)}; 0.7 stack: {','.join(GENERATIONS['0.7'].served)}, "
                        f"and any other key deploys on its first request; '' for none)")
    u.add_argument("--memory-limit", type=int, default=None, metavar="MIB",
                   help="cap the memory of every process of the stack at MIB (its memory cgroup); without it the "
                        "stack is uncapped, and an OOM kill is reported as one either way")
    u.add_argument("--server", default="stock", choices=["stock", "patched"],
                   help="0.7 stack: the server build (the server's nnsight), stock 0.7.0 or the project's patched "
                        "build (default stock)")
    stack_options(action("down", "stop everything `up` started and delete the namespace"))
    s = stack_options(action("status", "what runs, and each model's deployment level"))
    s.add_argument("--json", action="store_true", help="print the status report as JSON")
    # Their own parsers read their arguments, `--help` included (negative_control.parser(), panel.parser()).
    sub.add_parser("negative-control", add_help=False,
                   help="0.7 stack: stock and patched nnsight 0.7.0 on client and server, every pairing, "
                        "-> results/ndif_0.7/negative_control.json")
    sub.add_parser("panel", add_help=False,
                   help="every panel model traced remotely on a server with a multimolecule extra "
                        "-> results/ndif_<line>/panel.json (+ .md; panel+<extra>.* for --with)")
    return parser


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "negative-control":
        from . import negative_control

        return negative_control.main(argv[1:])
    if argv and argv[0] == "panel":
        from . import panel

        return panel.main(argv[1:])
    args = parser().parse_args(argv)
    try:
        if args.action == "up":
            if args.server not in GENERATIONS[args.line].servers:
                having = [g.line for g in GENERATIONS.values() if args.server in g.servers]
                parser().error(f"--server {args.server} is a server build of the {' and '.join(having)} stack "
                               f"(use --line {having[0]})")
            cfg = config.default(line=args.line, server=args.server, extras=args.extras,
                                 memory_limit_mib=args.memory_limit)
            models = None if args.models is None else [m for m in args.models.split(",") if m]
            state = stack.up(cfg, models=models)
            print(f"up: API {state['api_url']} in namespace {state['netns']}; run clients with "
                  f"`ip netns exec {state['netns']} ...` and NDIF_HOST={state['api_url']}")
            print("timings: " + ", ".join(f"{k} {v}" for k, v in state["timings"].items()))
        elif args.action == "down":
            stack.down(config.default(line=args.line, extras=args.extras))
        else:
            report = health.status(config.default(line=args.line, extras=args.extras))
            if args.json:
                print(json.dumps(report, indent=1))
            else:
                _print_status(report)
            return 0 if report["running"] and not report["problems"] else 1
    except errors.USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
