"""The warm test command with the live-stack lane and without it: wall time of each, and the ratio.

    python3 benchmarks/bench_suite.py                          # one round: ahead, then on-demand
    python3 benchmarks/bench_suite.py --rounds 2 --json results/benchmarks/suite.json

Runs the README's test command (``CI=true python3 -m nnsight_repro test``, the environments already built)
once per mode of the lane (``NNSIGHT_REPRO_STACK_LANE``, tests/stack_lane.py): ``ahead``, the default, starts
the session's live-stack jobs before the first test and runs the tests that read them last; ``on-demand``
starts each job when a test first asks for it, in test order, as the suite ran before the lane. ``ahead``
runs first in every round, so whatever a first run warms (the .pyc a process writes once) favours the
baseline. Prints each run's wall time, pytest's count and the load average, then ahead / on-demand.

Not a test: two shared cores make the numbers move with load. Each run's whole output (pytest's
``--durations`` included) is kept beside the JSON's scratch logs under ``--logs``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench_setup import load, run  # noqa: E402  (beside this file; it puts the project on the path)
from nnsight_repro import envs, paths, provenance  # noqa: E402

MODES = ("ahead", "on-demand")
#: pytest's closing line, e.g. ``443 passed in 750.17s (0:12:30)``.
CLOSING = re.compile(r"^=+ (.*) in ([\d.]+)s", re.MULTILINE)


def one_run(mode: str, log: Path) -> dict:
    """One warm test command in ``mode``; a run that fails is recorded as failed and the bench goes on."""
    try:
        measured = run([sys.executable, "-m", "nnsight_repro", "test"], paths.cache_dir(),
                       {"CI": "true", paths.variable("STACK_LANE"): mode}, log=log)
    except SystemExit as exc:  # bench_setup.run's way of saying the command exited non-zero
        return {"mode": mode, "failed": str(exc)[-2000:], "log": str(log)}
    counts, pytest_s = CLOSING.findall(log.read_text())[-1]
    return {"mode": mode, "wall_s": measured["wall_s"], "pytest_s": float(pytest_s), "outcome": counts,
            "load": measured["load"], "log": str(log)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--logs", default=str(paths.cache_dir() / "bench-suite"), help="each run's output")
    parser.add_argument("--json", help="also write the record here")
    args = parser.parse_args(argv)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python3", "benchmarks/bench_suite.py", *(argv if argv is not None else sys.argv[1:])])
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    runs = []
    for number in range(1, args.rounds + 1):
        for mode in MODES:
            result = {"round": number, **one_run(mode, logs / f"{provenance.stamp()}-{mode}.log")}
            runs.append(result)
            if "failed" in result:
                print(f"round {number} {mode:9}: FAILED (log: {result['log']})", flush=True)
                continue
            print(f"round {number} {mode:9}: {result['wall_s']} s wall, pytest {result['pytest_s']} s, "
                  f"{result['outcome']} [load {result['load'][0]} -> {result['load'][1]}]", flush=True)
    # The suite runs in `patched` (its clients and servers in the others, all built from this commit's pins).
    record = {"provenance": provenance.record(command, versions={"suite": envs.reported_versions(
                  envs.ensure("patched", build=False))}, details={"commit": commit}), "runs": runs}
    walls = {mode: [r["wall_s"] for r in runs if r["mode"] == mode and "wall_s" in r] for mode in MODES}
    if all(walls.values()):
        median = {mode: statistics.median(found) for mode, found in walls.items()}
        record["median_wall_s"] = median
        record["ratio_ahead_over_on_demand"] = round(median["ahead"] / median["on-demand"], 2)
        print(f"warm test command, median wall: ahead {median['ahead']} s, on-demand {median['on-demand']} s; "
              f"ahead / on-demand {record['ratio_ahead_over_on_demand']}x; the issue's 6 min / ahead "
              f"{360 / median['ahead']:.2f}x", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(walls.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
