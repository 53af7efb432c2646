"""Resource caps of the exchange layer (issue 17 item 7) and the push admission hook (item 3), over fed streams.

- a global cap on inbound streams: beyond ``max_inbound_streams`` a stream is answered NOT_READY before its
  header is read (peer ids are free, so the per-peer cap alone bounds nothing);
- a budget of payload buffers in Gossip: at most ``max_payloads`` pushed payloads received at once
  (``partners + 2``), NOT_READY before the next one is allocated;
- ``Gossip(admit=...)``: a push from a peer it refuses is answered UNAUTHORIZED before anything is read.
None of these is a fault. Same fakes as tests/transport/test_rpc.py (no p2pd), on a virtual-time loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import torch

from locomm.compression.payload import MIN_PART_ELEMS, PayloadCodec
from locomm.peer.transport.gossip import Faults, Gossip
from locomm.peer.transport.rpc import Limits, RpcServer
from locomm.peer.transport.transfers import Incoming
from locomm.protocol.messages import HEADER_LEN, PART_LEN, ErrorCode, pack_frame, push_header
from locomm.testing.clock import run

pytestmark = pytest.mark.timeout(60)

RUN = "testrun0123456789"
ME = "QmReceiverPeer"
SENDER = "QmSenderPeer"
LIMITS = Limits(request_timeout_s=10.0, stall_timeout_s=10.0, min_rate_Bps=1e6, rate_window_s=30.0)


class FakeWriter:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.closed = False

    def write(self, data) -> None:
        assert not self.closed, "write after close"
        self.buf += bytes(data)

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        self.closed = True


def answer(buf: bytes | bytearray) -> ErrorCode:
    n = HEADER_LEN.unpack_from(buf, 0)[0]
    assert len(buf) == HEADER_LEN.size + n, "one answer, nothing else"
    return ErrorCode(msgpack.unpackb(bytes(buf[HEADER_LEN.size :]), raw=False)["status"])


class Node:
    """An RpcServer with a Gossip service whose allocations are counted."""

    def __init__(self, pool, limits: Limits = LIMITS, **gossip) -> None:
        self.faults: list[tuple[str, str]] = []
        self.server = RpcServer(
            None,
            RUN,
            limits,
            pool,
            on_fault=lambda p, w: self.faults.append((p, w)),
            clock=asyncio.get_running_loop().time,
        )
        self.codec = PayloadCodec(
            {"a": (10_000,)}, {"theta": "parameter"}, {"parameter": "lossless"}, part_elems=MIN_PART_ELEMS
        )
        self.allocated = 0
        allocate = self.codec.allocate

        def counted(*a, **k):
            self.allocated += 1
            return allocate(*a, **k)

        self.codec.allocate = counted
        self.gossip = Gossip(
            None,
            self.server,
            run_id=RUN,
            me=ME,
            codec=self.codec,
            limits=limits,
            faults=Faults(3),
            max_body_bytes=1 << 26,
            **gossip,
        )

    def push(self, sender: str = SENDER, round_idx: int = 0) -> bytes:
        payload = {t.name: torch.randn(t.shape) for t in self.codec.tensors}
        parts = self.codec.parts()
        body = b"".join(PART_LEN.pack(len(d)) + d for d in (self.codec.encode_part(payload, p) for p in parts))
        return pack_frame(push_header(RUN, round_idx, sender, 7, 0, 1, {}, parts)) + body

    async def serve(self, data: bytes, remote: str = SENDER) -> ErrorCode:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        writer = FakeWriter()
        await asyncio.wait_for(self.server._serve(self.gossip.service(), remote, reader, writer), 30)
        assert writer.closed
        return answer(writer.buf)


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(2) as ex:
        yield ex


def test_global_stream_cap_answers_not_ready_before_the_header(pool):
    async def body():
        n = Node(pool, Limits(request_timeout_s=10.0, stall_timeout_s=10.0, max_inbound_streams=3))
        n.server.inbound = 3  # three streams (from anyone) already served
        # Not even a header: a refused stream's bytes are drained, never parsed or buffered whole.
        assert await n.serve(b"\xff" * 1000, remote="QmFresh") == ErrorCode.NOT_READY
        assert await n.serve(n.push()) == ErrorCode.NOT_READY
        assert n.server.inbound == 3 and not n.server.open_streams and not n.server.meters
        assert n.faults == [] and n.allocated == 0 and not n.gossip.mailbox.get(0)
        assert n.server.stats.errors_answered["NOT_READY"] == 2
        n.server.inbound = 2  # one of them closed: the next stream is served
        assert await n.serve(n.push()) == ErrorCode.OK
        assert n.server.inbound == 2 and SENDER in n.gossip.mailbox[0]

    run(body())


def test_default_caps_come_from_the_run_spec():
    from locomm.config import ConfigError, NetworkConfig

    assert Limits().max_inbound_streams == NetworkConfig().max_inbound_streams == 256
    assert Limits.from_network(NetworkConfig(max_inbound_streams=9)).max_inbound_streams == 9
    with pytest.raises(ConfigError):
        NetworkConfig(max_inbound_streams=0)


def test_payload_budget_answers_not_ready_before_allocating(pool):
    async def body():
        n = Node(pool)
        assert n.gossip.max_payloads == 3  # one partner (until an exchange says otherwise) + 2
        n.gossip.set_partners(2)
        assert n.gossip.max_payloads == 4
        busy = {(f"QmBusy{i}", 0): Incoming(i, {}, set(), 0.0) for i in range(4)}
        n.gossip.incoming.update(busy)  # four payloads on their way: the budget is spent
        assert await n.serve(n.push()) == ErrorCode.NOT_READY
        assert n.allocated == 0 and n.faults == []
        # A pull we started does not count against the budget (we chose that partner).
        n.gossip.incoming[("QmBusy0", 0)].pulled = True
        assert await n.serve(n.push()) == ErrorCode.OK and n.allocated == 1
        fixed = Node(pool, max_payloads=1)
        fixed.gossip.set_partners(8)
        assert fixed.gossip.max_payloads == 1

    run(body())


def test_admit_hook_refuses_non_partners_with_unauthorized(pool):
    asked: list[tuple[str, int]] = []

    async def admit(peer: str, round_idx: int) -> bool:
        asked.append((peer, round_idx))
        return peer == "QmPartner"

    async def body():
        n = Node(pool, admit=admit)
        assert await n.serve(n.push(round_idx=1), remote=SENDER) == ErrorCode.UNAUTHORIZED
        assert n.allocated == 0 and n.faults == [] and not n.gossip.incoming  # a refusal, not a fault
        assert await n.serve(n.push(sender="QmPartner", round_idx=1), remote="QmPartner") == ErrorCode.OK
        assert asked == [(SENDER, 1), ("QmPartner", 1)] and "QmPartner" in n.gossip.mailbox[1]

    run(body())


def test_a_flood_of_finished_payloads_is_held_within_the_budget(pool):
    """Measured on the main before: 16 admitted identities pushed 32 finished payloads to one peer and every one
    was answered OK and kept decoded (the budget counted only payloads on their way). Now a payload counts until
    an exchange takes it: at most partners + 2 are held, the rest are NOT_READY before any allocation (their
    senders retry, then serve them for a pull), and an exchange frees what it took."""

    async def body():
        n = Node(pool)
        n.gossip.set_partners(1)
        answers = [
            await n.serve(n.push(sender=f"QmFlood{i}", round_idx=r), remote=f"QmFlood{i}")
            for i in range(16)
            for r in (0, 1)
        ]
        assert answers.count(ErrorCode.OK) == 3 and answers.count(ErrorCode.NOT_READY) == 29
        assert n.gossip.held_payloads() == 3 == n.allocated and n.faults == []
        held = {p for r in n.gossip.mailbox for p in n.gossip.mailbox[r]}
        got = await n.gossip.exchange(0, sorted(held), {"theta/a": torch.zeros(10_000)}, eta=lambda p: 0.0)
        assert len(got) >= 1 and n.gossip.held_payloads() == 3 - len(got)
        assert await n.serve(n.push(sender="QmLate", round_idx=1), remote="QmLate") == ErrorCode.OK

    run(body())


def test_outsiders_take_no_shared_slot_and_a_slow_header_holds_one_for_seconds(pool):
    """Measured on the main before: 16 identities x 16 slow headers held every one of the 256 shared inbound
    slots for 30 s each, so every push, pull and state request got NOT_READY, in a closed swarm too, from an
    outsider. Now the policy is asked before a stream takes a shared slot (an outsider's stream is refused at
    once, UNAUTHORIZED, its header never read), and a member's header must come within HEADER_TIMEOUT_S."""
    from locomm.peer.transport.rpc import HEADER_TIMEOUT_S

    async def authorize(peer: str, policy: str) -> bool:
        return not peer.startswith("QmOutsider")

    async def body():
        n = Node(pool, Limits(request_timeout_s=30.0, stall_timeout_s=10.0, max_inbound_streams=2))
        n.server.authorize = authorize
        for i in range(8):  # outsiders' streams that send nothing: refused at once, no slot, no header read
            reader, writer = asyncio.StreamReader(), FakeWriter()
            t0 = asyncio.get_running_loop().time()
            await asyncio.wait_for(n.server._serve(n.gossip.service(), f"QmOutsider{i}", reader, writer), 5)
            assert answer(writer.buf) == ErrorCode.UNAUTHORIZED and n.server.inbound == 0
            assert asyncio.get_running_loop().time() - t0 <= 1.0 + 1e-9  # the refusal's short drain, no more
        # A member that opens a stream and sends no header holds a slot for HEADER_TIMEOUT_S, not 30 s.
        reader, writer = asyncio.StreamReader(), FakeWriter()
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(n.server._serve(n.gossip.service(), SENDER, reader, writer), 60)
        waited = asyncio.get_running_loop().time() - t0
        assert answer(writer.buf) == ErrorCode.TIMEOUT and HEADER_TIMEOUT_S <= waited < HEADER_TIMEOUT_S + 2.0
        assert await n.serve(n.push()) == ErrorCode.OK and n.faults == []

    run(body())
