"""The exchange layer without a network: the RPC service base and Gossip's push handler over fed streams.

Every request here goes through ``RpcServer._serve`` with an ``asyncio.StreamReader`` the test
feeds itself and a writer that collects the answer; ``Link``'s deadlines are driven by bytes the
test feeds from a task. No p2pd, no sockets.

Every test runs on a virtual-time loop (``locomm.testing.clock``) and hands the loop's clock to the
server, the links and Gossip: a stall of 0.3 s takes no real time, and the deadline tests assert the
exact virtual instant a transfer is cut, whatever else the machine is doing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
import torch

from locomm import PROTOCOL_VERSION
from locomm.compression.payload import MIN_PART_ELEMS, PayloadCodec
from locomm.peer.transport.gossip import Faults, Gossip
from locomm.peer.transport.meter import LinkLoad
from locomm.peer.transport.rpc import Limits, Link, Meter, RpcServer, Service, TransferCut
from locomm.protocol.messages import (
    FAULT_CODES,
    HEADER_LEN,
    MAX_HEADER_BYTES,
    PART_LEN,
    ErrorCode,
    ProtocolViolation,
    envelope,
    pack_frame,
    push_header,
)
from locomm.testing.clock import run

pytestmark = pytest.mark.timeout(120)

RUN = "testrun0123456789"
ME = "QmReceiverPeer"
SENDER = "QmSenderPeer"
SHAPES = {"a": (10_000,), "b": (5, 7)}  # with MIN_PART_ELEMS parts: a -> 3 parts, b -> 1 part
LIMITS = Limits(request_timeout_s=10.0, stall_timeout_s=10.0, min_rate_Bps=1e6, rate_window_s=30.0)


# ------------------------------------------------------------------------------ fakes


class FakeWriter:
    """Collects what is written; ``on_write`` fires after each write (to end the stream once answered)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.closed = False
        self.written = asyncio.Event()

    def write(self, data) -> None:
        assert not self.closed, "write after close"
        self.buf += bytes(data)
        self.written.set()

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        self.closed = True


class StubP2P:
    def __init__(self) -> None:
        self.handlers = {}

    async def add_binary_stream_handler(self, name, handler) -> None:
        self.handlers[name] = handler


def answers(buf: bytes | bytearray) -> list[dict]:
    """The u32-length-prefixed msgpack headers in ``buf``."""
    out, off = [], 0
    while off < len(buf):
        n = HEADER_LEN.unpack_from(buf, off)[0]
        off += HEADER_LEN.size
        out.append(msgpack.unpackb(bytes(buf[off : off + n]), raw=False))
        off += n
    assert off == len(buf), "trailing bytes after the last answer"
    return out


def make_codec(stack: str = "lossless") -> PayloadCodec:
    return PayloadCodec(SHAPES, {"theta": "parameter"}, {"parameter": stack}, part_elems=MIN_PART_ELEMS)


def make_payload(codec: PayloadCodec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in codec.tensors}


def push_frame(codec, *, sender=SENDER, round_idx=0, xfer=7, over=None) -> bytes:
    """A push header for all of ``codec``'s parts on one stream; ``over`` replaces header fields."""
    return pack_frame({**push_header(RUN, round_idx, sender, xfer, 0, 1, {}, codec.parts()), **(over or {})})


def body_bytes(codec, payload, parts=None) -> bytes:
    parts = codec.parts() if parts is None else parts
    return b"".join(PART_LEN.pack(len(d)) + d for d in (codec.encode_part(payload, p) for p in parts))


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(2) as ex:
        yield ex


class Harness:
    """An RpcServer with a real Gossip service, Faults wired to on_fault, and a log of faults."""

    def __init__(
        self,
        pool,
        limits: Limits = LIMITS,
        *,
        authorize=None,
        codec=None,
        max_faults: int = 3,
        max_body_bytes: int = 1 << 26,
    ) -> None:
        self.faults = Faults(max_faults)
        self.fault_log: list[tuple[str, str]] = []

        def on_fault(peer: str, why: str) -> None:
            self.fault_log.append((peer, why))
            self.faults.record(peer, why)

        self.p2p = StubP2P()
        self.server = RpcServer(
            self.p2p,
            RUN,
            limits,
            pool,
            authorize=authorize,
            is_banned=lambda p: p in self.faults.banned,
            on_fault=on_fault,
            clock=asyncio.get_running_loop().time,  # the Gossip below takes the server's
        )
        self.codec = codec or make_codec()
        self.gossip = Gossip(
            None,
            self.server,
            run_id=RUN,
            me=ME,
            codec=self.codec,
            limits=limits,
            faults=self.faults,
            max_body_bytes=max_body_bytes,
        )

    async def request(
        self,
        data: bytes,
        *,
        remote: str = SENDER,
        eof: bool = True,
        service: Service | None = None,
        eof_after_answer: bool = False,
        check_leaks: bool = True,
    ) -> list[dict]:
        """Serve one stream carrying ``data``; the answers written back."""
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        writer = FakeWriter()

        async def end_when_answered() -> None:
            await writer.written.wait()
            reader.feed_eof()

        ender = asyncio.create_task(end_when_answered()) if eof_after_answer and not eof else None
        try:
            await asyncio.wait_for(self.server._serve(service or self.gossip.service(), remote, reader, writer), 30)
        finally:
            if ender is not None:
                ender.cancel()
        assert writer.closed, "the stream was not closed"
        if check_leaks:
            assert not self.server.open_streams, "open stream count leaked"
            assert not self.server.meters, "meter leaked"
        return answers(writer.buf)


