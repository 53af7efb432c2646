"""The island service's bodies (``peer/island/wire.py``) over an in-memory stream, and closed-island membership:
what a lying member sends is refused before anything is allocated, and a peer that names a closed island without
its key is not a member."""

from __future__ import annotations

import asyncio

import pytest
import torch

from locomm.peer.island.wire import island_members, island_proof, read_synced, read_tensors, write_synced
from locomm.peer.transport.records import SwarmKey
from locomm.peer.transport.rpc import Call, Limits, Link, Meter
from locomm.protocol.membership import Heartbeat
from locomm.protocol.messages import PART_LEN, ProtocolViolation, check_response, decode_header
from locomm.protocol.scape import ScapeSync, Synced
from locomm.testing.clock import run

LIMITS = Limits(request_timeout_s=2.0, stall_timeout_s=2.0, min_rate_Bps=1.0, rate_window_s=60.0)
SHAPES = {"w": (8, 16), "b": (16,)}


class Writer:
    def __init__(self) -> None:
        self.buf = bytearray()

    def write(self, data) -> None:
        self.buf += bytes(data)

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        pass


def loopback(data: bytes) -> Link:
    """A link whose reader holds ``data`` (what the other side wrote), then EOF."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return Link(reader, Writer(), LIMITS, Meter("peer", "recv"))


def split_answer(buf: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(buf[:4], "big")
    return decode_header(bytes(buf[4 : 4 + n])), bytes(buf[4 + n :])


def part(data: bytes) -> bytes:
    return PART_LEN.pack(len(data)) + data


def test_synced_buffer_round_trips_and_a_wrong_count_is_refused():
    async def body():
        sync = ScapeSync(SHAPES, rank=0, workers=2, sparsity=0.9)
        mask = torch.tensor([1, 5, 70, 100], dtype=torch.long)
        sync.mask = mask
        synced = Synced(0, torch.arange(4, dtype=torch.float32), [0, 1], torch.tensor([2, 3, 90]), [0, 1])
        w = Writer()
        call = Call("peer", None, Link(asyncio.StreamReader(), w, LIMITS, Meter("p", "send")), None)
        await write_synced(call, synced)
        header, rest = split_answer(w.buf)
        assert check_response(header).name == "OK"
        got, n = await read_synced(loopback(rest), header, sync)
        assert torch.equal(got.values, synced.values) and torch.equal(got.next_mask, synced.next_mask)
        assert n == len(rest) - 2 * PART_LEN.size
        sync.mask = mask[:3]  # our mask has 3 values: a buffer of 4 is a lie, refused before it is read
        with pytest.raises(ProtocolViolation):
            await read_synced(loopback(rest), header, sync)
        with pytest.raises(ProtocolViolation):  # another step's buffer
            await read_synced(loopback(rest), {**header, "step": 5}, ScapeSync(SHAPES, rank=0, workers=2, sparsity=0.9))

    run(body())


def test_tensors_of_another_layout_are_refused_before_reading():
    async def body():
        want = {"model/w": (8, 16)}
        ok = torch.ones(8, 16).numpy().tobytes()
        t, n = await read_tensors(loopback(part(ok)), {"tensors": [["model/w", [8, 16]]]}, want)
        assert torch.equal(t["model/w"], torch.ones(8, 16)) and n == len(ok)
        for listed in ([["model/w", [1 << 20, 1 << 20]]], [["model/x", [8, 16]]], [["model/w", [8, 16]]] * 2, "x"):
            with pytest.raises(ProtocolViolation):
                await read_tensors(loopback(part(ok)), {"tensors": listed}, want)
        nan = torch.full((8, 16), float("nan")).numpy().tobytes()
        with pytest.raises(ProtocolViolation):
            await read_tensors(loopback(part(nan)), {"tensors": [["model/w", [8, 16]]]}, want)
        with pytest.raises(ProtocolViolation):  # a part longer than the tensor
            await read_tensors(loopback(part(ok + b"xxxx")), {"tensors": [["model/w", [8, 16]]]}, want)

    run(body())


def test_a_closed_island_admits_only_peers_that_hold_its_key():
    key = SwarmKey.parse(bytes(range(32)))
    other = SwarmKey.parse(bytes(range(1, 33)))
    run_id = "r" * 16
    a, b, c, d = "QmA", "QmB", "QmC", "QmD"
    beats = [
        Heartbeat(peer=a, island="x", island_proof=island_proof(key, run_id, "x", a)),
        Heartbeat(peer=b, island="x", island_proof=island_proof(key, run_id, "x", b)),
        Heartbeat(peer=c, island="x", island_proof=island_proof(key, run_id, "x", a)),  # a copy of a's proof
        Heartbeat(peer=d, island="x", island_proof=island_proof(other, run_id, "x", d)),  # another key
        Heartbeat(peer="QmE", island="x", island_proof="not hex"),
        Heartbeat(peer="QmF", island="y", island_proof=island_proof(key, run_id, "y", "QmF")),
    ]
    assert island_members(beats, "x", key, run_id) == [a, b]
    assert island_members(beats, "x", None, run_id) == [a, b, c, d, "QmE"]  # an open island: anyone naming it
    assert island_members(beats, "x", key, "another run") == []


def test_the_draw_binds_each_member_before_any_salt_is_seen_and_no_peer_id_picks_the_leader():
    import os

    from locomm.peer.island.wire import SALT_BYTES, island_commitment, island_order

    roster = [f"QmMember{i}" for i in range(4)]
    salts = {p: os.urandom(SALT_BYTES) for p in roster}
    order = island_order(roster, salts)
    assert sorted(order) == roster and island_order(list(reversed(roster)), salts) == order  # everyone's order
    assert island_commitment(salts[roster[0]]) != island_commitment(salts[roster[1]])
    assert len(island_commitment(salts[roster[0]])) == 64
    # An outsider grinding ids for a low one gains nothing: over many draws, every seat leads about as often.
    ground = ["Qm000000000000000000000000000000000000000000000a", *roster[1:]]
    leads = sum(island_order(ground, {p: os.urandom(SALT_BYTES) for p in ground})[0] == ground[0] for _ in range(400))
    assert 60 < leads < 140, leads  # 1 in 4: 100 of 400 expected (binomial sd 8.7)
