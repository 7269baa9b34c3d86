"""The one transport fault a live remote trace is retried for: python-socketio's threaded client
reassembling a binary event out of order.

nnsight's ``RemoteBackend`` (0.7.0 and 0.8.1 alike) waits for a job's statuses on a
``socketio.SimpleClient``. Its engine.io client hands every websocket message to a thread of its own
(``_trigger_event('message', ..., run_async=True)``), while socket.io's client keeps a single slot for
a binary event whose attachment has not arrived yet. Each status is a binary event (a text header,
then the pickled response as an attachment). When two arrive back to back — the dispatcher sends
QUEUED and DISPATCHED within a millisecond — and the machine is busy, the second header's thread can
run before the first attachment's: the header's *text* becomes the first event's data, and nnsight's
``ResponseModel.unpickle`` fails with ``TypeError: a bytes-like object is required, not 'str'``.
Neither nnsight nor the server did anything wrong on the wire; the same job, sent again, runs.

This module owns recognising exactly that failure and retrying the call that hit it, recording
every retry so a result never hides one. It deliberately retries nothing else: any other exception,
a TypeError raised anywhere but in ``unpickle``, and the last attempt's failure propagate unchanged.
``tests/test_socket_race.py`` shows the race in python-socketio offline and will fail once it is fixed
there (then this module goes).
"""

from __future__ import annotations

import traceback
from typing import Callable, List, TypeVar

T = TypeVar("T")

#: Attempts of one remote call. A race needs two statuses within a millisecond *and* a thread schedule
#: that inverts them, so attempts fail independently and rarely; a call that loses three times in a
#: row points at a different fault, which must surface.
ATTEMPTS = 3


def is_socket_race(exc: BaseException) -> bool:
    """Whether ``exc`` is nnsight's client unpickling a status whose data arrived as text."""
    if not isinstance(exc, TypeError) or "bytes-like object is required, not 'str'" not in str(exc):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    innermost = frames[-1]
    return innermost.name == "unpickle" and innermost.filename.replace("\\", "/").endswith("nnsight/schema/response.py")


def call(fn: Callable[[], T], retries: List[dict], attempts: int = ATTEMPTS) -> T:
    """``fn()``, sent again after a socket race (each recorded in ``retries``) up to ``attempts`` times."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except TypeError as exc:
            if attempt == attempts or not is_socket_race(exc):
                raise
            retries.append({"attempt": attempt, "error": f"{type(exc).__module__}.{type(exc).__name__}",
                            "message": str(exc), "retried_because": "python-socketio binary-event race"})
