"""Running code against a running stack: remote-client cases, Ray clients, and what the server reports back.

Owns starting a client environment's :mod:`.remote_client` inside the stack's namespace (:func:`start_client`,
:func:`run_client`, :func:`client_records`), which client environment may speak to which stack, the cold
start measured to the first trace (:func:`up_to_first_trace`) and its timing summary, Ray clients connecting
as the API does (:func:`ray_client_connects`), and the facts the server side records or derives (what the
model actors built, the inline-result cap).

Does not own the stack's life (:mod:`.stack`) nor the cases themselves (:mod:`.remote_client`). Client code
runs in a client environment, server code in the server environment, both as subprocesses in the namespace;
this module runs in the host's Python.

Stdlib only.
"""

from __future__ import annotations

import json
import statistics
from typing import Callable, List, Optional

from .. import ROOT, channel, envs
from . import config as configuration
from . import errors, generations, netns, server_env, stack
from .errors import StackError
from .health import status


def client_command(cfg: configuration.StackConfig, env: envs.Env, args: List[str]) -> List[str]:
    return netns.command(cfg.netns, [str(env.python), *args])


def start_client(cfg: configuration.StackConfig, cases: List[str], client: Optional[str] = None,
                 ready: bool = False, ready_timeout: float = 300) -> channel.Stream:
    """:mod:`remote_client` cases, started in a client environment (default: the generation's first,
    ``upstream-0.8`` for the 0.8 stack) inside the namespace; its records come through the channel.

    ``ready``: return only once the client says it is ready (a ``first:`` case has imported nnsight and
    wrapped its model; its first record is ``{"ready": case}``), so its start does not overlap the server's.
    """
    if not netns.exists(cfg.netns):
        raise StackError(f"No local NDIF stack is running (namespace {cfg.netns} does not exist); "
                         f"start one with `nnsight-repro ndif up{cfg.generation.line_option}`.")
    client = client or cfg.generation.clients[0]
    if client not in cfg.generation.clients:
        raise StackError(f"Client environment {client!r} does not speak the {cfg.line} stack's protocol; "
                         f"its clients: {', '.join(cfg.generation.clients)}.")
    env = envs.ensure(client, build=False)
    stream = channel.start(
        client_command(cfg, env, ["-m", "nnsight_repro.ndif.remote_client", "run", "--cases", ",".join(cases)]),
        env=env.environ({"NDIF_HOST": cfg.api_url}), cwd=ROOT,
        what=f"the remote client in the {client!r} environment, namespace {cfg.netns}")
    if ready:
        wait_ready(stream, ready_timeout)
    return stream


def wait_ready(client: channel.Stream, timeout: float) -> None:
    """Until the client's first record, ``{"ready": ...}``; a client that dies or hangs first is killed, named."""
    try:
        record = client.next(timeout)
    except channel.ChannelTimeout as exc:
        client.close()
        raise StackError(f"The remote client was not ready after {timeout:.0f} s: {exc}") from None
    except channel.ChannelError as exc:
        client.close()
        raise StackError(f"The remote client exited before it was ready: {exc}") from None
    if record is None or "ready" not in record:
        client.close()
        raise StackError(f"The remote client {'exited' if record is None else f'sent {record!r}'} "
                         f"before it was ready.")


def up_to_first_trace(cfg: configuration.StackConfig, model: str, client: str,
                      models: Optional[List[str]] = None, say: Callable[[str], None] = errors.say) -> dict:
    """A cold start measured: ``up`` with a ready ``first:<model>`` client waiting in the namespace (the
    clock starts once it is ready), until that client's remote trace returned. The state, with
    ``first_trace_s`` and ``first_request_s`` added to its timings; the client is gone either way.
    A failed trace raises (the stack stays up: the caller brings it down)."""
    first = {}

    def start_first_client(running_cfg):
        first["client"] = start_client(running_cfg, [f"first:{model}"], client=client, ready=True)

    try:
        state = stack.up(cfg, models=models, on_namespace=start_first_client, say=say)
        record = client_records(cfg, first["client"])[f"first:{model}"]
    finally:
        if "client" in first:
            first["client"].close()
    if not record.get("ok"):
        raise StackError(f"The first remote trace ({model}, {client} client) failed: {record}")
    state["timings"]["first_trace_s"] = round(record["done_epoch"] - state["cold_start_epoch"], 2)
    state["timings"]["first_request_s"] = record["request_s"]
    return state


