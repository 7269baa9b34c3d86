"""The client-side socket race a live remote trace is retried for (``nnsight_repro.ndif.socket_race``).

The first tests show the race itself, offline, in the python-socketio client nnsight uses: its
engine.io layer hands each websocket message to a thread of its own, so the messages of binary
events can be handled in an order other than arrival's. Handed to socket.io's client in such an order,
a header is delivered as data, or a header is stranded waiting for an attachment already dropped.
These tests fix the order themselves, so a fix that keeps one connection's messages in order (in
engine.io) would leave them passing: whether the retry can go is a question for a live run. The rest
pin down what is retried: exactly nnsight's ``ResponseModel.unpickle`` given text, a header stranded
in a waiting client, nothing else, and every retry recorded.

The race is the 0.7 line's alone: nnsight 0.8.1's client reads its statuses from one plain websocket
in one thread, and its environment has no python-socketio. So this file runs in a 0.7 environment
(the suite's ``patched``, or ``main``).
"""

import io
import time

import pytest

from nnsight_repro.ndif import socket_race


def binary_event(data: bytes):
    """The two websocket messages of one socket.io binary event: a text header, then the attachment."""
    from socketio import packet

    return packet.Packet(packet.EVENT, data=["blocking_response", data]).encode()


def handled_in_order(messages):
    """What a python-socketio client's ``'*'`` handler receives when ``messages`` are handled in this order."""
    import socketio

    client = socketio.Client()
    delivered = []
    client.on("*", lambda event, *args: delivered.append(args))
    for message in messages:
        try:
            client._handle_eio_message(message)
        except ValueError:
            pass  # an attachment read as a packet: raised in its own thread, and that event is lost
    return delivered


def race_error() -> TypeError:
    """What nnsight's client raises on the data the race delivers."""
    from nnsight.schema.response import ResponseModel

    (first_header, _), (second_header, _) = binary_event(b"one"), binary_event(b"two")
    ((data,),) = handled_in_order([first_header, second_header])
    try:
        ResponseModel.unpickle(data)
    except TypeError as exc:
        return exc
    raise AssertionError("ResponseModel.unpickle accepted text")


def test_socketio_client_delivers_each_binary_event_intact_in_arrival_order():
    (h1, a1), (h2, a2) = binary_event(b"one"), binary_event(b"two")
    assert handled_in_order([h1, a1, h2, a2]) == [(b"one",), (b"two",)]


def test_socketio_client_delivers_the_next_header_as_data_when_an_attachment_is_handled_late():
    (h1, a1), (h2, a2) = binary_event(b"one"), binary_event(b"two")
    assert handled_in_order([h1, h2, a1, a2]) == [(h2,)]


def test_socketio_client_strands_a_header_whose_attachment_is_handled_first():
    import socketio

    (h1, a1), (h2, a2) = binary_event(b"one"), binary_event(b"two")
    client = socketio.Client()
    delivered = []
    client.on("*", lambda event, *args: delivered.append(args))
    for message in [h1, a1, a2, h2]:
        try:
            client._handle_eio_message(message)
        except ValueError:
            pass
    # The last status never arrives, and its header waits in the slot for good.
    assert delivered == [(b"one",)]
    assert client._binary_packet is not None


def test_the_race_makes_nnsight_unpickle_raise_the_error_seen_live():
    assert str(race_error()) == "a bytes-like object is required, not 'str'"


def test_the_race_is_recognised():
    assert socket_race.is_socket_race(race_error())


def test_the_same_type_error_raised_outside_nnsight_is_not_the_race():
    with pytest.raises(TypeError) as raised:
        io.BytesIO("text")
    assert not socket_race.is_socket_race(raised.value)


def test_another_exception_from_unpickle_is_not_the_race():
    from nnsight.schema.response import ResponseModel

    with pytest.raises(Exception) as raised:
        ResponseModel.unpickle(b"not a pickle")
    assert not socket_race.is_socket_race(raised.value)


