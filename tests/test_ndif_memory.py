"""A stack that runs out of memory: its memory cgroup, the watch that names the cause, and one live stack made
to run out (issue 16's bad input: reported as memory, and the stack comes down cleanly): the session's 0.8
multimolecule stack, last thing before it comes down (fixture ``ndif08_out_of_memory``).

The cgroup tests use real cgroups and tiny processes (root, as every stack test); the watch is fed counters.
"""

import subprocess
import sys
import time

import pytest

from nnsight_repro import ROOT
from nnsight_repro.ndif import errors, memcg, memory_watch, panel

ALLOCATE_200_MIB = "x = bytearray(200 * 1024 * 1024)"


@pytest.fixture
def group(request):
    made = memcg.create(f"nnsr-test-{request.node.name[:40]}", limit_mib=64)
    yield made
    memcg.remove(made)


def test_a_process_started_through_the_cgroup_is_in_it_from_its_start(group):
    out = subprocess.run(memcg.command(group, [sys.executable, "-c", "print(open('/proc/self/cgroup').read())"]),
                         capture_output=True, text=True, check=True).stdout
    assert any(line.endswith("/" + group.path.name) for line in out.splitlines()), out


def test_a_process_over_the_limit_is_killed_and_counted(group):
    result = subprocess.run(memcg.command(group, [sys.executable, "-c", ALLOCATE_200_MIB]))
    counters = memcg.counters(group)
    assert result.returncode == -9 and counters["oom_kills"] == 1, (result.returncode, counters)
    assert counters["limit_mib"] == 64 and counters["limit_hits"] > 0


def test_an_uncapped_cgroup_reports_no_limit():
    made = memcg.create("nnsr-test-uncapped")
    try:
        assert memcg.counters(made)["limit_mib"] is None
    finally:
        memcg.remove(made)


