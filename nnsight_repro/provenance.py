"""The provenance record: how a results file was made, in one shape, under the key ``provenance``.

Every file the project writes to ``results/`` carries one::

    {"command":  the command as typed (``python3 -m nnsight_repro verify``, a script, ``pytest ...``),
     "date":     when the record was made: UTC, ISO 8601 to the second (``2026-12-01T12:34:56Z``),
     "host":     the hostname of the machine the command ran on (never a server's URL),
     "runner":   ``local``, or ``modal`` / ``modal-local`` for the Modal verify,
     "machine":  {hostname, platform, cpu, cpus, gpus, load_average} of the machine the work ran on
                 (for the Modal verify, the container),
     "versions": {side: {package: version}}: every environment involved, client and server alike,
     "server":   the NDIF server the run talked to ({url, kind, ...}), or null for an offline run,
     "details":  what only this kind of run records}

Stdlib only: it runs on the host, in every environment, and inside a Modal container. It does not
decide what a run's versions are (each writer knows its environments); it only gives them one place.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from . import procfs

#: ``date``'s format (UTC), and the one file names carry (``stamp``).
DATE_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"


def date(epoch: Optional[float] = None) -> str:
    return time.strftime(DATE_FORMAT, time.gmtime(epoch))


def stamp(epoch: Optional[float] = None) -> str:
    """The date as a file name part: ``20261201T123456Z``."""
    return time.strftime(STAMP_FORMAT, time.gmtime(epoch))


def command_line(argv: Optional[List[str]] = None, program: Optional[str] = None) -> str:
    """The command as a user types it: ``program`` (default: how this interpreter was started) and ``argv``."""
    argv = sys.argv if argv is None else argv
    if program is None:
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        # `python3 -m pkg.mod` leaves the module's file in argv[0]; say it the way it was typed.
        program = f"python3 -m {spec.name.removesuffix('.__main__')}" if spec and spec.name else f"python3 {argv[0]}"
        argv = argv[1:]
    return " ".join([program, *(shlex.quote(a) for a in argv)])


def commit(checkout: Path) -> str:
    """The checkout's HEAD, with ``-dirty`` when its work tree differs from it (then the commit does not name
    what ran); empty outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=checkout, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "HEAD")
    return head + ("-dirty" if head and git("status", "--porcelain") else "")


def machine() -> dict:
    """Where the command ran; called inside a Modal container too, so GPUs are looked up, not assumed."""
    cpu = procfs.cpu_model() or platform.processor()
    gpus: List[str] = []
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        gpus = [line.strip() for line in listed.stdout.splitlines() if line.strip()]
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "gpus": gpus,
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def record(command: str, *, versions: Optional[Dict[str, dict]] = None, server: Optional[dict] = None,
           runner: str = "local", where: Optional[dict] = None, details: Optional[dict] = None) -> dict:
    """The provenance of a results file made now by ``command`` (``where``: a machine description made
    elsewhere, e.g. inside the Modal container that ran the checks)."""
    return {"command": command, "date": date(), "host": socket.gethostname(), "runner": runner,
            "machine": where or machine(), "versions": versions or {}, "server": server,
            "details": details or {}}
