"""What a peer answers about whom it has seen alive, checked before it is believed."""

from __future__ import annotations

import json

from locomm.peer.transport import hello
from locomm.protocol.membership import MAX_ROUND


def test_a_seen_answer_is_checked_before_it_is_believed():
    ok = {"QmA": 3, "12D3KooWB": 0}
    assert hello.parse_seen(json.dumps(ok).encode()) == ok
    too_many = {f"Qm{i}": i for i in range(hello.SEEN_MAX + 1)}
    bad = [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        json.dumps({"QmA": -1}).encode(),
        json.dumps({"QmA": True}).encode(),  # a bool is not a round
        json.dumps({"QmA": 1.5}).encode(),
        json.dumps({"QmA": MAX_ROUND + 1}).encode(),
        json.dumps({"": 1}).encode(),
        json.dumps({"x" * (hello.MAX_ID_CHARS + 1): 1}).encode(),
        json.dumps(too_many).encode(),
        b" " * (hello.SEEN_MAX_BYTES + 1),
        b"[" * 60_000,  # nested past Python's stack
    ]
    for data in bad:
        assert hello.parse_seen(data) is None, data[:40]
