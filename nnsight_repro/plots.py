"""The verify report's plots: one PNG per model, its per-position embedding shift in every environment, overlaid.

Drawn from the report JSON alone (``raw`` holds each environment's values), so a
report from Modal and one from this machine are drawn by the same code. The
verify driver is stdlib only, so the drawing itself runs in the ``tools``
environment, which has matplotlib (``draw_beside``); the environments under test
never get matplotlib. Run by hand to redraw: ``python -m nnsight_repro.plots REPORT.json``
inside that environment.

What this module deliberately does not do: compute or round any number. It draws
the values the check routine recorded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List

from . import channel, fsutil

#: Matched to environment names so the same environment looks the same in every plot. Line styles and
#: widths differ, not only colours: main and patched should coincide exactly, and a thin dashed line over
#: a wide solid one shows that they do.
STYLES = {
    "main": dict(color="#1f77b4", linestyle="-", linewidth=5.0, alpha=0.45),
    "patched": dict(color="#d62728", linestyle="--", linewidth=1.8, marker="o", markersize=4),
    "upstream-0.8": dict(color="#2ca02c", linestyle=":", linewidth=1.8, marker="x", markersize=6),
}
FALLBACK_STYLE = dict(linestyle="-.", linewidth=1.2, marker=".")


def file_names(report: dict, stem: str) -> Dict[str, str]:
    """Model -> PNG file name, for every model whose shift some environment recorded."""
    names = {}
    for model in report["outcomes"]:
        if any(rec["models"][model].get("embedding_shift", {}).get("ok") for rec in report["raw"].values()):
            names[model] = f"{stem}-{model}-embedding-shift.png"
    return names


def shifts(report: dict, model: str) -> Dict[str, dict]:
    """Environment -> that environment's embedding-shift record for ``model`` (only those that produced one)."""
    found = {}
    for env, rec in report["raw"].items():
        shift = rec["models"][model].get("embedding_shift", {})
        if shift.get("ok"):
            found[env] = shift
    return found


def draw(report: dict, out_dir: Path) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for model, name in report.get("plots", {}).items():
        per_env = shifts(report, model)
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        for env, shift in per_env.items():
            ax.plot(range(len(shift["values"])), shift["values"], label=env, **STYLES.get(env, FALLBACK_STYLE))
        substituted = {s["substituted_position"] for s in per_env.values()}
        for position in substituted:
            ax.axvline(position, color="0.6", linewidth=0.8, zorder=0)
        digests = {env: s["digest"] for env, s in per_env.items()}
        same = len(set(digests.values())) == 1
        ax.set_title(f"{model}: per-position embedding shift under a one-token substitution", fontsize=10)
        label = (f"same digest {next(iter(digests.values()))} in " if same else "digests DIFFER between ")
        ax.text(0.01, 0.97, label + ", ".join(digests),
                transform=ax.transAxes, va="top", fontsize=8, color="0.25" if same else "#d62728")
        ax.set_xlabel("token position (grey line: the substituted token)")
        ax.set_ylabel("L2 shift of the final hidden state")
        # Positions away from the substitution move by 1e-2 or exactly 0 (a decoder before it), the
        # substituted one by ~1: a linear axis would flatten everything but the peak.
        ax.set_yscale("symlog", linthresh=1e-3)
        # Shifts are norms, never negative; headroom keeps the peak and the label off the frame.
        peak = max(max(s["values"]) for s in per_env.values())
        ax.set_ylim(0, max(peak, 1e-3) * 4)
        ax.set_xticks(range(max(len(s["values"]) for s in per_env.values())))
        ax.grid(True, linewidth=0.3)
        ax.legend(fontsize=8, loc="upper right")
        fig.tight_layout()
        target = out_dir / name
        with fsutil.staged_file(target) as staging:  # keeps the suffix, by which savefig picks the format
            fig.savefig(staging)
        plt.close(fig)
        written.append(target)
    return written


def draw_beside(report_json: Path) -> List[Path]:
    """Draw the report's plots next to it, in the ``tools`` environment; return the files written."""
    from . import envs

    report_json = Path(report_json).resolve()
    env = envs.ensure("tools")
    try:
        drawn = env.run_one(["-m", "nnsight_repro.plots", str(report_json)], doing="drawing the plots", timeout=600,
                            extra_env={"MPLBACKEND": "Agg"})
    except channel.ChannelError as exc:
        raise envs.EnvError(f"Drawing the plots for {report_json} failed; the JSON and markdown are written. "
                            f"Redraw with `{env.python} -m nnsight_repro.plots {report_json}`.\n{exc}") from None
    return [Path(path) for path in drawn["written"]]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m nnsight_repro.plots REPORT.json", file=sys.stderr)
        return 2
    report_json = Path(args[0])
    written = [str(path) for path in draw(json.loads(report_json.read_text()), report_json.parent)]
    if channel.connected():
        channel.send({"written": written})
    else:  # run by hand: for a person to read
        print("\n".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
