#!/usr/bin/env python3
"""Benchmark: what an overloaded ``output`` mount costs on each nnsight line.

Every BERT layer has two submodules called ``output``. Released nnsight 0.7.0
synthesizes a new ``Envoy.Preserved`` class for each envoy with such a child
(two per layer); our series (env ``patched``) shares one memoized class, which
still travels by value; nnsight 0.8.1 (env ``upstream-0.8``) synthesizes
none. For each layer count and environment this measures, on the tiny
``bert-mlm`` panel model with random weights:

- synthesized envoy classes in one wrapper's tree (distinct class objects whose
  name contains ``Preserved``; 0.7.0 names them all alike), and across all the
  wrappers built while timing;
- ``NNsight(torch_model)`` construction time, best and median over ``--rounds``
  processes of ``--repeats`` constructions each, interleaved across
  environments (one untimed warm-up per process, a fresh copy of the torch
  model each time, one torch thread);
- the request ``trace(ids, remote="local")`` serializes: raw bytes (what
  nnsight sends with ``compress=False``) and zstd-compressed (nnsight's own
  level). On ``main`` the trace then fails at deserialization; serialization
  happens first, so the size is still measured and the error is recorded.
  ``--explain`` also breaks each request down by envoy field (from the pickle);
- what the synthesized classes alone cost a request (all of them by value): on
  the series the same at every depth;
- at the smallest layer count, ``--reloads`` loads of one request as a shared
  model actor would: live Envoy classes after the first load and after all of
  them, max RSS growth, and milliseconds per load.

It prints numbers and ratios against the bars; it asserts nothing. Run from the
project root with the system python (stdlib only here; each measurement runs
inside its environment, by this same file with ``--measure``)::

    python3 benchmarks/bench_overloaded_mount.py [--layers 2,12,48] [--repeats 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
ENVS = ["main", "patched", "upstream-0.8"]
MODEL = "bert-mlm"
#: nnsight's RequestModel.serialize(compress=True) uses this zstd level (0.7.0 and 0.8.1).
ZSTD_LEVEL = 6

#: (label, numerator env, denominator env, quantity, bar or None, layer counts the bar applies to or None for all)
RATIOS = [
    ("construct best   patched/main", "patched", "main", "construct_best_s", 1.05, None),
    ("construct median patched/main", "patched", "main", "construct_median_s", None, None),
    ("request raw  patched/upstream-0.8", "patched", "upstream-0.8", "request_raw_bytes", 0.85, {12}),
    ("request raw  patched/main", "patched", "main", "request_raw_bytes", 0.80, {12}),
    ("request zstd patched/upstream-0.8", "patched", "upstream-0.8", "request_zstd_bytes", None, None),
    ("request zstd patched/main", "patched", "main", "request_zstd_bytes", None, None),
]


# ---------------------------------------------------------------------------
# Measurement: runs inside an environment (torch, transformers, nnsight there).
# ---------------------------------------------------------------------------

def _quiet_warnings() -> None:
    import warnings

    # 0.7: "Module `...` has pre-defined a `output` attribute. nnsight access for `output` will be mounted at ..."
    # 0.8: "Module '...' has a submodule named 'output', which nnsight already serves on every module. ..."
    warnings.filterwarnings("ignore", message=r"Module .*(has pre-defined a|has a submodule named) ",
                            category=UserWarning)


def _synthesized(envoys) -> set:
    """Distinct synthesized envoy classes (objects, not names: 0.7.0 reuses one name)."""
    return {type(e) for e in envoys if "Preserved" in type(e).__name__}


def _envoy(root, dotted: str):
    node = root
    for part in dotted.split("."):
        node = node[int(part)] if part.lstrip("-").isdigit() else getattr(node, part)
    return node


def measure_construction(layers: int, repeats: int) -> dict:
    import copy
    import gc

    from nnsight import NNsight

    from nnsight_repro import models

    pristine = models.build_model(models.get(MODEL), layers)
    seen: set = set()
    times: List[float] = []
    wrapper = None
    for i in range(repeats + 1):  # the first is an untimed warm-up (imports, first-call caches)
        torch_model = copy.deepcopy(pristine)  # a module nnsight has not wrapped yet, as a user has
        wrapper = None
        gc.collect()
        started = time.perf_counter()
        wrapper = NNsight(torch_model)
        elapsed = time.perf_counter() - started
        seen |= _synthesized(wrapper.modules())
        if i:
            times.append(elapsed)
    per_tree = _synthesized(wrapper.modules())
    return {
        "envoys": sum(1 for _ in wrapper.modules()),
        "synthesized_classes": len(per_tree),
        "synthesized_class_names": sorted({f"{t.__module__}.{t.__qualname__}" for t in per_tree}),
        "synthesized_classes_all_wrappers": len(seen),
        "wrappers_built": repeats + 1,
        "construct_times_s": times,
        "construct_best_s": min(times),
        "construct_median_s": statistics.median(times),
    }


def _capture_serialize(payloads: List[bytes]):
    """Wrap ``RequestModel.serialize`` so every request it builds is also kept (uncompressed).

    0.7.0: ``LocalSimulationBackend`` calls ``RequestModel(...).serialize(compress=False)``
    (an instance method); 0.8.1: ``LocalSimulationBackend`` calls
    ``RequestModel.serialize(tracer, compress=False)`` (a classmethod). Either way
    the return value is exactly the bytes a server would receive. Returns an undo.
    """
    import functools
    import inspect

    import zstandard
    from nnsight.schema.request import RequestModel

    static = inspect.getattr_static(RequestModel, "serialize")
    is_classmethod = isinstance(static, classmethod)
    func = static.__func__ if is_classmethod else static
    signature = inspect.signature(func)

    @functools.wraps(func)
    def serialize(*args, **kwargs):
        data = func(*args, **kwargs)
        compressed = signature.bind(*args, **kwargs).arguments.get("compress", False)
        payloads.append(zstandard.ZstdDecompressor().decompress(data) if compressed else data)
        return data

    setattr(RequestModel, "serialize", classmethod(serialize) if is_classmethod else serialize)
    return lambda: setattr(RequestModel, "serialize", static)


def measure_request(layers: int, dump: Optional[str]) -> dict:
    """Size of the request ``trace(remote="local")`` serializes."""
    import zstandard
    from transformers import AutoTokenizer

    from nnsight_repro import lines, models

    entry = models.get(MODEL)
    line = lines.current()
    path = models.saved_model(MODEL, layers)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    line.seed_hub_ids({str(path): f"nnsight-repro/{MODEL}"})
    model = line.wrap(path, entry, tokenizer)
    layer = _envoy(model, entry.first_layer)
    attr = line.output_attr(layer)
    ids = models.token_ids(tokenizer, models.SENTENCE)

    payloads: List[bytes] = []
    result: Dict[str, object] = {"wrapper": type(model).__name__, "read": f"{entry.first_layer}.{attr}",
                                 "trace": "ok"}
    undo = _capture_serialize(payloads)
    try:
        # No lambdas in here: 0.7.0 cannot serialize them.
        with model.trace(ids, remote="local"):
            saved = getattr(layer, attr).save()
    except Exception as exc:  # main: NameError at deserialization, after serializing
        result["trace"] = type(exc).__name__
        result["trace_message"] = (str(exc).strip().splitlines() or [""])[0][:300]
    finally:
        undo()
    if result["trace"] == "ok":
        value = saved
        while isinstance(value, (tuple, list)):
            value = value[0]
        result["saved_shape"] = list(getattr(value, "shape", []))

    result["requests_serialized"] = len(payloads)
    if payloads:
        raw = payloads[0]
        result["request_raw_bytes"] = len(raw)
        result["request_zstd_bytes"] = len(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw))
        if dump:
            target = Path(dump) / f"request-{os.environ.get('NNSIGHT_REPRO_ENV', 'env')}-{layers}l.pkl"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(raw)
            result["request_dump"] = str(target)
    else:
        result["request_raw_bytes"] = result["request_zstd_bytes"] = None
    result["synthesized_classes_trace_wrapper"] = len(_synthesized(model.modules()))
    from nnsight.intervention import serialization

    # What the classes themselves cost a request: all of them go by value, once each.
    classes = sorted(_synthesized(model.modules()), key=id)
    result["synthesized_classes_bytes"] = len(serialization.dumps(classes)) - len(serialization.dumps([]))
    if payloads and RELOADS:
        result.update(measure_reloads(model, payloads[0], RELOADS))
    return result


#: Set by --reloads: how often one request is loaded again for the live-class count (0: not measured).
RELOADS = 0


def measure_reloads(model, payload: bytes, count: int) -> dict:
    """Load one request ``count`` times, as a shared model actor would: do classes or memory accumulate?"""
    import resource

    from nnsight.schema.request import RequestModel

    from nnsight_repro.wire import live_envoy_classes

    persistent = model._remoteable_persistent_objects()
    try:
        RequestModel.deserialize(payload, persistent)
    except Exception as exc:  # main: the hooked_output NameError
        return {"reloads": count, "reload_error": f"{type(exc).__name__}: {exc}"[:300]}
    before, rss_before = live_envoy_classes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    for _ in range(count):
        RequestModel.deserialize(payload, persistent)
    seconds = time.perf_counter() - started
    return {"reloads": count, "reload_s": seconds / count, "live_envoy_classes_before": before,
            "live_envoy_classes_after": live_envoy_classes(),
            "max_rss_growth_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before}


def measure(layers: int, repeats: int, dump: Optional[str], request: bool = True) -> dict:
    from importlib.metadata import version

    import torch

    _quiet_warnings()
    torch.set_num_threads(1)
    record = {
        "env": os.environ.get("NNSIGHT_REPRO_ENV", ""),
        "versions": {"python": platform.python_version(), "nnsight": version("nnsight"),
                     "torch": version("torch"), "transformers": version("transformers"),
                     "zstandard": version("zstandard")},
        "torch_threads": torch.get_num_threads(),
        "layers": layers,
    }
    record.update(measure_construction(layers, repeats))
    if request:
        record.update(measure_request(layers, dump))
    return record


# ---------------------------------------------------------------------------
# Request anatomy (--explain): which bytes of a request belong to which envoy
# field. Stdlib only (pickletools), so it runs in the driver on saved payloads.
# ---------------------------------------------------------------------------

#: Objects counted as envoys: classes with "Envoy" in the name, or a root wrapper.
WRAPPERS = {"NNsight", "LanguageModel", "TransformersModel"}
_MUTATORS = {"SETITEM", "SETITEMS", "APPEND", "APPENDS", "BUILD", "ADDITEMS"}
FIELD_NOTES = {
    "_module": "_module (pers. id 'Module:<path>')",
    "path": "path ('model.<dotted path>')",
    "<class + object/dict framing>": "class + framing (+ by-value classes)",
}


class _Item:
    """A value on the simulated pickle stack and the span of bytes that built it."""

    __slots__ = ("start", "end", "value", "is_object", "cls", "entries", "state", "canonical")

    def __init__(self, start: int, end: int, value=None, is_object: bool = False, cls=None):
        self.start, self.end, self.value, self.is_object, self.cls = start, end, value, is_object, cls
        self.entries: list = []  # (key item, value item) of a dict
        self.state = None  # what BUILD set on an object
        self.canonical = self  # a memo reference points at the item it refers to


def _class_name(item) -> Optional[str]:
    value = item.canonical.value if item is not None else None
    if isinstance(value, tuple) and value and value[0] in ("global", "skeleton"):
        return value[-1]
    return None


def _pickled_objects(data: bytes) -> list:
    """Every object a BUILD gave state to, with its class and byte span (a pickle-machine simulation)."""
    import pickletools

    ops = list(pickletools.genops(data))
    stack: list = []
    marks: List[int] = []
    memo: dict = {}
    built = []
    for index, (op, arg, pos) in enumerate(ops):
        end = ops[index + 1][2] if index + 1 < len(ops) else len(data)
        name = op.name
        if name in ("PROTO", "FRAME", "STOP"):
            continue
        if name == "MARK":
            marks.append(len(stack))
            continue
        if name == "MEMOIZE":
            memo[len(memo)] = stack[-1].canonical
            continue
        if name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1].canonical
            continue
        if name in ("GET", "BINGET", "LONG_BINGET"):
            ref = _Item(pos, end, memo[arg].value)
            ref.canonical = memo[arg]
            stack.append(ref)
            continue
        before = op.stack_before
        if pickletools.markobject in before:
            sliced = stack[marks.pop():]
            del stack[len(stack) - len(sliced):]
            fixed = before.index(pickletools.markobject)
        else:
            sliced, fixed = [], len(before)
        popped = (stack[len(stack) - fixed:] if fixed else []) + sliced
        if fixed:
            del stack[-fixed:]
        if name in _MUTATORS:
            target = popped[0]
            if name in ("SETITEM", "SETITEMS"):
                pairs = popped[1:]
                target.canonical.entries.extend(zip(pairs[0::2], pairs[1::2]))
            elif name == "BUILD":
                target.canonical.state = popped[1]
                if target.canonical.is_object:
                    built.append(target.canonical)
            target.end = end
            stack.append(target)
            continue
        if name in ("POP", "POP_MARK"):
            continue
        if name == "DUP":
            stack.extend(popped + popped)
            continue
        start = min([p.start for p in popped] + [pos])
        value, is_object = (arg if isinstance(arg, str) else None), False
        if name == "GLOBAL":
            module, _, qualname = arg.partition(" ")
            value = ("global", module, qualname)
        elif name == "STACK_GLOBAL":
            value = ("global", popped[0].canonical.value, popped[1].canonical.value)
        elif name.startswith("TUPLE") or name == "EMPTY_TUPLE":
            value = tuple(p.canonical.value for p in popped)
        elif name in ("NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"):
            is_object = True
        elif name == "REDUCE":
            function, args = popped[0].canonical.value, popped[1].canonical.value
            if isinstance(function, tuple) and function[-1] == "_make_skeleton_class" and isinstance(args, tuple):
                value = ("skeleton", args[1])  # cloudpickle: a class pickled by value
            else:
                is_object = True
        stack.append(_Item(start, end, value, is_object, popped[0] if is_object and popped else None))
    return built


def request_anatomy(data: bytes) -> dict:
    """Bytes of a request by envoy field, each envoy's own bytes only (its child envoys excluded).

    A value already in the pickle's memo costs only a reference where it
    appears again; a class pickled by value is counted with the first envoy
    that uses it, under "class + framing".
    """
    seen, envoys = set(), []
    for obj in _pickled_objects(data):
        name = _class_name(obj.cls) or ""
        if ("Envoy" in name or name in WRAPPERS) and id(obj) not in seen:
            seen.add(id(obj))
            envoys.append(obj)
    if not envoys:
        return {"bytes": len(data), "envoys": 0}
    ordered = sorted(envoys, key=lambda o: (o.start, -o.end))
    children: Dict[int, list] = {id(o): [] for o in ordered}
    open_: list = []
    for obj in ordered:
        while open_ and not (open_[-1].start <= obj.start and obj.end <= open_[-1].end):
            open_.pop()
        if open_:
            children[id(open_[-1])].append(obj)
        open_.append(obj)
    fields: Dict[str, int] = {}
    counts: Dict[str, int] = {}
    classes: Dict[str, int] = {}

    def add(field: str, size: int) -> None:
        fields[field] = fields.get(field, 0) + size
        counts[field] = counts.get(field, 0) + 1

    for obj in envoys:
        name = _class_name(obj.cls)
        classes[name] = classes.get(name, 0) + 1
        kids = children[id(obj)]
        own = (obj.end - obj.start) - sum(k.end - k.start for k in kids)
        accounted = 0
        state = obj.state.canonical if obj.state is not None else None
        for key, value in state.entries if state is not None else []:
            nested = sum(k.end - k.start for k in kids if value.start <= k.start and k.end <= value.end)
            size = (key.end - key.start) + (value.end - value.start) - nested
            child = value.canonical.is_object and value.canonical in kids
            add("<child envoy attribute>" if child else str(key.canonical.value), size)
            accounted += size
        add("<class + object/dict framing>", own - accounted)
    tree = ordered[0].end - ordered[0].start
    return {"bytes": len(data), "envoys": len(envoys), "envoy_classes": classes, "envoy_tree_bytes": tree,
            "outside_envoy_tree_bytes": len(data) - tree, "fields": fields, "field_counts": counts}


def print_anatomy(names: List[str], results: Dict[str, dict]) -> None:
    anatomies = {n: results.get(n, {}).get("request_anatomy") for n in names}
    anatomies = {n: a for n, a in anatomies.items() if a and a.get("envoys")}
    if not anatomies:
        return
    width = 14
    shown = list(anatomies)
    print(f"\n{'request anatomy (raw bytes)':40}" + "".join(f"{n:>{width}}" for n in shown))

    def row(label, get, fmt="{:,}"):
        cells = []
        for n in shown:
            value = get(anatomies[n])
            cells.append("-" if value is None else fmt.format(value))
        print(f"{label:40}" + "".join(f"{c:>{width}}" for c in cells))

    row("total", lambda a: a["bytes"])
    row("outside the envoy tree", lambda a: a["outside_envoy_tree_bytes"])
    row("envoy tree", lambda a: a["envoy_tree_bytes"])
    row("envoys", lambda a: a["envoys"])
    row("envoy tree / envoy", lambda a: a["envoy_tree_bytes"] / a["envoys"], "{:.1f}")

    def per_envoy(a, field):
        return a["fields"].get(field) if a["field_counts"].get(field, 0) * 2 > a["envoys"] else None

    per_envoy_fields = sorted({f for a in anatomies.values() for f in a["fields"] if per_envoy(a, f) is not None},
                              key=lambda f: -max((per_envoy(a, f) or 0) / a["envoys"] for a in anatomies.values()))
    print("  fields on most envoys, bytes per envoy:")
    for field in per_envoy_fields:
        row(f"    {FIELD_NOTES.get(field, field)}",
            lambda a: None if per_envoy(a, field) is None else per_envoy(a, field) / a["envoys"], "{:.1f}")
    row("    sum", lambda a: sum(per_envoy(a, f) or 0 for f in a["fields"]) / a["envoys"], "{:.1f}")
    row("  fields of the root wrapper only (total)",
        lambda a: sum(v for f, v in a["fields"].items() if per_envoy(a, f) is None))
    for n in shown:
        few = {f: v for f, v in anatomies[n]["fields"].items() if per_envoy(anatomies[n], f) is None and v >= 100}
        if few:
            print(f"    {n}: " + ", ".join(f"{f} {v:,}" for f, v in sorted(few.items(), key=lambda x: -x[1])))


# ---------------------------------------------------------------------------
# Driver: system python, stdlib only.
# ---------------------------------------------------------------------------

def _versions_from_stamp(stamp: dict) -> Dict[str, str]:
    wanted = {"nnsight", "torch", "transformers"}
    found = {}
    for line in stamp.get("packages", []):
        name, sep, ver = line.partition("==")
        if sep and name.lower() in wanted:
            found[name.lower()] = ver
        elif " @ " in line and line.split(" @ ")[0].lower() in wanted:
            found[line.split(" @ ")[0].lower()] = line.split(" @ ", 1)[1]
    return found


def run_one(env, layers: int, repeats: int, dump: Optional[str], timeout: float, request: bool,
            reloads: int = 0) -> dict:
    from nnsight_repro import channel

    args = [str(Path(__file__).resolve()), "--measure", "--layers", str(layers), "--repeats", str(repeats),
            "--reloads", str(reloads)]
    if dump:
        args += ["--dump-payloads", str(Path(dump).resolve())]
    if not request:
        args.append("--skip-request")
    started = time.monotonic()
    try:
        record = env.run_one(args, doing=f"the benchmark's measurement at {layers} layers", timeout=timeout)
    except channel.ChannelError as exc:  # died, killed, past the timeout, or no record: recorded, the run goes on
        return {"failed": exc.reason, "stderr_tail": "\n".join(exc.stderr_tail.splitlines()[-12:])}
    record["wall_s"] = round(time.monotonic() - started, 1)
    return record


def merge_rounds(rounds: List[dict]) -> dict:
    """One record per environment and layer count: the first round's, with every round's timings pooled."""
    good = [r for r in rounds if "failed" not in r]
    if not good:
        return rounds[0]
    merged = dict(good[0])
    times = [t for r in good for t in r["construct_times_s"]]
    merged["construct_times_s_by_round"] = [r["construct_times_s"] for r in good]
    merged.pop("construct_times_s", None)
    merged["construct_samples"] = len(times)
    merged["construct_best_s"] = min(times)
    merged["construct_median_s"] = statistics.median(times)
    merged["rounds_ok"] = len(good)
    merged["wall_s"] = round(sum(r.get("wall_s", 0) for r in good), 1)
    failures = [r for r in rounds if "failed" in r]
    if failures:
        merged["failed_rounds"] = failures
    counts = {(r["synthesized_classes"], r["envoys"]) for r in good}
    if len(counts) > 1:
        merged["inconsistent_counts"] = sorted(counts)
    return merged


def ratios_for(layers: int, results: Dict[str, dict]) -> List[dict]:
    rows = []
    for label, num, den, key, bar, applies in RATIOS:
        a, b = results.get(num, {}).get(key), results.get(den, {}).get(key)
        value = a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
        bar_here = bar if bar is not None and (applies is None or layers in applies) else None
        rows.append({"ratio": label, "quantity": key,
                     "numerator": num, "denominator": den, "value": value, "bar": bar_here,
                     "holds": None if bar_here is None or value is None else value <= bar_here})
    return rows


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "ms":
        return f"{value * 1e3:.2f}"
    if kind == "int":
        return f"{value:,}"
    return str(value)


def print_table(layers: int, repeats: int, rounds: int, names: List[str], results: Dict[str, dict],
                ratios: List[dict]) -> None:
    print(f"\n== {MODEL}, {layers} layers (construction: {rounds} rounds x {repeats} timed, 1 torch thread) ==")
    width = 14
    print(f"{'':34}" + "".join(f"{n:>{width}}" for n in names))
    rows = [
        ("nnsight", lambda r: r.get("versions", {}).get("nnsight"), "str"),
        ("envoys in NNsight tree", lambda r: r.get("envoys"), "int"),
        ("synthesized classes / tree", lambda r: r.get("synthesized_classes"), "int"),
        ("  distinct over all wrappers", lambda r: r.get("synthesized_classes_all_wrappers"), "int"),
        ("construct best (ms)", lambda r: r.get("construct_best_s"), "ms"),
        ("construct median (ms)", lambda r: r.get("construct_median_s"), "ms"),
        ("request raw (bytes)", lambda r: r.get("request_raw_bytes"), "int"),
        ("request zstd-6 (bytes)", lambda r: r.get("request_zstd_bytes"), "int"),
        ("  synthesized classes (bytes)", lambda r: r.get("synthesized_classes_bytes"), "int"),
        ("live Envoy classes, 1st load", lambda r: r.get("live_envoy_classes_before"), "int"),
        ("  after --reloads more", lambda r: r.get("live_envoy_classes_after"), "int"),
        ("  max RSS growth (KiB)", lambda r: r.get("max_rss_growth_kib"), "int"),
        ("  per load (ms)", lambda r: r.get("reload_s"), "ms"),
        ("trace(remote='local')", lambda r: r.get("trace", r.get("failed")), "str"),
    ]
    for label, get, kind in rows:
        print(f"{label:34}" + "".join(f"{_fmt(get(results.get(n, {})), kind):>{width}}" for n in names))
    for n in names:
        record = results.get(n, {})
        for failure in [record] if "failed" in record else record.get("failed_rounds", []):
            print(f"  ! {n}: a measurement failed ({failure['failed']})\n    "
                  + failure.get("stderr_tail", "").replace("\n", "\n    "))
    print(f"\n{'ratio':40}{'value':>8}{'bar':>9}  holds")
    for row in ratios:
        value = "-" if row["value"] is None else f"{row['value']:.3f}"
        bar = "-" if row["bar"] is None else f"<= {row['bar']:.2f}"
        holds = "-" if row["holds"] is None else ("yes" if row["holds"] else "NO")
        print(f"{row['ratio']:40}{value:>8}{bar:>9}  {holds}")


def driver(args) -> int:
    sys.path.insert(0, str(ROOT))
    from nnsight_repro import envs, provenance

    layer_counts = [int(x) for x in args.layers.split(",") if x.strip()]
    names = [n for n in args.envs.split(",") if n.strip()]

    versions: Dict[str, dict] = {}
    load_start = os.getloadavg()
    loaded = {}
    for name in names:
        env = envs.ensure(name, build=not args.no_build)
        loaded[name] = env
        stamp = env.stamp or {}
        versions[name] = {
            "path": str(env.path),
            "stamp_digest": stamp.get("digest"),
            "built": stamp.get("built"),
            "series_digest": (stamp.get("inputs") or {}).get("series_digest"),
            "packages": _versions_from_stamp(stamp),
        }

    results: Dict[str, Dict[str, dict]] = {}
    ratios: Dict[str, List[dict]] = {}
    failed = False
    scratch = tempfile.TemporaryDirectory(prefix="bench-overloaded-mount-payloads-")
    dump = args.dump_payloads or (scratch.name if args.explain else None)
    for layers in layer_counts:
        rounds: Dict[str, List[dict]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            # Rotate the order each round so no environment always runs first or last.
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                print(f"[bench] {layers} layers, round {round_ + 1}/{args.rounds}: {name} ...",
                      file=sys.stderr, flush=True)
                # The request is deterministic: measure it once, in the first round.
                record = run_one(loaded[name], layers, args.repeats, dump, args.timeout, request=round_ == 0,
                                 reloads=args.reloads if round_ == 0 and layers == min(layer_counts) else 0)
                if args.explain and record.get("request_dump"):
                    record["request_anatomy"] = request_anatomy(Path(record["request_dump"]).read_bytes())
                    if not args.dump_payloads:
                        del record["request_dump"]
                rounds[name].append(record)
                failed |= "failed" in record
                if record.get("versions"):
                    versions[name]["measured"] = record["versions"]
        per_env = {name: merge_rounds(rounds[name]) for name in names}
        results[str(layers)] = per_env
        ratios[str(layers)] = ratios_for(layers, per_env)
        print_table(layers, args.repeats, args.rounds, names, per_env, ratios[str(layers)])
        if args.explain:
            print_anatomy(names, per_env)
        sys.stdout.flush()
    scratch.cleanup()

    if args.json:
        document = {
            "benchmark": "overloaded_mount",
            "provenance": provenance.record(provenance.command_line(), versions=versions,
                                            details={"load_average_start": load_start,
                                                     "load_average_end": os.getloadavg()}),
            "settings": {"model": MODEL, "layers": layer_counts, "repeats": args.repeats, "rounds": args.rounds,
                         "reloads": args.reloads,
                         "torch_threads": 1,
                         "zstd_level": ZSTD_LEVEL, "envs": names},
            "results": results,
            "ratios": ratios,
        }
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
        print(f"\n[bench] wrote {args.json}", file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,12,48", help="comma-separated layer counts (default 2,12,48)")
    parser.add_argument("--repeats", type=int, default=7, help="timed constructions per process (default 7)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="processes per environment and layer count, interleaved across environments so "
                             "load changes hit all alike; timings pool all rounds (default 3)")
    parser.add_argument("--json", metavar="OUT", help="also write results and provenance to OUT")
    parser.add_argument("--envs", default=",".join(ENVS), help=f"comma-separated environments (default {','.join(ENVS)})")
    parser.add_argument("--no-build", action="store_true", help="fail instead of building a missing environment")
    parser.add_argument("--dump-payloads", metavar="DIR", help="keep each serialized request in DIR for inspection")
    parser.add_argument("--explain", action="store_true",
                        help="also break each request down by envoy field (bytes per envoy), from the pickle itself")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per measurement process")
    # Internal: the measurement half, run by an environment's python.
    parser.add_argument("--reloads", type=int, default=10000,
                        help="loads of one request, at the smallest layer count, for the live-class count "
                             "(default 10000; 0 skips)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-request", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1:
        parser.error("--repeats and --rounds must be at least 1")
    if args.measure:
        global RELOADS
        RELOADS = args.reloads
        record = measure(int(args.layers), args.repeats, args.dump_payloads, request=not args.skip_request)
        from nnsight_repro import channel

        channel.send(record)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
