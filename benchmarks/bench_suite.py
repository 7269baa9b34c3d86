"""The warm test command with the live-stack lane and without it: wall time of each, and the ratio.

    python3 benchmarks/bench_suite.py                          # one round: ahead, then on-demand
    python3 benchmarks/bench_suite.py --rounds 2 --json results/benchmarks/suite.json
    python3 benchmarks/bench_suite.py --modes ahead            # the default mode alone

Runs the README's test command (``CI=true python3 -m nnsight_repro test``, the environments already built)
once per mode of the lane (``NNSIGHT_REPRO_STACK_LANE``, tests/stack_lane.py): ``ahead``, the default, starts
the session's live-stack jobs before the first test and runs the tests that read them last; ``on-demand``
starts each job when a test first asks for it, in test order, as the suite ran before the lane. The
environments are built (or found) before the clock starts. ``ahead`` runs first in odd rounds and second in
even ones, so whatever a first run warms (the .pyc a process writes once) favours neither. Prints each run's
wall time, pytest's count and the load average, then ahead / on-demand, computed only when both modes ran
the same tests and passed; the record is rewritten after every run, so a failure loses nothing.

Each run also records where its CPU time went (``cpu_use.py``, beside this file): the machine's busy
core-seconds against the capacity (wall times cores), and core-seconds by live stack and by test module. Beside
them, the bar's capacity (eight minutes of every core): when the core-seconds the suite's own processes spent
exceed it, no scheduling of the same work meets the bar on this machine at this load; the machine's busy
time is printed too, and includes whatever else ran.

Not a test: two shared cores make the numbers move with load. Each run's whole output (pytest's
``--durations`` included) is kept beside the JSON's scratch logs under ``--logs``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from bench_setup import run  # noqa: E402  (beside this file; it puts the project on the path)
from cpu_use import CpuUse  # noqa: E402
from nnsight_repro import cli, envs, provenance, settings  # noqa: E402
from nnsight_repro.lane import MODES  # noqa: E402

#: Issue 39's bar for the warm test command, printed as a ratio beside the measurement.
BAR_S = 8 * 60
#: pytest's closing line, e.g. ``443 passed in 750.17s (0:12:30)``.
CLOSING = re.compile(r"^=+ (.*) in ([\d.]+)s", re.MULTILINE)


def one_run(mode: str, log: Path) -> dict:
    """One warm test command in ``mode``; a run that fails is recorded as failed and the bench goes on."""
    try:
        with CpuUse() as use:
            measured = run([sys.executable, "-m", "nnsight_repro", "test"], settings.cache_dir(),
                           {"CI": "true", settings.variable("STACK_LANE"): mode}, log=log)
    except SystemExit as exc:  # bench_setup.run's way of saying the command exited non-zero
        return {"mode": mode, "failed": str(exc)[-2000:], "log": str(log), "cpu": use.record()}
    closing = CLOSING.findall(log.read_text())
    if not closing:
        return {"mode": mode, "failed": "pytest printed no closing line", "log": str(log), "cpu": use.record()}
    counts, pytest_s = closing[-1]
    return {"mode": mode, "wall_s": measured["wall_s"], "pytest_s": float(pytest_s), "outcome": counts,
            "load": measured["load"], "log": str(log), "cpu": use.record()}


def cpu_lines(cpu: dict, top: int = 12, programs: int = 5) -> list:
    """The run's CPU use as printed: the machine against its capacity, then the largest places (a stack's
    with its largest programs)."""
    busy, capacity = cpu["machine_core_s"]["busy"], max(cpu["capacity_core_s"], 0.1)
    bar_capacity, ours = BAR_S * cpu["cores"], cpu["attributed_core_s"]
    lines = [f"  cpu: the suite's processes {ours:.0f} core-s; the bar's {BAR_S} s x {cpu['cores']} cores = "
             f"{bar_capacity} core-s: suite / that {ours / bar_capacity:.2f}x. Machine busy {busy:.0f} of "
             f"{capacity:.0f} core-s ({busy / capacity:.0%}; steal {cpu['machine_core_s']['steal']:.0f}, "
             f"iowait {cpu['machine_core_s']['iowait']:.0f}, unattributed {cpu['unattributed_core_s']:.0f})"]
    if cpu.get("sample_errors"):
        lines.append(f"  cpu sampling failed {len(cpu['sample_errors'])} times (undercounts): {cpu['sample_errors'][0]}")
    for where, place in list(cpu["by_where"].items())[:top]:
        lines.append(f"    {place['core_s']:7.1f} core-s {place['processes']:4d} sampled processes  {where}")
        lines += [f"      {run['core_s']:7.1f} core-s {run['processes']:4d}  {name}"
                  for name, run in list(place.get("by_program", {}).items())[:programs]]
    return lines


def summary(runs: list, modes=MODES) -> dict:
    """Median wall per mode and ahead / on-demand, when every run passed and both modes ran the same tests."""
    passed = [r for r in runs if "wall_s" in r and "failed" not in r.get("outcome", "")]
    walls = {mode: [r["wall_s"] for r in passed if r["mode"] == mode] for mode in modes}
    outcomes = {r["outcome"] for r in passed}
    if len(passed) < len(runs) or not all(walls.values()) or len(outcomes) != 1:
        return {}
    median = {mode: statistics.median(found) for mode, found in walls.items()}
    ratios = {"ratio_ahead_over_on_demand": round(median["ahead"] / median["on-demand"], 2)} if len(median) == 2 else {}
    return {"median_wall_s": median, **ratios, "bar_s": BAR_S, "ratio_bar_over_ahead": round(BAR_S / median["ahead"], 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}; "
                        "the ahead / on-demand ratio needs both")
    parser.add_argument("--logs", default=str(settings.cache_dir() / "bench-suite"), help="each run's output")
    parser.add_argument("--json", help="also write the record here (after every run)")
    args = parser.parse_args(argv)
    modes = [mode for mode in MODES if mode in args.modes.split(",")]
    if "ahead" not in modes or set(args.modes.split(",")) - set(MODES):
        parser.error(f"--modes {args.modes!r}: name ahead, and only modes of {', '.join(MODES)}")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    cli.setup()  # outside the clock: the bench times the suite, not the builds
    # The suite runs in `patched`; its clients and servers in the others, all from this commit's pins. Their
    # versions are read after the first run, which builds the NDIF server environments a cache lacks.
    record = {"provenance": provenance.record(provenance.command_line(), details={
                  "commit": provenance.commit(ROOT), "suite_env": "patched"}), "runs": []}
    for number in range(1, args.rounds + 1):
        for mode in (modes if number % 2 else modes[::-1]):
            result = {"round": number, **one_run(mode, logs / f"{provenance.stamp()}-{mode}.log")}
            record["runs"].append(result)
            if not record["provenance"]["versions"]:
                record["provenance"]["versions"] = envs.built_versions()
            if "failed" in result:
                print(f"round {number} {mode:9}: FAILED: {result['failed'][-300:]} (log: {result['log']})", flush=True)
            else:
                print(f"round {number} {mode:9}: {result['wall_s']} s wall, pytest {result['pytest_s']} s, "
                      f"{result['outcome']} [load {result['load'][0]} -> {result['load'][1]}]", flush=True)
            print("\n".join(cpu_lines(result["cpu"])), flush=True)
            # Rebuilt, not updated: a run that fails after others passed withdraws their summary.
            record = {"provenance": record["provenance"], "runs": record["runs"], **summary(record["runs"], modes)}
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    if "median_wall_s" not in record:
        print("no summary: a run failed, or the runs did not all run the same tests", flush=True)
        return 1
    median = record["median_wall_s"]
    against = (f", on-demand {median['on-demand']} s; ahead / on-demand {record['ratio_ahead_over_on_demand']}x"
               if "on-demand" in median else "")
    print(f"warm test command, median wall: ahead {median['ahead']} s{against}; the bar's {BAR_S} s / ahead "
          f"{record['ratio_bar_over_ahead']}x", flush=True)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
