"""``modal run modal_verify_patch.py``: the check routine in nnsight 0.7.0 as released and as patched, on Modal.

One image holds two environments built by the same steps from one clone of
ndif-team/nnsight at the series' base commit (pinned by full SHA here and
asserted after checkout): ``main`` is that tree, ``patched`` is that tree after
``git am`` of ``patches/nnsight-v0.7.0``. Both are installed the same way, from
the same pinned requirements (``nnsight_repro/pins/line-0.7.txt``), with the
same version string. One function runs the check routine
(``nnsight_repro.checks``) in ``main`` and then in ``patched``, in one
container, so the hardware cannot differ between them. The local entrypoint
turns the two records into the report the local verify writes
(``nnsight_repro.verify.report`` and ``.write``: JSON, markdown, one plot per
model) under ``results/verify/``, named ``modal-...``.

    modal run modal_verify_patch.py                                   # every model and check, CPU only
    modal run modal_verify_patch.py --models bert-mlm,gpt2 --checks remote_local,embedding_shift
    modal run modal_verify_patch.py --gpu T4 --out /tmp/verify        # the same on a machine with a T4

torch is the pinned version's CPU wheel from the PyTorch CPU index, the same
build the local environments install, so Modal's numbers are comparable with
this machine's. The check routine computes on the CPU (the panel is tiny and
never moved to a device): ``--gpu`` chooses the machine class the checks run
on, it does not move tensors to it.

Before any image is built, importing this file (``modal run`` does so first)
checks, on the local side only, that the base pinned here is the one
``patches/nnsight-v0.7.0/series`` names and that the series applies to it.
Unknown model or check names are refused before any container starts.

What this file deliberately does not do: define a check, compare records or
format a report. Those live in ``nnsight_repro`` and run unchanged here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import modal

from nnsight_repro import ROOT, envs, provenance, series, verify

# The image is defined by these constants alone: the module is imported again inside the container, where
# none of the local files they are checked against exists.
PYTHON_VERSION = "3.11"
NNSIGHT_REPO = "https://github.com/ndif-team/nnsight.git"
SERIES = "nnsight-v0.7.0"
BASE_REPO = "ndif-team/nnsight"
BASE_TAG = "v0.7.0"
BASE_COMMIT = "884bd1c7b0dbd53be01ade6a18843078d90367b4"
#: Both builds report this version: setuptools-scm is told it instead of deriving it from git, where the
#: patched tree (commits after the tag) would get another one.
NNSIGHT_VERSION = "0.7.0"
PINS = "line-0.7.txt"
#: The CPU wheel of the pinned torch: the build the local environments use, without gigabytes of CUDA.
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
IMAGE_ROOT = "/opt/verify"
IMAGE_ENVS = f"{IMAGE_ROOT}/envs"
VARIANTS = ("main", "patched")

PINS_FILE = envs.PINS / PINS
SERIES_DIR = series.PATCHES / SERIES
IMAGE_PINS = f"{IMAGE_ROOT}/pins/{PINS}"
IMAGE_SERIES_DIR = f"{IMAGE_ROOT}/patches/{SERIES}"

if modal.is_local():
    # Reads patches/ (absent in the container): a wrong base or a series that does not apply stops here,
    # before `modal run` builds an image or starts a container.
    verify.check_base(SERIES, repo=BASE_REPO, tag=BASE_TAG, commit=BASE_COMMIT)


def source_at_base(src: str) -> str:
    """Check out the base by full SHA, and fail the build unless HEAD is exactly that commit."""
    return (f"git -C {src} checkout --quiet --detach {BASE_COMMIT}"
            f" && test \"$(git -C {src} rev-parse HEAD)\" = {BASE_COMMIT}"
            f" || {{ echo 'nnsight checkout in {src} is not {BASE_COMMIT}' >&2; exit 1; }}")


def main_source_commands() -> List[str]:
    src = f"{IMAGE_ENVS}/main/src"
    return [f"git clone --quiet {NNSIGHT_REPO} {src}", source_at_base(src)]


def patched_source_commands() -> List[str]:
    # A local clone shares main's objects, so the base commit is there whatever branch points at it.
    src = f"{IMAGE_ENVS}/patched/src"
    listed = (f"$(sed -e '/^[[:space:]]*#/d' -e '/^[[:space:]]*$/d' -e 's|^|{IMAGE_SERIES_DIR}/|' "
              f"{IMAGE_SERIES_DIR}/series)")
    return [
        f"git clone --quiet {IMAGE_ENVS}/main/src {src}",
        source_at_base(src),
        f"git -C {src} -c user.name=nnsight-repro -c user.email=nnsight-repro@localhost"
        f" am --quiet --committer-date-is-author-date {listed}",
    ]


def install_commands(variant: str) -> List[str]:
    """The same steps for ``main`` and ``patched``: venv, torch (CPU), the pins, then nnsight with no deps."""
    env = f"{IMAGE_ENVS}/{variant}"
    python = f"{env}/venv/bin/python"
    pip = f"{python} -m pip --disable-pip-version-check --no-input"
    return [
        f"python -m venv {env}/venv",
        # torch alone first and without deps, so no resolver can prefer a CUDA build; the pins file names it.
        f"{pip} install --quiet --no-deps --index-url {TORCH_INDEX} \"$(grep -x 'torch==[^ ]*' {IMAGE_PINS})\"",
        f"{pip} install --quiet -r {IMAGE_PINS}",
        f"SETUPTOOLS_SCM_PRETEND_VERSION_FOR_NNSIGHT={NNSIGHT_VERSION} {pip} install --quiet --no-deps {env}/src",
        f"test \"$({python} -c 'import importlib.metadata as m; print(m.version(\"nnsight\"))')\" = {NNSIGHT_VERSION}",
    ]


image = (
    modal.Image.debian_slim(python_version=PYTHON_VERSION)
    .apt_install("git")
    # copy=True: build steps follow and must see the file; it also keys the layers below on its content.
    .add_local_file(PINS_FILE, IMAGE_PINS, copy=True)
    .run_commands(*main_source_commands(), *install_commands("main"))
    # Only now the series, so editing a patch rebuilds the patched layers and nothing above them.
    .add_local_dir(SERIES_DIR, IMAGE_SERIES_DIR, copy=True)
    .run_commands(*patched_source_commands(), *install_commands("patched"))
    # Mounted at container start, not copied: editing the check routine rebuilds nothing.
    .add_local_python_source("nnsight_repro")
)

app = modal.App("nnsight-verify-patch", image=image)


@app.function(cpu=2.0, memory=4096, timeout=30 * 60)
def check_main_and_patched(models: str = "", checks: str = "", envs_root: str = IMAGE_ENVS) -> dict:
    """The check routine in ``main``, then in ``patched``, in this one container.

    ``models``/``checks`` are comma-separated (default: all), as on the command
    line, so ``modal run modal_verify_patch.py::check_main_and_patched`` works too.
    ``envs_root`` holds ``<variant>/venv`` and ``<variant>/src``: the image's by
    default; ``.local()`` can point it at this machine's cached environments.
    """
    chosen_models, chosen_checks = verify.selection(verify.split(models), verify.split(checks))
    records = {}
    heads = {}
    for variant in VARIANTS:
        env = envs.Env(variant, Path(envs_root) / variant, stamp={})
        records[variant] = verify.record_in(env, chosen_models, chosen_checks)
        # The image's trees are git checkouts (main: the base; patched: the series on it); local ones are sdists.
        heads[variant] = (subprocess.run(["git", "-C", str(env.source), "rev-parse", "HEAD"], capture_output=True,
                                         text=True).stdout.strip() or None) if (env.source / ".git").exists() else None
    return {
        "records": records,
        "source_heads": heads,
        "check_routine_digest": verify.check_routine_digest(),
        "machine": provenance.machine(),
        "ran_on_modal": not modal.is_local(),
    }


def write_report(result: dict, out: Path, *, gpu: str = "", argv: Optional[List[str]] = None,
                 seconds: Optional[float] = None) -> Path:
    """The function's result as the verify report, through the same code the local verify uses."""
    details = {
        "nnsight_source": {
            "main": f"git clone {NNSIGHT_REPO} at {BASE_COMMIT}",
            "patched": f"git clone {NNSIGHT_REPO} at {BASE_COMMIT} + git am of patches/{SERIES}",
        },
        "source_heads": result["source_heads"],
        "ran_on_modal": result["ran_on_modal"],
        "gpu_requested": gpu or None,
        "image": {"python": PYTHON_VERSION, "torch_index": TORCH_INDEX, "pins": PINS},
        "modal_client": modal.__version__,
        "check_seconds": seconds,
    }
    # A result from `.local()` ran on this machine: its report must not pass for a Modal run.
    runner = "modal" if result["ran_on_modal"] else "modal-local"
    report = verify.report(result["records"], argv=argv or [Path(sys.argv[0]).name, *sys.argv[1:]],
                           runner=runner, series_name=SERIES, routine_digest=result["check_routine_digest"],
                           where=result["machine"], details=details)
    stem = f"{runner}-{gpu.lower().replace(':', 'x') if gpu else 'cpu'}-{provenance.stamp()}"
    return verify.write(report, Path(out), stem)


@app.local_entrypoint()
def main(models: str = "", checks: str = "", gpu: str = "", out: str = str(ROOT / "results" / "verify")) -> None:
    """Flags: --models/--checks comma-separated (default: all); --gpu e.g. T4 (default: none); --out a directory."""
    chosen_models, chosen_checks = verify.selection(verify.split(models), verify.split(checks))
    envs.ensure("tools")  # the plots are drawn there; built now so a failure costs no Modal run
    runner = check_main_and_patched.with_options(gpu=gpu) if gpu else check_main_and_patched
    started = time.monotonic()
    result = runner.remote(",".join(chosen_models), ",".join(chosen_checks))
    path = write_report(result, Path(out), gpu=gpu, seconds=round(time.monotonic() - started, 1))
    print(verify.markdown(json.loads(path.read_text())))
    print(f"wrote {path}, {path.with_suffix('.md')} and {len(verify.plots_of(path))} plots beside them")
