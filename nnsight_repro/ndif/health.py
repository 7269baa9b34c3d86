"""Asking a running stack how it is: HTTP from inside its namespace, ``/status``, and the whole report.

Owns :func:`probe` (a stdlib helper, :mod:`.probe`, run inside the namespace, since the stack listens on
the namespace's loopback only), the API's ``/ping`` and ``/status`` read from there, and :func:`status` /
:func:`healthy`: each service alive or not, the API answering, each model's level, the memory counters,
and every problem in words. Never raises for a dead stack: saying what is wrong is its job.

Does not own starting, stopping or waiting (:mod:`.stack`, :mod:`.services`); it reads the state
:mod:`.stack` writes (:mod:`.stack_state`).

Stdlib only.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, Optional

from .. import ROOT, channel
from . import config as configuration
from . import memcg, netns
from .errors import StackError
from .memory_watch import memory_group
from .stack_state import read_state


def probe(cfg: configuration.StackConfig, *args: str, timeout: float = 20.0) -> dict:
    """Ask :mod:`probe` a question from inside the namespace (with this Python: it needs only the stdlib)."""
    try:
        return channel.run_one(netns.command(cfg.netns, [sys.executable, "-m", "nnsight_repro.ndif.probe", *args]),
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=timeout,
                               what=f"a network probe in namespace {cfg.netns}")
    except channel.ChannelError as exc:
        raise StackError(f"Could not probe inside namespace {cfg.netns}: {exc}") from None


def http_get(cfg: configuration.StackConfig, path: str, timeout: float = 5.0) -> dict:
    return probe(cfg, "get", "--timeout", str(timeout), cfg.api_url + path)[cfg.api_url + path]


def api_status(cfg: configuration.StackConfig, timeout: float = 5.0) -> Optional[dict]:
    """The API's ``/status`` as JSON, or None while it cannot give one (within ``timeout``)."""
    answer = http_get(cfg, "/status", timeout)
    if answer.get("status") != 200:
        return None
    try:
        return json.loads(answer["body"])
    except ValueError:
        return None


def deployment_levels(status: dict) -> Dict[str, dict]:
    """``{model_key: {"level", "state"}}`` from a ``/status`` answer."""
    levels = {}
    for name, entry in (status or {}).get("deployments", {}).items():
        key = entry.get("model_key") or name.split(":ModelActor:", 1)[-1]
        levels[key] = {"level": entry.get("deployment_level"), "state": entry.get("application_state")}
    return levels



def status(cfg: Optional[configuration.StackConfig] = None) -> dict:
    """What runs: each service alive or not, the API answering, each model's level. Never raises for a dead stack."""
    cfg = cfg or configuration.default()
    state = read_state(cfg)
    report = {"netns": cfg.netns, "running": netns.exists(cfg.netns), "folder": str(cfg.folder),
              "logs": str(cfg.logs), "api_url": cfg.api_url, "state": state, "problems": [],
              "line": cfg.line}
    if not report["running"]:
        if state:
            report["problems"].append(f"the state file says a stack started {state.get('started')}, "
                                      f"but its namespace {cfg.netns} is gone")
        return report
    alive = set(netns.pids(cfg.netns))
    report["pids"] = sorted(alive)
    services = {}
    for name, info in ((state or {}).get("services") or {}).items():
        services[name] = {**info, "alive": info["pid"] in alive}
        if info["pid"] not in alive:
            report["problems"].append(f"{name} (pid {info['pid']}) is not running; see {info['log']}")
    report["services"] = services
    group = memory_group(cfg)
    report["memory"] = memcg.counters(group) if group else None
    if report["memory"] and report["memory"]["oom_kills"]:
        limit = report["memory"]["limit_mib"]
        report["problems"].append(f"the kernel killed {report['memory']['oom_kills']} of the stack's processes for "
                                  f"want of memory ({f'limit {limit} MiB' if limit is not None else 'no limit'})")
    try:
        ping = http_get(cfg, "/ping")
        report["api"] = "answering" if ping.get("status") == 200 else ping.get("error") or f"HTTP {ping.get('status')}"
        levels = deployment_levels(api_status(cfg)) if report["api"] == "answering" else {}
    except StackError as exc:
        report["api"], levels = f"unreachable: {exc}", {}
    if report["api"] != "answering":
        report["problems"].append(f"the API at {cfg.api_url} is not answering ({report['api']})")
    report["models"] = {}
    if cfg.generation.deploys_on_request:
        # Besides what `up` deployed (by name, below), what the server deployed on request, by key.
        named = set(((state or {}).get("models") or {}).values())
        report["models"] = {key: level for key, level in levels.items() if key not in named}
    for name, key in ((state or {}).get("models") or {}).items():
        report["models"][name] = levels.get(key, {"level": "missing", "state": None})
        if report["api"] == "answering" and report["models"][name]["level"] != "HOT":
            report["problems"].append(f"model {name} is {report['models'][name]['level']}, not HOT")
    if state and state.get("phase") != "ready":
        report["problems"].append(f"`up` has not finished (phase: {state.get('phase')})")
    return report


def healthy(cfg: Optional[configuration.StackConfig] = None) -> bool:
    report = status(cfg)
    return report["running"] and not report["problems"]

