"""The messages between the kernel and its ranks: typed on both ends, plain tuples on the pipe."""

import os
import pickle
import threading

import pytest

from mgkit.launching._wire import (
    Beat,
    Channel,
    Error,
    Ready,
    Result,
    Started,
    Unsendable,
    decode,
    encode,
    read_message,
)

MESSAGES = [
    Started(),
    Ready(("cpu0", "cpu1"), 1.25),
    Beat(12, 1700000000.0, 0.5),
    Error("ValueError", "bad row", "Traceback ...", pickle.dumps(ValueError("bad row")), "run"),
    Unsendable("dict", "the value['lock'] (a _thread.lock)", "cannot pickle '_thread.lock' object"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_crosses_as_a_plain_tuple_and_comes_back_typed(message):
    wire = encode(message)
    assert type(wire) is tuple and isinstance(wire[0], str) and wire[1:] == tuple(message)
    assert pickle.loads(pickle.dumps(wire)) == wire  # no class is needed to read it
    back = decode(wire)
    assert type(back) is type(message) and back == message


def test_a_ranks_messages_and_value_read_back_in_order():
    r, w = os.pipe()
    channel = Channel(w)
    big = os.urandom(200_000)  # larger than one frame's inline limit
    received = []
    reader = threading.Thread(target=lambda: received.extend(iter(lambda: read_message(r), None)))
    reader.start()
    for message in MESSAGES[:3]:
        channel.send(message)
    channel.send(("beat", 13, 1700000001.0, 0.6))  # the wire form mg.beat sends itself
    channel.send_result(big)
    os.close(w)
    reader.join(10)
    os.close(r)
    assert received == [*MESSAGES[:3], Beat(13, 1700000001.0, 0.6), Result(big)]
    assert [type(m) for m in received] == [Started, Ready, Beat, Beat, Result]