def timing_medians(record: dict) -> dict:
    """A ``timing:`` case's record as medians, remote and local, and their ratio remote/local."""
    remote, local = statistics.median(record["remote_s"]), statistics.median(record["local_s"])
    return {"remote_median_s": round(remote, 4), "local_median_s": round(local, 4), "ratio": round(remote / local, 1)}


def client_records(cfg: configuration.StackConfig, client: channel.Stream, timeout: float = 600) -> dict:
    """The case records of a :func:`start_client` client; a client that dies, or a dead stack, is named."""
    try:
        sent = [r for r in client.records(timeout) if "ready" not in r]
        if len(sent) != 1 or "cases" not in sent[0]:
            raise client.error(f"sent {sent!r} instead of one record of cases")
    except channel.ChannelError as exc:
        problems = status(cfg)["problems"]
        health = ("; the stack is not healthy: " + "; ".join(problems)) if problems else ""
        raise StackError(f"The remote client failed{health}: {exc}") from None
    finally:
        client.close()
    records = sent[0]["cases"]
    # A failed case on a stack that died says so, instead of leaving the reader with a connection error.
    if any(not r.get("ok") for r in records.values()):
        problems = status(cfg)["problems"]
        if problems:
            for record in records.values():
                if not record.get("ok"):
                    record["stack_problems"] = problems
    return records


def run_client(cfg: Optional[configuration.StackConfig], cases: List[str], timeout: float = 600,
               client: Optional[str] = None) -> dict:
    """Run :mod:`remote_client` cases in a client environment (see :func:`start_client`) inside the namespace."""
    cfg = cfg or configuration.default()
    return client_records(cfg, start_client(cfg, cases, client), timeout)


def ray_client_connects(cfg: configuration.StackConfig, count: int, parallel: int = 2,
                        timeout: float = 600) -> List[dict]:
    """``parallel`` loops of ``count`` Ray clients connecting to the running stack's Ray as its API does
    (``ray_clients.py``, inside the namespace): every attempt's record, ``loop`` added."""
    env = server_env.ensure(build=False, line=cfg.line, extras=cfg.extras)
    argv = netns.command(cfg.netns, [str(env.python), "-m", "nnsight_repro.ndif.ray_clients",
                                     generations.RAY_CLIENT_ADDRESS, str(count)])
    loops = [channel.start(argv, env=cfg.environ(env.path / "venv" / "bin", role="api"), cwd=ROOT,
                           what=f"Ray client loop {number} in the {env.name!r} environment, namespace {cfg.netns}")
             for number in range(parallel)]
    records = []
    try:
        for number, loop in enumerate(loops):
            try:
                attempts = loop.records(timeout)
            except channel.ChannelError as exc:
                raise StackError(str(exc)) from None
            if len(attempts) != count:
                raise StackError(f"Ray client loop {number} reported {len(attempts)} of {count} connects.")
            records += [{**attempt, "loop": number} for attempt in attempts]
    finally:
        for loop in loops:
            loop.close()
    return records


def built_models(cfg: configuration.StackConfig) -> List[dict]:
    """What the model actors built, one record per model load, oldest first (``logs/built.jsonl``, :mod:`built_log`)."""
    try:
        text = cfg.built_log.read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def inline_cap(cfg: Optional[configuration.StackConfig] = None) -> int:
    """The largest result the server hands back inline (ndif derives it from our Redis's pubsub limits)."""
    cfg = cfg or configuration.default()
    env = server_env.ensure(build=False, extras=cfg.extras)
    try:
        found = channel.run_one(netns.command(cfg.netns, [str(env.python), "-m", "nnsight_repro.ndif.server_facts",
                                                          "inline-cap"]),
                                env=cfg.environ(env.path / "venv" / "bin"), cwd=ROOT, timeout=60,
                                what=f"the server environment {env.name!r} in namespace {cfg.netns} (its inline cap)")
    except channel.ChannelError as exc:
        raise StackError(f"Could not read the server's inline cap: {exc}") from None
    return found["inline_cap"]