def waiting_client(stranded: bool):
    """A connected ``socketio.SimpleClient`` with nothing to deliver, its slot holding a header or not."""
    import socketio

    simple = socketio.SimpleClient()
    simple.client = socketio.Client()
    simple.connected = True
    simple.connected_event.set()
    if stranded:
        simple.client._handle_eio_message(binary_event(b"completed")[0])
    return simple


@pytest.fixture
def quick_looks(monkeypatch):
    monkeypatch.setattr(socket_race, "LOOK_EVERY_S", 0.01)


def test_a_wait_on_a_stranded_header_raises(quick_looks):
    simple = waiting_client(stranded=True)
    with socket_race.stranded_statuses_raise(after_s=0.05):
        with pytest.raises(socket_race.StrandedStatus, match="waited .* for its attachment"):
            simple.receive(timeout=10)  # a bound on the test if detection breaks; nnsight passes none


def test_a_wait_with_no_header_stranded_keeps_the_caller_s_timeout(quick_looks):
    import socketio

    simple = waiting_client(stranded=False)
    with socket_race.stranded_statuses_raise(after_s=0.05):
        started = time.monotonic()
        with pytest.raises(socketio.exceptions.TimeoutError):
            simple.receive(timeout=0.3)
    assert time.monotonic() - started >= 0.3


def test_a_header_waits_less_than_the_limit_without_raising(quick_looks):
    import socketio

    simple = waiting_client(stranded=True)
    with socket_race.stranded_statuses_raise(after_s=30):
        with pytest.raises(socketio.exceptions.TimeoutError):
            simple.receive(timeout=0.2)


def test_receive_is_nnsight_s_own_again_after_a_call_that_raised():
    import socketio

    before = socketio.SimpleClient.receive

    def fails():
        assert socketio.SimpleClient.receive is not before
        raise KeyError("not a race")

    with pytest.raises(KeyError):
        socket_race.call(fails, [])
    assert socketio.SimpleClient.receive is before


def test_a_call_stranded_on_its_last_status_is_sent_again_and_the_retry_recorded(quick_looks, monkeypatch):
    monkeypatch.setattr(socket_race, "STRANDED_AFTER_S", 0.05)
    calls = []

    def remote_call():
        calls.append(1)
        if len(calls) == 1:
            waiting_client(stranded=True).receive(timeout=10)
        return "result"

    retries = []
    assert socket_race.call(remote_call, retries) == "result"
    assert len(calls) == 2
    assert retries[0]["error"].endswith("StrandedStatus")
    assert "stranded header" in retries[0]["retried_because"]


class Flaky:
    """A remote call that hits the race ``races`` times, then returns ``"result"``."""

    def __init__(self, races: int):
        self.races, self.calls = races, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.races:
            raise race_error()
        return "result"


def test_a_call_that_hits_the_race_is_sent_again_and_the_retry_recorded():
    retries, flaky = [], Flaky(races=1)
    assert socket_race.call(flaky, retries) == "result"
    assert flaky.calls == 2
    assert [r["attempt"] for r in retries] == [1]
    assert retries[0]["message"] == "a bytes-like object is required, not 'str'"


def test_a_call_without_the_race_is_sent_once_and_records_nothing():
    retries, flaky = [], Flaky(races=0)
    assert socket_race.call(flaky, retries) == "result"
    assert (flaky.calls, retries) == (1, [])


def test_any_other_type_error_propagates_at_once():
    retries, calls = [], []

    def fails():
        calls.append(1)
        io.BytesIO("text")

    with pytest.raises(TypeError):
        socket_race.call(fails, retries)
    assert (len(calls), retries) == (1, [])


def test_the_last_attempt_s_race_propagates():
    retries, flaky = [], Flaky(races=socket_race.ATTEMPTS)
    with pytest.raises(TypeError, match="bytes-like object is required"):
        socket_race.call(flaky, retries)
    assert flaky.calls == socket_race.ATTEMPTS
    assert len(retries) == socket_race.ATTEMPTS - 1


def test_fewer_than_one_attempt_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        socket_race.call(lambda: None, [], attempts=0)
