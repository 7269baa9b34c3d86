"""``nnsight-repro ndif up|down|status`` (also ``python3 -m nnsight_repro.ndif``): thin over :mod:`stack`."""

from __future__ import annotations

import argparse
import json
import sys

from .. import envs
from . import config, deploy, netns, stack


def _print_status(report: dict) -> None:
    if not report["running"]:
        print(f"not running (namespace {report['netns']}); logs of the last run: {report['logs']}")
    else:
        state = report.get("state") or {}
        print(f"running in namespace {report['netns']} since {state.get('started', '?')} "
              f"(phase: {state.get('phase', '?')}); API {report['api_url']} inside it: {report.get('api')}")
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="nnsight-repro ndif",
                                     description="A local NDIF server (ndif 0.1.2, serving nnsight 0.8 clients) "
                                                 "in a private network namespace, with the project's tiny models.")
    sub = parser.add_subparsers(dest="action", required=True)
    u = sub.add_parser("up", help="start the stack, deploy the models, wait until they are HOT")
    u.add_argument("--models", default=",".join(deploy.SERVED),
                   help=f"comma-separated panel models to deploy (default: {','.join(deploy.SERVED)}; '' for none)")
    sub.add_parser("down", help="stop everything `up` started and delete the namespace")
    s = sub.add_parser("status", help="what runs, and each model's deployment level")
    s.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            state = stack.up(models=[m for m in args.models.split(",") if m])
            print(f"up: API {state['api_url']} in namespace {state['netns']}; run clients with "
                  f"`ip netns exec {state['netns']} ...` and NDIF_HOST={state['api_url']}")
            print("timings: " + ", ".join(f"{k} {v}" for k, v in state["timings"].items()))
        elif args.action == "down":
            stack.down()
        else:
            report = stack.status()
            if args.json:
                print(json.dumps(report, indent=1))
            else:
                _print_status(report)
            return 0 if report["running"] and not report["problems"] else 1
    except (stack.StackError, config.ConfigError, netns.NetnsError, deploy.DeployError, envs.EnvError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