def now() -> float:
    return asyncio.get_running_loop().time()


def status(ans: list[dict]) -> ErrorCode:
    assert len(ans) == 1, ans
    assert ans[0]["v"] == PROTOCOL_VERSION
    return ErrorCode(ans[0]["status"])


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32 if x.dtype == torch.float32 else torch.int16)


# ------------------------------------------------------------------------------ 1. the service base


def test_valid_push_is_answered_ok_and_delivered_bit_exact(pool):
    async def body():
        h = Harness(pool)
        payload = make_payload(h.codec)
        ans = await h.request(push_frame(h.codec) + body_bytes(h.codec, payload))
        assert status(ans) == ErrorCode.OK and ans[0]["pull"] is False and not ans[0].get("held")
        got = h.gossip.mailbox[0][SENDER]
        assert set(got) == set(payload)
        for k, v in payload.items():
            assert got[k].dtype == torch.float32 and got[k].shape == v.shape
            assert torch.equal(bits(got[k]), bits(v)), k
        assert h.fault_log == [] and not h.gossip.incoming
        assert h.gossip.stats.bytes_received == len(body_bytes(h.codec, payload)) - 4 * len(h.codec.parts())
        again = await h.request(push_frame(h.codec, xfer=9) + body_bytes(h.codec, payload))
        # A payload we already hold (say, pulled while the push was retried) is answered OK: the push has done
        # its job, so the sender must not retry it or count it failed. Still no fault, nothing reallocated; and
        # ``held`` tells the sender its bytes delivered nothing (they count as undelivered, not as sent payload).
        assert status(again) == ErrorCode.OK and again[0]["held"] is True
        assert h.fault_log == [] and not h.gossip.incoming

    run(body())


def test_a_round_we_applied_is_refused_as_stale_and_one_ahead_is_not_ready(pool):
    """A receiver two rounds past r has applied r: a push of r is a refusal (STALE_ROUND: the sender stops
    retrying and stops waiting for us), never a fault; a push two rounds ahead is NOT_READY (we are behind:
    retry). Answering "not ready" to the stale one kept a peer that fell two rounds behind there for good."""

    async def body():
        h = Harness(pool)
        h.gossip.advance(5)
        payload = make_payload(h.codec)
        old = await h.request(push_frame(h.codec, round_idx=3) + body_bytes(h.codec, payload))
        ahead = await h.request(push_frame(h.codec, round_idx=7, xfer=8) + body_bytes(h.codec, payload))
        near = await h.request(push_frame(h.codec, round_idx=4, xfer=9) + body_bytes(h.codec, payload))
        assert (status(old), status(ahead), status(near)) == (ErrorCode.STALE_ROUND, ErrorCode.NOT_READY, ErrorCode.OK)
        assert h.fault_log == [] and set(h.gossip.mailbox) == {4}

    run(body())


def test_add_registers_the_handler_and_it_serves(pool):
    """``add`` is the only use of p2p: the registered callback serves with the stream's peer id."""

    class Info:
        class peer_id:  # noqa: N801 - stands in for hivemind's PeerID
            @staticmethod
            def to_base58() -> str:
                return SENDER

    async def body():
        h = Harness(pool)
        await h.server.add(h.gossip.service())
        assert list(h.p2p.handlers) == [f"locomm.{RUN}.gossip"] == [h.gossip.handler]
        payload = make_payload(h.codec, 3)
        reader, writer = asyncio.StreamReader(), FakeWriter()
        reader.feed_data(push_frame(h.codec) + body_bytes(h.codec, payload))
        reader.feed_eof()
        await h.p2p.handlers[h.gossip.handler](Info(), reader, writer)
        assert status(answers(writer.buf)) == ErrorCode.OK
        assert torch.equal(h.gossip.mailbox[0][SENDER]["theta/a"], payload["theta/a"])

    run(body())


def _garbage_header() -> bytes:
    return HEADER_LEN.pack(8) + b"\xc1" * 8  # 0xc1 is never used in msgpack


