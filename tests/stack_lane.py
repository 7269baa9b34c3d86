"""The live-stack lane as a pytest plugin (loaded from conftest.py): which of the session's live-stack jobs
run in a lane (:mod:`nnsight_repro.lane`) from before the first test, and the tests that read them last.

The jobs are ``tests/ndif_fixture.py``'s (``LANE_JOBS``); a test asks for one by its fixture, or by a parameter
naming it. In the default mode, ``ahead``, the lane starts before the first test with every job the collected
tests ask for, and the modules that read them run after the rest, so the offline tests have the cold starts to
overlap; ``NNSIGHT_REPRO_STACK_LANE=on-demand`` runs each job when a test first asks for it, in test order.
At the end, whatever the lane still runs is interrupted and its stack brought down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, List

import pytest

from nnsight_repro import lane

HERE = Path(__file__).resolve().parent


def asks_for(item, jobs: Iterable[str]) -> List[str]:
    """The ``jobs`` a collected test asks for: as fixtures, or as a parameter naming one (a test that fetches
    it with ``request.getfixturevalue``)."""
    callspec = getattr(item, "callspec", None)
    named = [*getattr(item, "fixturenames", ()), *(callspec.params.values() if callspec else ())]
    return [name for name in named if isinstance(name, str) and name in set(jobs)]


def needed(items, jobs: Iterable[str]) -> List[str]:
    """The ``jobs`` the collected ``items`` ask for, in the order the run first reaches them."""
    order: List[str] = []
    for item in items:
        order += [name for name in asks_for(item, jobs) if name not in order]
    return order


def readers_last(items, jobs: Iterable[str]) -> list:
    """``items`` with every module that reads one of ``jobs`` moved after the others, so the tests that need no
    live stack run while the lane's stacks come up. Modules keep their order and move whole: splitting one
    would set its module fixtures up twice."""
    late = {item.path for item in items if asks_for(item, jobs)}
    return [i for i in items if i.path not in late] + [i for i in items if i.path in late]


def pytest_collection_modifyitems(session, config, items):
    """Tests that read a lane job run last (unless the lane runs on demand); a mode it lacks stops the run."""
    from ndif_fixture import LANE_JOBS

    try:
        ahead = lane.mode() == "ahead"
    except lane.LaneError as exc:
        raise pytest.UsageError(str(exc)) from None
    if ahead:
        items[:] = readers_last(items, LANE_JOBS)


@pytest.fixture(scope="session", autouse=True)
def live_stack_lane(request, tmp_path_factory, terminal_line):
    """The session's :class:`nnsight_repro.lane.Lane`, started before the first test with the jobs the
    collected tests ask for; at the end, whatever it still runs is interrupted and its stack brought down."""
    from ndif_fixture import LANE_JOBS, bring_down

    running = lane.Lane(tmp_path_factory.mktemp("stack-lane"), "ndif_fixture:LANE_RUNS", [HERE], bring_down,
                        terminal_line)
    jobs = needed(request.session.items, LANE_JOBS) if lane.mode() == "ahead" else []
    if jobs:
        terminal_line(f"[ndif] live stacks beside the tests: {', '.join(jobs)} (log: {running.log})")
        # One lane per job: each brings up a stack of its own, and two cold starts beside the offline tests
        # fill the cores better than one after the other.
        for job in jobs:
            running.start([job])
    try:
        yield running
    finally:
        running.stop()
