"""The one transport fault a live remote trace is retried for: python-socketio's threaded client
handling the messages of a binary event out of order.

nnsight's ``RemoteBackend`` (0.7.0) waits for a job's statuses on a ``socketio.SimpleClient``. Its
engine.io client hands every websocket message to a thread of its own
(``_trigger_event('message', ..., run_async=True)``), while socket.io's client keeps a single slot for
a binary event whose attachment has not arrived yet. Each status is a binary event (a text header,
then the pickled response as an attachment). On a busy machine those threads can run in another
order than the messages arrived in, and the fault shows in one of two ways:

- **a header delivered as data.** When two statuses arrive back to back (the dispatcher sends QUEUED
  and DISPATCHED within a millisecond), the second header's thread can run before the first
  attachment's: the header's *text* becomes the first event's data, and nnsight's
  ``ResponseModel.unpickle`` fails with ``TypeError: a bytes-like object is required, not 'str'``.
- **a stranded header.** When an attachment's thread runs before its own header's, the attachment is
  read as a packet and dropped, and the header waits in the slot for an attachment that already
  came. If that was the job's last status (COMPLETED), nothing else ever arrives: nnsight's
  ``sio.receive()`` has no timeout and the client waits for ever (the likeliest cause of a CI
  run's 0.7 probe script hanging until killed after 1800 s). :func:`call` watches the slot while the
  call waits (:data:`STRANDED_AFTER_S`) and raises :class:`StrandedStatus` instead.

Neither nnsight nor the server did anything wrong on the wire; the same job, sent again, runs.

This module owns recognising exactly those two symptoms and retrying the call that hit one,
recording every retry so a result never hides one. It deliberately retries nothing else: any other
exception, a TypeError raised anywhere but in ``unpickle``, a wait with no header stranded (a job
that is merely slow), and the last attempt's failure propagate unchanged. nnsight 0.8.1's client reads
its statuses from one plain websocket in one thread; its environments have no python-socketio, and
:func:`call` then only calls. ``tests/test_socket_race.py`` shows both symptoms offline, handing
python-socketio's client the messages in the racing orders. While a call runs, the watch replaces
``socketio.SimpleClient.receive`` process-wide: make one call at a time (every client here does).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from typing import Callable, Iterator, List, Optional, TypeVar

T = TypeVar("T")

#: Attempts of one remote call. A race needs two statuses within a millisecond *and* a thread schedule
#: that inverts them, so attempts fail independently and rarely; a call that loses three times in a
#: row points at a different fault, which must surface.
ATTEMPTS = 3


#: How long a status header may wait for its attachment before the attachment counts as lost. The server
#: sends both in one breath; only a large inline result on a loaded machine keeps a header waiting
#: for seconds, never for a minute.
STRANDED_AFTER_S = 60.0
#: How often a waiting client looks at the slot.
LOOK_EVERY_S = 1.0


class StrandedStatus(Exception):
    """A status header waited :data:`STRANDED_AFTER_S` for an attachment handled before it (and lost)."""


def is_socket_race(exc: BaseException) -> bool:
    """Whether ``exc`` is either symptom: a stranded header, or nnsight's client unpickling a status whose
    data arrived as text."""
    if isinstance(exc, StrandedStatus):
        return True
    if not isinstance(exc, TypeError) or "bytes-like object is required, not 'str'" not in str(exc):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    innermost = frames[-1]
    return innermost.name == "unpickle" and innermost.filename.replace("\\", "/").endswith("nnsight/schema/response.py")


@contextlib.contextmanager
def stranded_statuses_raise(after_s: Optional[float] = None) -> Iterator[None]:
    """While inside, a ``socketio.SimpleClient.receive`` whose client holds one header in its binary-event
    slot for ``after_s`` (default :data:`STRANDED_AFTER_S`) raises :class:`StrandedStatus`; every other
    wait, and every timeout the caller asked for, is as before. Without python-socketio (the 0.8 line),
    nothing changes."""
    after_s = STRANDED_AFTER_S if after_s is None else after_s
    try:
        import socketio
    except ImportError:
        yield
        return
    original = socketio.SimpleClient.receive
    first_seen = {}  # id(simple client) -> (the header in its slot, when it was first seen there)

    def raise_if_stranded(simple) -> None:
        header = getattr(getattr(simple, "client", None), "_binary_packet", None)
        if header is None:
            first_seen.pop(id(simple), None)
            return
        seen, since = first_seen.get(id(simple), (None, None))
        if seen is not header:
            first_seen[id(simple)] = (header, time.monotonic())
        elif time.monotonic() - since >= after_s:
            raise StrandedStatus(f"a status header waited {time.monotonic() - since:.0f} s for its attachment, "
                                 f"which was handled before it and dropped; no later status can arrive")

    def receive(simple, timeout=None):
        # nnsight 0.7.0 waits with no timeout (or 0.1 s with remote logging, catching each TimeoutError):
        # waiting in short steps lets the slot be looked at, and a caller's own timeout still holds.
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            step = LOOK_EVERY_S if end is None else max(0.0, min(LOOK_EVERY_S, end - time.monotonic()))
            try:
                return original(simple, timeout=step)
            except socketio.exceptions.TimeoutError:
                raise_if_stranded(simple)
                if end is not None and time.monotonic() >= end:
                    raise

    socketio.SimpleClient.receive = receive
    try:
        yield
    finally:
        socketio.SimpleClient.receive = original


def call(fn: Callable[[], T], retries: List[dict], attempts: int = ATTEMPTS) -> T:
    """``fn()``, sent again after a socket race (each recorded in ``retries``) up to ``attempts`` times."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        try:
            with stranded_statuses_raise():
                return fn()
        except (TypeError, StrandedStatus) as exc:
            if attempt == attempts or not is_socket_race(exc):
                raise
            symptom = "stranded header" if isinstance(exc, StrandedStatus) else "header delivered as data"
            retries.append({"attempt": attempt, "error": f"{type(exc).__module__}.{type(exc).__name__}",
                            "message": str(exc), "retried_because": f"python-socketio binary-event race ({symptom})"})