def test_a_cgroup_with_a_process_in_it_is_not_removed_and_the_error_names_the_process(group):
    sleeper = subprocess.Popen(memcg.command(group, ["sleep", "30"]))
    try:
        deadline = time.monotonic() + 10
        while not memcg.members(group):  # until its shell has joined
            assert time.monotonic() < deadline, "the process never joined the cgroup"
            time.sleep(0.01)
        with pytest.raises(memcg.MemcgError, match=f"processes still in it: \\[{sleeper.pid}\\]"):
            memcg.remove(group, wait=0.5)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_limit_below_what_the_processes_hold_is_refused_on_v1_and_ends_in_a_kill_on_v2():
    made = memcg.create("nnsr-test-shrink")
    holder = subprocess.Popen(memcg.command(made, [sys.executable, "-c", ALLOCATE_200_MIB + "; x[::4096] = b'1' * "
                                                   "len(x[::4096]); print(flush=True); import time; time.sleep(30)"]),
                              stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()  # the 200 MiB are touched
        if made.version == 1:
            with pytest.raises(memcg.MemcgError, match="cannot set the memory limit of .* to 10 MiB: Device or "
                                                       "resource busy"):
                memcg.set_limit(made, 10)
        else:
            memcg.set_limit(made, 10)
            assert holder.wait(timeout=30) == -9 and memcg.counters(made)["oom_kills"] == 1
    finally:
        holder.kill()
        holder.wait()
        memcg.remove(made)


class FakeCgroup:
    """Counters fed to a watch, one dict per look; time advances one second per look."""

    def __init__(self, monkeypatch, *looks):
        self.looks, self.now = list(looks), 0.0
        monkeypatch.setattr(memcg, "counters", lambda group: {**self.base, **self.looks.pop(0)})

    base = {"oom_kills": 0, "limit_hits": 0, "refaults": 0, "peak_mib": 900, "limit_mib": 1000,
            "cgroup": "/sys/fs/cgroup/memory/x"}

    def clock(self):
        self.now += 1.0
        return self.now


def _looks(count, hits_per_look, refaults_per_look):
    return [{"limit_hits": i * hits_per_look, "refaults": i * refaults_per_look} for i in range(count)]


def test_the_watch_names_an_oom_kill_at_once_with_what_the_stack_was_doing(monkeypatch):
    fake = FakeCgroup(monkeypatch, {}, {"oom_kills": 2})
    watch = memory_watch.MemoryWatch(object(), "while deploying rnabert", clock=fake.clock)
    with pytest.raises(errors.OutOfMemory, match="ran out of memory while deploying rnabert: the kernel killed 2 of "
                                                "its processes for want of memory \\(its memory limit is 1000 MiB, its peak 900 MiB; .*a higher "
                                                "--memory-limit"):
        watch()


def test_the_watch_names_thrashing_at_the_limit_after_its_grace(monkeypatch):
    fake = FakeCgroup(monkeypatch, *_looks(24, hits_per_look=100, refaults_per_look=200))
    watch = memory_watch.MemoryWatch(object(), "while deploying rnabert", clock=fake.clock)
    looks = 0
    with pytest.raises(errors.OutOfMemory, match="for 20 s it was at its limit and reading evicted pages back in"):
        for looks in range(1, 24):
            watch()
    assert looks == 21  # the first thrashing look starts the 20 s


def test_one_look_after_a_long_wait_is_not_thrashing(monkeypatch):
    fake = FakeCgroup(monkeypatch, {}, {"limit_hits": 5000, "refaults": 100_000})
    watch = memory_watch.MemoryWatch(object(), "while deploying rnabert", clock=lambda: fake.clock() * 600)
    watch()


def test_an_uncapped_stack_that_ran_the_machine_out_is_not_told_to_raise_its_limit(monkeypatch):
    fake = FakeCgroup(monkeypatch, {"limit_mib": None}, {"limit_mib": None, "oom_kills": 1})
    watch = memory_watch.MemoryWatch(object(), "while deploying rnabert", clock=fake.clock)
    with pytest.raises(errors.OutOfMemory, match="no memory limit of its own: the machine ran out") as raised:
        watch()
    assert "--memory-limit" not in str(raised.value)


@pytest.mark.parametrize("hits, refaults", [(100, 10), (0, 500)], ids=["cache-churn-at-the-limit", "refaults-below-it"])
def test_the_watch_leaves_a_stack_that_is_not_starved_alone(monkeypatch, hits, refaults):
    # At the limit with few pages read back (page cache recycled), or reading pages back below the limit:
    # neither is running out of memory.
    fake = FakeCgroup(monkeypatch, *_looks(40, hits, refaults))
    watch = memory_watch.MemoryWatch(object(), "while deploying rnabert", clock=fake.clock)
    for _ in range(39):
        watch()


def test_a_trace_that_failed_while_the_stack_ran_out_of_memory_says_so_and_one_that_passed_is_left(monkeypatch):
    fake = FakeCgroup(monkeypatch, {}, {"oom_kills": 1})
    watch = memory_watch.MemoryWatch(object(), "while the patched client traced rnabert", clock=fake.clock)
    records = {"trace:rnabert:0.08": {"ok": False, "error": "RemoteException", "message": "Error starting model"},
               "write:rnabert:0.08": {"ok": True, "atol": 0.08}}
    panel.name_out_of_memory(records, watch)
    assert "out_of_memory" not in records["write:rnabert:0.08"]
    row = panel.model_rows("rnabert", "patched", "required", "0.7", records, {}, None, 1)[0]
    assert row["reason"].startswith("Error starting model\n"), row["reason"]
    assert row["reason"].splitlines()[-1].startswith(
        "The stack ran out of memory while the patched client traced rnabert: the kernel killed 1"), row["reason"]


def test_up_refuses_a_memory_limit_that_is_not_a_positive_number_of_mib_before_starting_anything():
    result = subprocess.run([sys.executable, "-m", "nnsight_repro", "ndif", "up", "--memory-limit", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "memory limit 0 is not a positive number of MiB" in result.stderr, result.stderr


def test_a_model_that_runs_the_stack_out_of_memory_is_reported_as_memory_and_the_stack_comes_down_cleanly(
        ndif08_out_of_memory):
    # Done last on the session's 0.8 stack (tests/ndif_fixture.py run_out_of_memory): what it is made to do
    # breaks that stack, so nothing else runs on it after.
    found = ndif08_out_of_memory
    assert "no_cgroup" not in found, f"the stack came up without a memory cgroup: {found}"
    message = found.get("message", "")
    assert found["raised"] == "OutOfMemory", found
    assert message.startswith(f"The stack ran out of memory while deploying {found['model']}: "), message
    assert f"its memory limit is {found['limit_mib']} MiB" in message, message
    assert found["seconds"] < found["deploy_timeout_s"], found  # named, not waited out
    assert "down_error" not in found, found
    assert found["down"]["deleted_netns"] and found["down"]["removed_cgroup"] == found["cgroup"], found
    assert not found["netns_left"] and not found["cgroup_left"], found
