"""The zoo audit: every architecture transformers 5.22.2 and multimolecule 0.2.2 ship, in every environment.

``python3 -m nnsight_repro zoo [--subset ci|full] [--envs main,patched,upstream-0.8] [--out results/zoo]``

The parent (stdlib only) runs :mod:`nnsight_repro.zoo.worker` in each
environment's interpreter, two environments at a time. The worker sends one
record per unit through the result channel; a unit that crashes its worker (segfault, OOM kill) or runs
past ``--timeout`` is recorded as such, the worker is restarted after it, and
the scan goes on. What the records mean is summarized per architecture
(model_type) by :mod:`nnsight_repro.zoo.report`.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .. import channel, envs

ENVS = ["main", "patched", "upstream-0.8"]
#: Seconds one unit may take (meta build, wrap, round trip, tiny forward) before its worker is killed.
UNIT_TIMEOUT = 120
#: Seconds a worker may take to start (torch, transformers, multimolecule, nnsight).
STARTUP_TIMEOUT = 180

#: The CI subset, by unit id: the panel's encoders (BERT masked LM and base model, ESM, whose defaults cannot
#: be built so it is built tiny), two more colliding encoders, a decoder control with no collision, a
#: seq2seq model, a composite whose tiny forward cannot be set up, a multimolecule family, and one class that
#: cannot be built at all (Autoformer: its config leaves prediction_length to the checkpoint).
CI_UNITS = ("autoformer/AutoformerModel", "bert/BertForMaskedLM", "bert/BertModel", "electra/ElectraForMaskedLM",
            "esm/EsmForMaskedLM", "gpt2/GPT2LMHeadModel", "llama/LlamaForCausalLM",
            "llama/LlamaForSequenceClassification", "roberta/RobertaForMaskedLM", "t5/T5Model",
            "vision-encoder-decoder/VisionEncoderDecoderModel", "rnabert/RnaBertForMaskedLM")
#: The CI unit the test makes crash its worker (an injected segfault); units after it must still be scanned.
CI_CRASH_UNIT = "llama/LlamaForSequenceClassification"


class Worker:
    """One worker process in one environment; its messages arrive through the result channel."""

    def __init__(self, env: envs.Env, units: List[dict], extra_env: Optional[dict] = None,
                 log: Optional[Path] = None):
        # Its own session: a kill reaches anything it started, and only that.
        self.stream = env.start(["-m", "nnsight_repro.zoo.worker"], doing="the zoo worker", extra_env=extra_env,
                                input=json.dumps(units), stderr=log, new_session=True)

    def next(self, timeout: float) -> Optional[dict]:
        """The next message; None when the worker exited cleanly.

        Raises :class:`channel.ChannelTimeout` (the worker killed) when none comes within ``timeout``, and
        :class:`channel.ChannelError` when the worker died or sent something malformed.
        """
        return self.stream.next(timeout)

    def kill(self) -> None:
        self.stream.close()

    def exit_status(self) -> str:
        code = self.stream.process.wait()
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"


def scan_env(env_name: str, units: List[dict], *, unit_timeout: float = UNIT_TIMEOUT,
             extra_env: Optional[dict] = None, progress: Callable[[str, int], None] = lambda env, done: None,
             log_dir: Optional[Path] = None) -> dict:
    """{"environment": ..., "records": {id: record}, "restarts": n} for every unit, in one environment."""
    env = envs.ensure(env_name, build=False)
    records: Dict[str, dict] = {}
    environment: dict = {}
    restarts = 0
    pending = list(units)
    log = log_dir / f"worker-{env_name}.log" if log_dir else None
    # Every record as it arrives, so a parent that dies late in a long scan loses nothing.
    journal = open(log_dir / f"records-{env_name}.jsonl", "a") if log_dir else None
    try:
        while pending:
            before = len(records)
            worker = Worker(env, pending, extra_env, log)
            current, timeout = None, STARTUP_TIMEOUT
            while True:
                try:
                    message = worker.next(timeout)
                except channel.ChannelTimeout:
                    worker.kill()
                    if current is not None:
                        records[current] = {"id": current, "crash": {
                            "kind": "timeout", "reason": f"no result within {unit_timeout:g} s; worker killed"}}
                    break
                except channel.ChannelError as exc:
                    # Died (a segfault, an OOM kill) or sent a malformed message: the unit it began crashed it.
                    status = worker.exit_status() if exc.returncode else exc.reason
                    if current is not None:
                        records[current] = {"id": current, "crash": {"kind": "crash", "reason": status}}
                    worker.kill()
                    break
                if message is None:  # the worker exited cleanly
                    worker.kill()
                    break
                if "environment" in message:
                    environment = message["environment"]
                elif "begin" in message:
                    current, timeout = message["begin"], unit_timeout
                elif "record" in message:
                    records[message["record"]["id"]] = message["record"]
                    current = None
                    if journal:
                        journal.write(json.dumps(message["record"]) + "\n")
                        journal.flush()
                progress(env_name, len(records))
            pending = [u for u in pending if u["id"] not in records]
            if pending and len(records) == before:
                # Not one unit began: the environment is broken, and restarting would loop forever.
                raise RuntimeError(f"the zoo worker in {env_name!r} stopped before any unit "
                                   f"({worker.exit_status()}); see {log or 'its stderr'}")
            restarts += bool(pending)
    finally:
        if pending and "worker" in locals():
            worker.kill()  # the parent is going down (an error, Ctrl-C): leave no worker behind
        if journal:
            journal.close()
    return {"environment": environment, "records": records, "restarts": restarts}


def catalog(env_name: str) -> dict:
    """The units and the config types without a class, as the worker enumerates them in ``env_name``."""
    env = envs.ensure(env_name, build=False)
    return env.run_one(["-m", "nnsight_repro.zoo.worker", "--list"], doing="the zoo catalog",
                       timeout=STARTUP_TIMEOUT)


def select(units: List[dict], subset: str) -> List[dict]:
    if subset == "full":
        return units
    chosen = [u for u in units if u["id"] in CI_UNITS]
    missing = set(CI_UNITS) - {u["id"] for u in chosen}
    if missing:
        raise ValueError(f"CI units not in the catalog: {', '.join(sorted(missing))}")
    return chosen


class Progress:
    """One stderr line, rewritten in place: done/total per environment and the elapsed time."""

    def __init__(self, env_names: List[str], total: int):
        self.done = {name: 0 for name in env_names}
        self.total = total
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.last = 0.0

    def update(self, env_name: str, done: int) -> None:
        with self.lock:
            self.done[env_name] = done
            now = time.monotonic()
            if now - self.last < 1 and done < self.total:
                return
            self.last = now
            parts = "  ".join(f"{n} {d}/{self.total}" for n, d in self.done.items())
            sys.stderr.write(f"\r[zoo] {parts}  {now - self.started:.0f} s ")
            sys.stderr.flush()

    def finish(self) -> None:
        sys.stderr.write("\n")


def run(subset: str = "full", env_names: Optional[List[str]] = None, *, unit_timeout: float = UNIT_TIMEOUT,
        extra_env: Optional[dict] = None, parallel: int = 2, log_dir: Optional[Path] = None,
        only: Optional[List[str]] = None) -> dict:
    """Scan ``subset`` in each environment; the raw material of the report."""
    env_names = env_names or ENVS
    started = time.time()
    listing = catalog(env_names[0])
    units = select(listing["catalog"], subset)
    if only:
        units = [u for u in units if u["id"] in only or u["model_type"] in only]
    progress = Progress(env_names, len(units))
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = {name: pool.submit(scan_env, name, units, unit_timeout=unit_timeout, extra_env=extra_env,
                                     progress=progress.update, log_dir=log_dir) for name in env_names}
        scans = {name: future.result() for name, future in futures.items()}
    progress.finish()
    return {"subset": subset, "units": units, "scans": scans, "started": started,
            "seconds": round(time.time() - started, 1),
            "config_types_without_model_class": listing["config_types_without_model_class"]}


def main(args) -> int:
    from . import report as reports

    env_names = [e.strip() for e in args.envs.split(",") if e.strip()]
    out = Path(args.out)
    if args.rerender:
        reports.write(reports.rerender(out / "zoo.json", " ".join(["python3 -m nnsight_repro", *sys.argv[1:]])),
                         out)
        print(f"[zoo] re-rendered {out} from its records", file=sys.stderr)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    # Worker stderr (model warnings, tracebacks of crashes) is kept for debugging, never with the results.
    log_dir = Path(tempfile.mkdtemp(prefix="nnsight-repro-zoo-logs-"))
    print(f"[zoo] worker logs: {log_dir}", file=sys.stderr)
    scanned = run(args.subset, env_names, unit_timeout=args.timeout, parallel=args.parallel, log_dir=log_dir,
                  only=[o for o in (args.only or "").split(",") if o] or None)
    report = reports.report(scanned, command=" ".join(["python3 -m nnsight_repro", *sys.argv[1:]])
                               if args.command_line is None else args.command_line)
    reports.write(report, out)
    counts = report["counts"]
    print(f"[zoo] {counts['architectures']} architectures, {counts['colliding']} colliding, "
          f"{counts['failing_on_patched_colliding']} colliding failing on patched -> {out}", file=sys.stderr)
    return 0
