"""The one provenance record (``nnsight_repro.provenance``), and every results file carrying it."""

import json
import re
import subprocess
import sys
from pathlib import Path

from nnsight_repro import provenance

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"command", "date", "host", "runner", "machine", "versions", "server", "details"}

#: Results written before the record existed, each by a run that has not been repeated since. A rerun
#: writes the record; its file then leaves this list (the test below fails until it does).
WRITTEN_BEFORE_THE_RECORD = {
    "results/benchmarks/bench_ndif-0.7-patched-20261201.json",
    "results/benchmarks/bench_ndif-0.7-stock-20261201.json",
    "results/benchmarks/bench_ndif-0.8-20261201.json",
    "results/benchmarks/bench_verify-20261201.json",
    "results/benchmarks/setup.json",
}


def results_files():
    return {str(p.relative_to(ROOT)) for p in (ROOT / "results").rglob("*.json")}


def test_a_record_has_exactly_the_documented_fields():
    assert set(provenance.record("python3 -m nnsight_repro verify")) == KEYS


def test_the_date_is_utc_to_the_second():
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", provenance.record("x")["date"])
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


def test_every_results_file_written_since_carries_the_record():
    for path in sorted(results_files() - WRITTEN_BEFORE_THE_RECORD):
        document = json.loads((ROOT / path).read_text())
        assert set(document.get("provenance", {})) == KEYS, path


def test_the_list_of_older_results_names_only_files_that_still_exist():
    assert WRITTEN_BEFORE_THE_RECORD <= results_files()


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