HEADER_CASES = {
    "garbage_msgpack": (_garbage_header(), ErrorCode.MALFORMED),
    "not_a_map": (HEADER_LEN.pack(3) + msgpack.packb([1, 2]), ErrorCode.MALFORMED),
    "zero_length": (HEADER_LEN.pack(0), ErrorCode.MALFORMED),
    "header_over_limit": (HEADER_LEN.pack(MAX_HEADER_BYTES + 1), ErrorCode.TOO_LARGE),
    "huge_header": (HEADER_LEN.pack(2**32 - 1), ErrorCode.TOO_LARGE),
    "bad_version": (pack_frame({**envelope(RUN, "push", 0, SENDER), "v": 999}), ErrorCode.BAD_VERSION),
    "wrong_run": (pack_frame(envelope("other", "push", 0, SENDER)), ErrorCode.WRONG_RUN),
    "unknown_type": (pack_frame(envelope(RUN, "state_fetch", 0, SENDER)), ErrorCode.MALFORMED),
    "round_not_int": (pack_frame(envelope(RUN, "push", "three", SENDER)), ErrorCode.MALFORMED),
    "sender_is_not_the_stream_peer": (None, ErrorCode.MALFORMED),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_bad_headers_get_their_code_and_count_as_faults(pool, case):
    async def body():
        h = Harness(pool)
        data, want = HEADER_CASES[case]
        if data is None:  # a valid push whose header names another sender than the authenticated stream
            data = push_frame(h.codec, sender="QmSomeoneElse") + body_bytes(h.codec, make_payload(h.codec))
        ans = await h.request(data)
        assert status(ans) == want
        assert want in FAULT_CODES
        assert [p for p, _ in h.fault_log] == [SENDER]  # charged to the stream's peer, once
        assert not h.gossip.mailbox.get(0) and not h.gossip.incoming
        assert h.server.stats.errors_answered[want.name] == 1

    run(body())


def test_oversized_part_declaration_is_too_large(pool):
    """A part length prefix above what the part can take is refused before anything is allocated."""

    async def body():
        h = Harness(pool)
        part = h.codec.parts()[0]
        over = h.codec.max_part_bytes(part) + 1
        ans = await h.request(push_frame(h.codec) + PART_LEN.pack(over))
        assert status(ans) == ErrorCode.TOO_LARGE and len(h.fault_log) == 1
        assert not h.gossip.incoming  # the partial transfer left nothing behind
        # Exactly the maximum is accepted as a length (then the stream ends: a broken stream, no answer).
        ans = await h.request(push_frame(h.codec) + PART_LEN.pack(over - 1) + b"\0" * 100)
        assert ans == [] and len(h.fault_log) == 1

    run(body())


def test_transfer_over_the_body_limit_is_too_large(pool):
    async def body():
        h = Harness(pool, max_body_bytes=10_000)  # the payload's parts can take ~45 kB
        ans = await h.request(push_frame(h.codec) + body_bytes(h.codec, make_payload(h.codec)))
        assert status(ans) == ErrorCode.TOO_LARGE and len(h.fault_log) == 1 and not h.gossip.incoming

    run(body())


def _corrupt(codec, payload, kind):
    """A push body whose second part is broken in one way."""
    parts = codec.parts()
    enc = [codec.encode_part(payload, p) for p in parts]
    if kind == "garbage":
        enc[1] = bytes(len(enc[1]))
    elif kind == "flipped":
        b = bytearray(enc[1])
        b[len(b) // 2] ^= 0xFF
        enc[1] = bytes(b)
    elif kind == "other_part":  # a valid encoding of the wrong number of values
        enc[1] = codec.encode_part(payload, parts[-1])
    return b"".join(PART_LEN.pack(len(d)) + d for d in enc)


@pytest.mark.parametrize(
    "stack,kind,want",
    [
        ("lossless", "garbage", ErrorCode.BAD_PAYLOAD),
        ("lossless", "flipped", ErrorCode.BAD_PAYLOAD),
        ("lossless", "other_part", ErrorCode.BAD_SHAPE),
        ("none", "other_part", ErrorCode.BAD_SHAPE),
        ("none", "nan", ErrorCode.NOT_FINITE),
    ],
)
def test_bad_payload_parts_get_their_code(pool, stack, kind, want):
    async def body():
        h = Harness(pool, codec=make_codec(stack))
        payload = make_payload(h.codec)
        if kind == "nan":
            payload["theta/a"][5000] = float("nan")
            data = body_bytes(h.codec, payload)
        else:
            data = _corrupt(h.codec, payload, kind)
        ans = await h.request(push_frame(h.codec) + data)
        assert status(ans) == want and len(h.fault_log) == 1
        assert not h.gossip.mailbox.get(0) and not h.gossip.incoming

    run(body())


@pytest.mark.parametrize(
    "fields,want",
    [
        ({"parts": [[0, 0, 999]]}, ErrorCode.BAD_SHAPE),
        ({"parts": []}, ErrorCode.MALFORMED),
        ({"enc": {"evil": 1}}, ErrorCode.UNEXPECTED_TENSOR),
        ({"streams": 0}, ErrorCode.MALFORMED),
        ({"xfer": "x"}, ErrorCode.MALFORMED),
    ],
)
def test_bad_transfer_layouts_are_faults(pool, fields, want):
    async def body():
        h = Harness(pool)
        ans = await h.request(push_frame(h.codec, over=fields))
        assert status(ans) == want and len(h.fault_log) == 1

    run(body())


def test_stall_is_a_timeout_not_a_fault(pool):
    async def body():
        h = Harness(pool, Limits(request_timeout_s=10.0, stall_timeout_s=0.3, min_rate_Bps=1e6))
        t0 = now()
        ans = await h.request(push_frame(h.codec), eof=False, eof_after_answer=True)  # the header, then nothing
        dt = now() - t0
        assert status(ans) == ErrorCode.TIMEOUT
        assert dt == pytest.approx(0.3, abs=1e-9)  # cut exactly one stall timeout after the header
        assert "no bytes" in ans[0]["msg"]
        assert h.fault_log == [] and h.faults.total == 0
        assert h.server.stats.cut == 1 and h.server.stats.errors_answered["TIMEOUT"] == 1
        assert not h.gossip.incoming

    run(body())


def test_stall_mid_body_then_a_fresh_transfer_completes(pool):
    """A transfer cut after some parts: no fault, and a later transfer (another xfer) starts over and lands."""

    async def body():
        h = Harness(pool, Limits(request_timeout_s=10.0, stall_timeout_s=0.3, min_rate_Bps=1e6))
        payload = make_payload(h.codec, 5)
        parts = h.codec.parts()
        three = b"".join(PART_LEN.pack(len(d)) + d for d in (h.codec.encode_part(payload, p) for p in parts[:3]))
        ans = await h.request(push_frame(h.codec) + three, eof=False, eof_after_answer=True)
        assert status(ans) == ErrorCode.TIMEOUT and h.fault_log == []
        # Three parts arrived at once and were decoded in the pool (no virtual time passes while threads work):
        # the cut is one stall timeout after them, and the fresh transfer starts right then.
        assert now() == pytest.approx(0.3, abs=1e-9)
        ans = await h.request(push_frame(h.codec, xfer=1234) + body_bytes(h.codec, payload))
        assert status(ans) == ErrorCode.OK and h.fault_log == []
        assert now() == pytest.approx(0.3, abs=1e-9)
        for k, v in payload.items():
            assert torch.equal(bits(h.gossip.mailbox[0][SENDER][k]), bits(v))

    run(body())


def test_stream_ending_mid_body_is_not_answered_and_not_a_fault(pool):
    async def body():
        h = Harness(pool)
        data = push_frame(h.codec) + body_bytes(h.codec, make_payload(h.codec))
        ans = await h.request(data[:-100])
        assert ans == [] and h.fault_log == []
        # What was decoded may stay for another stream or a pull; nothing undecoded stays claimed.
        assert all(inc.claimed == inc.done for inc in h.gossip.incoming.values())

    run(body())


@pytest.mark.parametrize("cut", ["empty_stream", "inside_prefix", "inside_header"])
def test_stream_ending_inside_the_header_is_not_a_fault(pool, cut):
    async def body():
        h = Harness(pool)
        frame = push_frame(h.codec)
        data = {"empty_stream": b"", "inside_prefix": frame[:2], "inside_header": frame[: len(frame) // 2]}[cut]
        await h.request(data)
        assert h.fault_log == []

    run(body())


def test_unauthorized_sender_is_refused_not_a_fault(pool):
    calls = []

    async def authorize(remote: str, policy: str) -> bool:
        calls.append((remote, policy))
        return False

    async def body():
        h = Harness(pool, authorize=authorize)
        ans = await h.request(push_frame(h.codec) + body_bytes(h.codec, make_payload(h.codec)))
        assert status(ans) == ErrorCode.UNAUTHORIZED
        assert calls == [(SENDER, "member")]
        assert h.fault_log == [] and not h.gossip.incoming and not h.gossip.mailbox.get(0)
        assert h.gossip.stats.bytes_received == 0  # the body was never read as a payload

    run(body())


def test_banned_sender_is_refused_before_its_body_is_read(pool):
    async def body():
        h = Harness(pool)
        h.faults.ban(SENDER)
        ans = await h.request(push_frame(h.codec) + body_bytes(h.codec, make_payload(h.codec)))
        assert status(ans) == ErrorCode.BANNED
        assert h.fault_log == [] and h.gossip.stats.bytes_received == 0 and not h.gossip.mailbox.get(0)
        # Banned even when what it sends is garbage: no further faults pile up.
        assert status(await h.request(_garbage_header())) == ErrorCode.BANNED and h.fault_log == []

    run(body())


def test_repeated_faults_ban(pool):
    async def body():
        h = Harness(pool, max_faults=3)
        for _ in range(3):
            assert status(await h.request(_garbage_header())) == ErrorCode.MALFORMED
        assert SENDER in h.faults.banned and h.faults.count[SENDER] == 3
        ok = push_frame(h.codec) + body_bytes(h.codec, make_payload(h.codec))
        assert status(await h.request(ok)) == ErrorCode.BANNED
        assert status(await h.request(ok, remote="QmInnocent")) == ErrorCode.MALFORMED  # sender != stream peer
        assert "QmInnocent" not in h.faults.banned

    run(body())


def test_too_many_open_streams_is_not_ready(pool):
    async def body():
        h = Harness(pool, Limits(request_timeout_s=10.0, stall_timeout_s=10.0, max_streams_per_peer=2))
        h.server.open_streams[SENDER] = 2  # two streams from this peer already open
        ans = await h.request(push_frame(h.codec) + body_bytes(h.codec, make_payload(h.codec)), check_leaks=False)
        assert status(ans) == ErrorCode.NOT_READY and h.fault_log == []
        assert h.server.open_streams == {SENDER: 2} and not h.server.meters  # ours closed, theirs still counted
        assert not h.gossip.mailbox.get(0)

    run(body())


@pytest.mark.parametrize("code", [c for c in ErrorCode if c != ErrorCode.OK])
def test_faults_are_counted_exactly_for_fault_codes(pool, code):
    """Whatever a handler raises, the answer carries its code; only FAULT_CODES reach on_fault."""

    async def handler(call) -> None:
        raise ProtocolViolation(code, "test")

    async def body():
        h = Harness(pool)
        svc = Service("test", {"ping": handler})
        ans = await h.request(pack_frame(envelope(RUN, "ping", 0, SENDER)), service=svc)
        assert status(ans) == code
        assert len(h.fault_log) == (1 if code in FAULT_CODES else 0)

    run(body())


@pytest.mark.parametrize(
    "exc,want", [(TransferCut("slow"), ErrorCode.TIMEOUT), (RuntimeError("bug"), ErrorCode.INTERNAL)]
)
def test_slowness_and_our_own_bugs_are_not_faults(pool, exc, want):
    async def handler(call) -> None:
        raise exc

    async def body():
        h = Harness(pool)
        ans = await h.request(pack_frame(envelope(RUN, "ping", 0, SENDER)), service=Service("t", {"ping": handler}))
        assert status(ans) == want and h.fault_log == []

    run(body())


def test_fault_codes_are_exactly_the_violations():
    assert FAULT_CODES == {
        ErrorCode.BAD_VERSION,
        ErrorCode.WRONG_RUN,
        ErrorCode.MALFORMED,
        ErrorCode.TOO_LARGE,
        ErrorCode.UNEXPECTED_TENSOR,
        ErrorCode.BAD_SHAPE,
        ErrorCode.BAD_PAYLOAD,
        ErrorCode.NOT_FINITE,
    }
    assert not FAULT_CODES & {
        ErrorCode.TIMEOUT,
        ErrorCode.UNAUTHORIZED,
        ErrorCode.BANNED,
        ErrorCode.NOT_READY,
        ErrorCode.STALE_ROUND,
        ErrorCode.INTERNAL,
        ErrorCode.OK,
    }


def test_a_stalled_partial_transfer_does_not_block_the_pull(pool):
    async def body():
        h = Harness(pool, Limits(request_timeout_s=10.0, stall_timeout_s=0.3, min_rate_Bps=1e6))
        g = h.gossip
        g.max_wait_s = 5.0
        theirs = make_payload(h.codec, 1)
        parts = h.codec.parts()
        three = b"".join(PART_LEN.pack(len(d)) + d for d in (h.codec.encode_part(theirs, p) for p in parts[:3]))
        # Their push is cut after three of four parts: the partial Incoming stays (for another stream or a pull).
        assert (
            status(await h.request(push_frame(h.codec) + three, eof=False, eof_after_answer=True)) == ErrorCode.TIMEOUT
        )
        assert (SENDER, 0) in g.incoming
        pulled = []

        async def push(peer, out):  # our push to them is cut too
            return "cut"

        async def pull(peer, round_idx):
            pulled.append((peer, now()))
            return False

        g.push, g.pull = push, pull
        assert g.clock is h.server.clock
        await asyncio.sleep(0.35)  # the partial transfer is no longer moving
        start = now()
        await asyncio.wait_for(g.exchange(0, [SENDER], make_payload(h.codec, 2), eta=lambda p: now() - 1), 30)
        assert pulled == [(SENDER, start)]  # pulled at once, not after the partial transfer's stall
        assert now() - start <= 0.5 + 1e-9 < g.max_wait_s  # one wait for news, then the round went on

    run(body())


# ------------------------------------------------------------------------------ 2. deadlines


async def _feed(reader: asyncio.StreamReader, chunk: bytes, every_s: float, count: int) -> float:
    """A writer that sleeps in virtual time: ``count`` chunks, one every ``every_s``; the time of the last."""
    last = now()
    for _ in range(count):
        reader.feed_data(chunk)
        last = now()
        await asyncio.sleep(every_s)
    return last


def _link(limits: Limits, writer: FakeWriter | None = None, loads=None) -> tuple[asyncio.StreamReader, Link]:
    reader = asyncio.StreamReader()
    return reader, Link(reader, writer or FakeWriter(), limits, Meter("peer", "recv"), clock=now, loads=loads)


def test_slow_but_moving_transfer_is_not_cut():
    """15 chunks 0.1 s apart: 1.4 s from first to last, longer than the stall timeout, yet never 1 s without a
    byte."""
    limits = Limits(request_timeout_s=1.0, stall_timeout_s=1.0, min_rate_Bps=1.0, rate_window_s=60.0)

    async def body():
        reader, link = _link(limits)
        link.expect(1500)
        feeder = asyncio.create_task(_feed(reader, b"x" * 100, 0.1, 15))
        t0 = now()
        data = await link.read_exact(1500)
        dt = now() - t0
        await feeder
        assert bytes(data) == b"x" * 1500
        assert dt == pytest.approx(1.4, abs=1e-9)  # done with the last chunk, having outlasted the stall timeout
        assert dt > limits.stall_timeout_s
        assert link.meter.done == 1500 and link.meter.total == 1500
        assert link.meter.rate_Bps == pytest.approx(1500 / 1.4)  # the meter runs on the link's clock

    run(body())


def test_stalled_transfer_is_cut_after_the_stall_timeout():
    limits = Limits(request_timeout_s=1.0, stall_timeout_s=0.5, min_rate_Bps=1.0, rate_window_s=60.0)

    async def body():
        reader, link = _link(limits)
        link.expect(10_000)
        feeder = asyncio.create_task(_feed(reader, b"x" * 100, 0.05, 4))  # then silence (no EOF)
        with pytest.raises(TransferCut, match="no bytes"):
            await asyncio.wait_for(link.read_exact(10_000), 10)
        cut = now()
        last = await feeder
        assert last == pytest.approx(0.15, abs=1e-9)
        assert cut - last == pytest.approx(limits.stall_timeout_s, abs=1e-9)  # exactly the stall timeout after it
        assert link.meter.done == 400

    run(body())


def test_trickle_below_the_floor_is_cut_after_one_window():
    """10 bytes every 1/16 s always moves (no stall), but is far below 100 kB/s over a 0.5 s window.

    (Steps of 1/16 s add up exactly in binary, so the window closes exactly on the 9th chunk.)"""
    limits = Limits(request_timeout_s=10.0, stall_timeout_s=5.0, min_rate_Bps=100e3, rate_window_s=0.5)

    async def body():
        reader, link = _link(limits)
        feeder = asyncio.create_task(_feed(reader, b"x" * 10, 1 / 16, 400))  # 25 s of trickle
        t0 = now()
        with pytest.raises(TransferCut, match="below the floor"):
            await asyncio.wait_for(link.read_exact(1_000_000), 10)
        dt = now() - t0
        feeder.cancel()
        assert dt == limits.rate_window_s  # one window of waiting, long before the stall timeout
        assert link.meter.done == 90  # the chunks at 0, 1/16, ..., 8/16 s

    run(body())


def test_a_slow_stream_on_a_busy_link_is_not_cut_and_a_lone_trickle_still_is():
    """The floor judges a peer, not congestion: while our link moves at least the floor in total (and half the
    most it was seen to move), a stream below the floor shares it and is not cut; once the link is idle but
    for the trickle, the trickle is cut within a window. A trickle on a link that never carried more is cut as
    before (a lone trickle moves less than the floor, so it never makes the link busy)."""
    limits = Limits(request_timeout_s=100.0, stall_timeout_s=5.0, min_rate_Bps=100e3, rate_window_s=0.5)

    async def body():
        loads = {d: LinkLoad(limits.rate_window_s) for d in ("send", "recv")}
        fast_reader, fast = _link(limits, loads=loads)
        slow_reader, slow = _link(limits, loads=loads)
        fast_feed = asyncio.create_task(_feed(fast_reader, b"y" * 25_000, 1 / 16, 160))  # 400 kB/s for 10 s
        slow_feed = asyncio.create_task(_feed(slow_reader, b"x" * 10, 1 / 16, 4000))  # 160 B/s
        fast_read = asyncio.create_task(fast.read_exact(25_000 * 160))
        t0 = now()
        with pytest.raises(TransferCut, match="below the floor"):
            await asyncio.wait_for(slow.read_exact(1_000_000), 60)
        cut = now() - t0
        await fast_read  # the busy stream itself completed
        fast_feed.cancel()
        slow_feed.cancel()
        assert 10.0 < cut <= 10.0 + 2 * limits.rate_window_s  # not while the link was busy; soon after it was not

        lone_reader, lone = _link(limits, loads={d: LinkLoad(limits.rate_window_s) for d in ("send", "recv")})
        feeder = asyncio.create_task(_feed(lone_reader, b"x" * 10, 1 / 16, 400))
        t0 = now()
        with pytest.raises(TransferCut, match="below the floor"):
            await asyncio.wait_for(lone.read_exact(1_000_000), 10)
        feeder.cancel()
        assert now() - t0 == limits.rate_window_s

    run(body())


def test_transfer_above_the_floor_is_not_cut():
    """256 kB every 0.05 s (~5 MB/s) over 1.2 s, more than two windows, against a 100 kB/s floor."""
    limits = Limits(request_timeout_s=10.0, stall_timeout_s=5.0, min_rate_Bps=100e3, rate_window_s=0.5)
    chunk = bytes(range(256)) * 1024

    async def body():
        reader, link = _link(limits)
        link.expect(24 * len(chunk))
        feeder = asyncio.create_task(_feed(reader, chunk, 0.05, 24))
        t0 = now()
        data = await link.read_exact(24 * len(chunk))
        dt = now() - t0
        await feeder
        assert data == chunk * 24
        assert dt == pytest.approx(23 * 0.05, abs=1e-9)  # done with the last chunk
        assert dt > 2 * limits.rate_window_s  # the window was checked more than once

    run(body())


def test_size_deadline_cuts_a_transfer_slower_than_the_floor():
    """expect(1000) at 1 kB/s + 0.2 s slack: 1.2 s. At 400 B/s (50 B every 1/8 s, never stalling) it is cut at
    the deadline, between two chunks."""
    limits = Limits(request_timeout_s=0.2, stall_timeout_s=5.0, min_rate_Bps=1000.0, rate_window_s=60.0)
    assert limits.deadline_s(1000) == pytest.approx(1.2)
    assert limits.deadline_s(1000, streams=4) == pytest.approx(4.2)

    async def body():
        reader, link = _link(limits)
        link.expect(1000)
        feeder = asyncio.create_task(_feed(reader, b"x" * 50, 1 / 8, 20))
        t0 = now()
        with pytest.raises(TransferCut, match="past the deadline"):
            await asyncio.wait_for(link.read_exact(1000), 10)
        dt = now() - t0
        feeder.cancel()
        assert dt == pytest.approx(1.2, abs=1e-9)  # at the deadline, not at the next chunk (1.25 s)
        assert link.meter.done == 500  # the chunks at 0, 1/8, ..., 9/8 s

    run(body())


def test_a_receiver_that_takes_nothing_cuts_the_writer():
    """The write side: a drain that never returns is cut after the stall timeout, then at the size deadline."""
    limits = Limits(request_timeout_s=0.5, stall_timeout_s=2.0, min_rate_Bps=1000.0, rate_window_s=60.0)

    class Stuck(FakeWriter):
        async def drain(self) -> None:
            await asyncio.Event().wait()

    async def body():
        _, link = _link(limits, Stuck())
        t0 = now()
        with pytest.raises(TransferCut, match="the receiver took nothing for 2 s"):
            await link.write_bytes(b"x" * 10)  # no size declared: the stall timeout bounds it
        assert now() - t0 == pytest.approx(2.0, abs=1e-9)
        link.expect(100)  # 0.5 s + 100 B at 1 kB/s: 0.6 s, sooner than a stall
        t0 = now()
        with pytest.raises(TransferCut, match="past the deadline for 100 bytes"):
            await link.write_bytes(b"x" * 10)
        assert now() - t0 == pytest.approx(0.6, abs=1e-9)

    run(body())


# ------------------------------------------------------------------------------ 3. memory bound of a chunked decode


MEMORY_SCRIPT = textwrap.dedent(r"""
    import asyncio, json, resource, sys, time
    from concurrent.futures import ThreadPoolExecutor
    import torch
    sys.path.insert(0, sys.argv[2])
    from test_rpc import FakeWriter, Harness, RUN, SENDER, answers, push_header
    from locomm.compression.payload import PayloadCodec
    from locomm.peer.transport.rpc import Limits
    from locomm.protocol.messages import PART_LEN, pack_frame

    LIMITS = Limits(request_timeout_s=60.0, stall_timeout_s=60.0, min_rate_Bps=1e6, rate_window_s=600.0)

    def sender(mb, seed):
        n = mb * (1 << 20) // 4
        codec = PayloadCodec({"w": (n,)}, {"theta": "parameter"}, {"parameter": "lossless"})
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
        parts = codec.parts()
        enc = [codec.encode_part({"theta/w": x}, p) for p in parts]  # the sender's parts
        return codec, x, enc, pack_frame(push_header(RUN, 0, SENDER, 7, 0, 1, {}, parts))

    async def receive(pool, codec, enc, frame, measure):
        h = Harness(pool, LIMITS, codec=codec, max_body_bytes=4 * sum(map(len, enc)) + (1 << 20))
        reader, writer = asyncio.StreamReader(), FakeWriter()
        part_max = max(len(e) for e in enc)

        async def wire():  # a few parts in flight at a time, like a socket's buffers
            reader.feed_data(frame)
            for e in enc:
                while len(reader._buffer) > 2 * part_max:
                    await asyncio.sleep(0.001)
                reader.feed_data(PART_LEN.pack(len(e)))
                reader.feed_data(e)
            reader.feed_eof()

        if measure:
            open("/proc/self/clear_refs", "w").write("5")  # reset the peak: the sender's side does not count
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        feeder = asyncio.create_task(wire())
        await h.server._serve(h.gossip.service(), SENDER, reader, writer)
        await feeder
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return answers(writer.buf)[0]["status"], h.gossip.mailbox[0][SENDER]["theta/w"], after - before

    async def main(mb):
        pool = ThreadPoolExecutor(2)
        # Warm up the whole path (the pool's threads, numba kernels, torch) on a small payload first.
        codec, x, enc, frame = sender(8, 1)
        await receive(pool, codec, enc, frame, False)
        codec, x, enc, frame = sender(mb, 0)
        t0 = time.monotonic()
        code, got, growth = await receive(pool, codec, enc, frame, True)
        exact = bool(torch.equal(got.view(torch.int32), x.view(torch.int32)))
        pool.shutdown()
        return {"status": code, "growth": growth, "payload": x.numel() * 4, "encoded": sum(map(len, enc)),
                "exact": exact, "s": time.monotonic() - t0}

    print(json.dumps(asyncio.run(main(int(sys.argv[1])))))
""")


def test_chunked_decode_stays_inside_its_memory_bound():
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs /proc/self/clear_refs to reset the peak RSS")
    mb = 200
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(mb), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["status"] == ErrorCode.OK and r["exact"]
    # The destination tensor (1x) plus a few parts in flight; buffering the encoded payload would be ~1.8x.
    assert r["growth"] <= 1.5 * r["payload"], r
    assert r["encoded"] > 0.5 * r["payload"], r  # the test would notice if the body were buffered whole


def test_state_fetch_is_served_from_the_previous_snapshot_too(pool):
    """A joiner whose download spans a round boundary finishes against the manifest it was given; a state
    two snapshots old is NOT_READY ("moved on"), which is not a fault."""
    from locomm.peer.transport.state_sync import Snapshot, StateServer
    from locomm.protocol.state_messages import state_fetch_header

    async def body():
        h = Harness(pool)
        states = [Snapshot.take(r, {"w": torch.full((3, 2), float(r))}) for r in range(3)]
        server = StateServer(RUN)

        async def fetch(snap: Snapshot) -> tuple[dict, bytes]:
            reader = asyncio.StreamReader()
            reader.feed_data(pack_frame(state_fetch_header(RUN, SENDER, ["w"], snap.state_hash)))
            reader.feed_eof()
            writer = FakeWriter()
            await asyncio.wait_for(h.server._serve(server.service(), SENDER, reader, writer), 30)
            n = HEADER_LEN.unpack_from(writer.buf, 0)[0]
            head = msgpack.unpackb(bytes(writer.buf[HEADER_LEN.size : HEADER_LEN.size + n]), raw=False)
            return head, bytes(writer.buf[HEADER_LEN.size + n + PART_LEN.size :])

        server.snapshot = states[0]
        server.snapshot = states[1]  # the round moved on while the joiner fetched states[0]'s manifest
        head, data = await fetch(states[0])
        assert ErrorCode(head["status"]) == ErrorCode.OK
        assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(3, 2), states[0].tensors["w"])
        server.snapshot = states[2]
        head, _ = await fetch(states[0])
        assert ErrorCode(head["status"]) == ErrorCode.NOT_READY and h.fault_log == []

    run(body())


def test_state_fetch_spends_at_most_a_few_copies_of_the_state_on_one_requester(pool):
    """One requester may fetch FETCH_COPIES copies of the state per FETCH_WINDOW_S (a clock injected): the next
    fetch is NOT_READY (not a fault) saying when to ask again, another requester is served meanwhile, and the
    budget comes back as the window slides."""
    from locomm.peer.transport.state_sync import FETCH_COPIES, FETCH_WINDOW_S, Snapshot, StateServer
    from locomm.protocol.state_messages import state_fetch_header

    async def body():
        h = Harness(pool)
        t = [1000.0]
        server = StateServer(RUN, clock=lambda: t[0])
        server.snapshot = snap = Snapshot.take(0, {"w": torch.ones(4, 4), "b": torch.ones(4)})

        async def fetch(sender: str, names: list[str]) -> ErrorCode:
            reader = asyncio.StreamReader()
            reader.feed_data(pack_frame(state_fetch_header(RUN, sender, names, snap.state_hash)))
            reader.feed_eof()
            writer = FakeWriter()
            await asyncio.wait_for(h.server._serve(server.service(), sender, reader, writer), 30)
            n = HEADER_LEN.unpack_from(writer.buf, 0)[0]
            return ErrorCode(msgpack.unpackb(bytes(writer.buf[HEADER_LEN.size : HEADER_LEN.size + n]))["status"])

        for _ in range(FETCH_COPIES):  # whole copies, in two batches each
            assert await fetch(SENDER, ["w"]) == ErrorCode.OK and await fetch(SENDER, ["b"]) == ErrorCode.OK
            t[0] += 10
        assert await fetch(SENDER, ["b"]) == ErrorCode.NOT_READY and server.refused_budget == 1
        assert await fetch("QmOtherPeer", ["w", "b"]) == ErrorCode.OK  # the budget is per requester
        t[0] += FETCH_WINDOW_S - 10  # the first copy left the window
        assert await fetch(SENDER, ["w", "b"]) == ErrorCode.OK
        t[0] += FETCH_WINDOW_S + 1  # everything left it: nothing is held for requesters that stopped asking
        assert await fetch(SENDER, ["b"]) == ErrorCode.OK and set(server._sent) == {SENDER}
        assert h.fault_log == []

    run(body())


def test_our_payloads_encodes_wait_behind_a_few_decodes_not_every_part_our_partners_sent():
    """Partners' parts decode in the codec pool as they arrive; our own payload's parts encode in the same pool
    (``Outgoing``). With 20 decodes waiting when our round ends, the first encode starts third (after the two
    decodes running on the pool's two threads), not 21st: on the main before, every decode had been submitted to
    the pool as its part came, and round 0's first part went out 11-17 s late (docs/results/links.md)."""
    import threading

    from locomm.peer.transport.transfers import Outgoing

    started: list[str] = []
    gate = threading.Event()

    def decode(i: int) -> None:
        started.append(f"decode {i}")
        gate.wait(10)

    async def body() -> None:
        pool = ThreadPoolExecutor(2)  # the host's codec pool
        try:
            server = RpcServer(None, RUN, LIMITS, pool)  # type: ignore[arg-type]
            decodes = [asyncio.ensure_future(server.decode(decode, i)) for i in range(20)]
            await asyncio.sleep(0)  # every decode asked for the pool before our round ends
            codec = make_codec()
            real = codec.encode_part

            def encode(payload, part):  # noqa: ANN001
                started.append("encode")
                return real(payload, part)

            codec.encode_part = encode  # type: ignore[method-assign]
            out = Outgoing(0, make_payload(codec), codec, server, [SENDER])
            gate.set()
            assert await out.get(0)
            await asyncio.gather(*decodes)
        finally:
            pool.shutdown()
        assert started.index("encode") == 2, started[:5]
        assert len(started) == 20 + len(out.parts)

    asyncio.run(body())


def test_a_ban_ends_and_each_later_one_lasts_twice_as_long():
    """A ban is for a while, not for good (chaos seed 15: two honest peers whose links were faulted were banned
    as promise breakers and never exchanged with again). The faults since the last ban count toward the next."""
    from locomm.peer.transport.transfers import BAN_MAX_S

    now = [0.0]
    told: list[tuple[str, float, int]] = []
    f = Faults(3, clock=lambda: now[0], ban_s=100.0, on_ban=lambda *a: told.append(a))
    for _ in range(3):
        f.record("QmP", "broke a promise")
    assert f.banned == {"QmP"} and f.count["QmP"] == 3
    assert told == [("QmP", 100.0, 3)]  # the host writes it as a "banned" event
    now[0] = 99.9
    assert "QmP" in f.banned
    now[0] = 100.0
    assert not f.banned  # lifted
    f.record("QmP", "again")
    f.record("QmP", "again")
    assert not f.banned  # 2 faults since the ban: not yet
    f.record("QmP", "again")
    assert f.banned == {"QmP"} and f.bans["QmP"] == 2 and told[-1] == ("QmP", 200.0, 6)
    now[0] = 100.0 + 199.9
    assert f.banned == {"QmP"}  # twice as long
    now[0] = 300.0
    assert not f.banned and f.total == 6
    for _ in range(40 * 3):
        f.record("QmP", "liar")
        now[0] += 1.0
    span = f._until["QmP"] - now[0] + 1.0
    assert span <= BAN_MAX_S  # doubling stops at a day
    now[0] += 2 * BAN_MAX_S  # a day with no ban: the next one is short again
    assert not f.is_banned("QmP")
    for _ in range(3):
        f.record("QmP", "flaky")
    assert f.is_banned("QmP") and f._until["QmP"] - now[0] == 100.0
