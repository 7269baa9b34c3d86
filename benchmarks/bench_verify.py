"""What the RNA/protein panel adds to the warm local verify (the job the test suite runs once per session).

    python3 benchmarks/bench_verify.py                     # 2 rounds, PANEL alone vs every model
    python3 benchmarks/bench_verify.py --rounds 3 --json results/benchmarks/verify.json

Each round runs ``python3 -m nnsight_repro verify`` twice into scratch directories, warm (every
environment already built): once with ``--models panel`` (the four toy models) and once with the default
(PANEL plus the RNA/protein panel), alternating which goes first. Both run every check. Printed: wall
seconds of each command, the check routine's own seconds from the report, the median seconds the panel
adds and the ratio all/PANEL, and the warm verify's median against its budget of 90 s (the bound a test
used to assert; ``--enforce-budget`` makes exceeding it the exit status). Not a test: on two shared cores the
numbers move with load, so the load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nnsight_repro import envs, models, provenance  # noqa: E402
from nnsight_repro.cli import TEST_ENVS  # noqa: E402

SELECTIONS = {"panel": ["--models", "panel"], "all": []}


def timed_verify(extra) -> dict:
    with tempfile.TemporaryDirectory() as out:
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "nnsight_repro", "verify", "--out", out, *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=3600)
        wall = time.monotonic() - started
        if run.returncode:
            raise SystemExit(f"verify {' '.join(extra)} exited {run.returncode}:\n{run.stderr[-3000:]}")
        report = json.loads(next(Path(out).glob("local-*.json")).read_text())
    return {"wall_s": round(wall, 1), "check_s": report["provenance"]["details"]["check_seconds"],
            "models": len(report["outcomes"]), "environments": report["environments"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="also write the record here")
    parser.add_argument("--budget", type=float, default=90.0, help="seconds the warm verify (every model) may take")
    parser.add_argument("--enforce-budget", action="store_true", help="exit 1 when the median exceeds --budget")
    args = parser.parse_args(argv)
    for name in [*TEST_ENVS, "tools"]:
        envs.ensure(name)  # warm means built: a build inside a timed run would swamp it
    commit = provenance.commit(ROOT)  # what ran: read before the runs, which take minutes
    runs = {name: [] for name in SELECTIONS}
    load = [os.getloadavg()]
    for round_ in range(args.rounds):
        order = list(SELECTIONS) if round_ % 2 == 0 else list(reversed(SELECTIONS))
        for name in order:
            runs[name].append(timed_verify(SELECTIONS[name]))
            shown = {k: v for k, v in runs[name][-1].items() if k != "environments"}
            print(f"round {round_ + 1} {name:5}: {shown}", flush=True)
        load.append(os.getloadavg())
    median = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()}
    summary = {"panel_models": len(models.PANEL), "all_models": len(models.extended()),
               "median_wall_s": median, "rna_panel_adds_s": round(median["all"] - median["panel"], 1),
               "ratio_all_over_panel": round(median["all"] / median["panel"], 2)}
    print(f"median wall: PANEL {median['panel']:.1f} s, all {median['all']:.1f} s -> the RNA/protein panel adds "
          f"{summary['rna_panel_adds_s']:.1f} s (all/PANEL = {summary['ratio_all_over_panel']:.2f}); "
          f"load average {load[0][0]:.1f} -> {load[-1][0]:.1f}")
    within = median["all"] <= args.budget
    summary["budget_s"], summary["within_budget"] = args.budget, within
    print(f"warm verify (every model): median {median['all']:.1f} s against a budget of {args.budget:.0f} s: "
          f"{'within' if within else 'OVER'}")
    if args.json:
        record = {"provenance": provenance.record(provenance.command_line(), versions=runs["all"][-1]["environments"],
                                                  details={"commit": commit}),
                  "load_average": load, "runs": runs, "summary": summary}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if args.enforce_budget and not within else 0


if __name__ == "__main__":
    sys.exit(main())
