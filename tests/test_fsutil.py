"""The file-system idioms of ``nnsight_repro.fsutil``."""

import pytest

from nnsight_repro import fsutil


def test_a_staged_directory_appears_whole(tmp_path):
    with fsutil.staged_directory(tmp_path / "out") as staging:
        (staging / "a").write_text("1")
        assert not (tmp_path / "out").exists()
    assert (tmp_path / "out" / "a").read_text() == "1"


def test_a_staged_directory_that_fails_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), fsutil.staged_directory(tmp_path / "out") as staging:
        (staging / "a").write_text("1")
        raise RuntimeError("half built")
    assert list(tmp_path.iterdir()) == []


def _hold(path, ready, release, holder):
    """In a child process: hold the lock on ``path`` until ``release`` is set."""
    with fsutil.locked(path, holder=holder):
        ready.set()
        release.wait(30)


@pytest.fixture
def held(tmp_path):
    """Starts a child holding a lock: ``held(holder=...)`` -> (lock path, child)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    release, children = ctx.Event(), []

    def start(holder=False):
        ready = ctx.Event()
        child = ctx.Process(target=_hold, args=(tmp_path / "lock", ready, release, holder))
        child.start()
        children.append(child)
        assert ready.wait(30)
        return tmp_path / "lock", child

    yield start
    release.set()
    for child in children:
        child.join(30)


def test_a_busy_lock_is_refused_at_once_without_waiting(held):
    path, child = held()
    assert fsutil.is_locked(path)
    with pytest.raises(fsutil.Busy) as refused, fsutil.locked(path, wait=False):
        pass
    assert refused.value.holder == ""


def test_a_polled_lock_names_its_holder_and_gives_up(held):
    path, child = held(holder=True)
    seen = []
    with pytest.raises(fsutil.Busy) as refused, fsutil.locked(path, wait=0.6, waiting=seen.append):
        pass
    assert refused.value.holder == str(child.pid) and set(seen) == {str(child.pid)} and len(seen) >= 2


def test_a_free_lock_is_taken_and_its_pid_cleared_after(tmp_path):
    import os

    path = tmp_path / "sub" / "lock"
    assert not fsutil.is_locked(path)
    with fsutil.locked(path, wait=False, holder=True):
        assert path.read_text() == str(os.getpid())
    assert path.read_text() == "" and not fsutil.is_locked(path)


def test_a_staged_file_that_fails_leaves_the_old_one(tmp_path):
    target = tmp_path / "plot.png"
    target.write_text("old")
    with pytest.raises(RuntimeError), fsutil.staged_file(target) as staging:
        assert staging.suffix == ".png"
        staging.write_text("half")
        raise RuntimeError("half written")
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"] and target.read_text() == "old"
    fsutil.write_text(target, "new")
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"] and target.read_text() == "new"


def test_a_waiter_that_raises_stops_waiting_without_the_lock(held):
    """How ``ndif.stack.lease`` goes on under a lease its own ancestor holds."""

    class Shared(Exception):
        pass

    def waiting(holder):
        raise Shared(holder)

    path, child = held(holder=True)
    with pytest.raises(Shared) as stopped, fsutil.locked(path, wait=60, holder=True, waiting=waiting):
        pass
    assert str(stopped.value) == str(child.pid) and path.read_text() == str(child.pid)
