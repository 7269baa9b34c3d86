"""The one provenance record (``nnsight_repro.provenance``), and every results file carrying it."""

import json
import re
import subprocess
import sys
from pathlib import Path

from nnsight_repro import provenance

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"command", "date", "host", "runner", "machine", "versions", "server", "details"}
UTC_TO_THE_SECOND = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def without_the_record(root: Path = ROOT):
    """Each JSON file under ``root``/results that does not carry the one record, with what is wrong: no
    ``provenance``, other fields than the documented ones, a date not in UTC to the second, or record fields
    copied beside it at the top level (the shape of the files written before the record)."""
    problems = []
    for path in sorted((root / "results").rglob("*.json")):
        name, document = str(path.relative_to(root)), json.loads(path.read_text())
        made = document.get("provenance") if isinstance(document, dict) else None
        if not isinstance(made, dict):
            problems.append(f"{name}: no provenance record")
            continue
        if set(made) != KEYS:
            problems.append(f"{name}: provenance fields {sorted(made)}, not {sorted(KEYS)}")
        elif not UTC_TO_THE_SECOND.fullmatch(str(made["date"])):
            problems.append(f"{name}: provenance date {made['date']!r} is not UTC to the second")
        beside = KEYS & set(document)
        if beside:
            problems.append(f"{name}: {sorted(beside)} beside the record, at the top level")
    return problems


def test_a_record_has_exactly_the_documented_fields():
    assert set(provenance.record("python3 -m nnsight_repro verify")) == KEYS


def test_the_date_is_utc_to_the_second():
    assert UTC_TO_THE_SECOND.fullmatch(provenance.record("x")["date"])
    assert provenance.date(0) == "1970-01-01T00:00:00Z" and provenance.stamp(0) == "19700101T000000Z"


def test_the_host_is_the_machine_never_a_server():
    made = provenance.record("x", server={"url": "http://127.0.0.1:8001", "kind": "local NDIF stack"})
    assert made["host"] == made["machine"]["hostname"] and "://" not in made["host"]
    assert made["server"]["url"] == "http://127.0.0.1:8001"


def test_a_module_run_is_recorded_as_typed(monkeypatch):
    class Main:
        __spec__ = type("Spec", (), {"name": "nnsight_repro.__main__"})()

    monkeypatch.setitem(sys.modules, "__main__", Main)
    assert (provenance.command_line(["/x/nnsight_repro/__main__.py", "verify", "--envs", "a b"])
            == "python3 -m nnsight_repro verify --envs 'a b'")


def test_a_script_run_is_recorded_as_typed(monkeypatch):
    monkeypatch.setitem(sys.modules, "__main__", type("Main", (), {"__spec__": None}))
    assert provenance.command_line(["scripts/x.py", "--line", "main"]) == "python3 scripts/x.py --line main"


def test_every_results_file_carries_the_record():
    # A file listed here was written before the record, or by a script that does not write it yet: rerun it
    # with its command (benchmarks/README.md), which writes the record.
    problems = without_the_record()
    assert not problems, "\n".join(problems)


def test_a_file_without_the_record_is_named(tmp_path):
    (tmp_path / "results" / "old").mkdir(parents=True)
    (tmp_path / "results" / "new.json").write_text(json.dumps({"provenance": provenance.record("x"), "runs": []}))
    (tmp_path / "results" / "old" / "bench.json").write_text(
        json.dumps({"command": "x", "host": "vm", "date": "2026-12-01T00:52:26+0000", "runs": []}))
    (tmp_path / "results" / "partial.json").write_text(
        json.dumps({"provenance": {**provenance.record("x"), "date": "2026-12-01T00:52:26+0000"}}))
    (tmp_path / "results" / "short.json").write_text(json.dumps({"provenance": {"command": "x"}}))
    assert without_the_record(tmp_path) == [
        "results/old/bench.json: no provenance record",
        "results/partial.json: provenance date '2026-12-01T00:52:26+0000' is not UTC to the second",
        f"results/short.json: provenance fields ['command'], not {sorted(KEYS)}"]
    (tmp_path / "results" / "beside.json").write_text(
        json.dumps({"provenance": provenance.record("x"), "host": "vm"}))
    assert "results/beside.json: ['host'] beside the record, at the top level" in without_the_record(tmp_path)


def test_the_commit_names_head_and_says_when_the_work_tree_differs(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = provenance.commit(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{40}", head), head
    (tmp_path / "f").write_text("2")
    assert provenance.commit(tmp_path) == f"{head}-dirty"


def test_the_commit_outside_a_checkout_is_empty(tmp_path):
    assert provenance.commit(tmp_path) == ""
