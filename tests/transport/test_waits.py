"""Every wait has an owner and an end: the push/pull decision of ``Gossip.exchange`` between real Gossip
services over in-memory streams, on virtual time.

Two or three peers, each a real ``RpcServer`` + ``Gossip`` on a fake p2p whose streams are byte pipes with a
rate (``FakeNet``). A test cuts one direction of one stream (its bytes stop: both ends' links cut it by their
stall rule, as a stalled TCP flow is cut), or makes a peer leave mid-push, and asserts the exact virtual
instants: when the receiver has the payload, when it stops waiting, how long the sender serves.

On the main before this file, a cut push left its receiver waiting for the sender's ETA (here 300 s) before it
pulled, a partner that left mid-push was waited for to its ETA and pulled in vain until its deadline, and a
transfer that kept moving was waited for past any deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from locomm.compression.payload import MIN_PART_ELEMS, PayloadCodec
from locomm.peer.transport.gossip import Faults, Gossip
from locomm.peer.transport.rpc import Limits, RpcServer
from locomm.protocol.membership import Heartbeat, sends_nothing_more
from locomm.protocol.timing import PULL_RETRY_S, TURN_SLACK, PartnerWait, give_up_at, push_order, serve_until
from locomm.testing.clock import run

pytestmark = pytest.mark.timeout(120)

RUN = "waitsrun0123456789"
SHAPES = {"a": (40_000,), "b": (5, 7)}
RATE = 1e6  # bytes/s of every fake stream
LIMITS = Limits(request_timeout_s=10.0, stall_timeout_s=10.0, min_rate_Bps=0.0, rate_window_s=30.0, max_wait_s=600)
ETA_S = 300.0
"""Every partner's ETA in these tests: long, as a loaded partner's on a slow link is."""


# ------------------------------------------------------------------------------ fakes


SLICE = 16 << 10
"""Bytes a pipe delivers at once (a slow pipe trickles: it is moving, never stalled)."""


class Pipe:
    """One direction of a stream: bytes written at one end arrive at ``rate`` in the reader at the other, until
    ``cut_after`` bytes (then nothing more moves: a stalled flow); closing the writer ends the reader."""

    def __init__(self, reader: asyncio.StreamReader, rate: float, cut_after: float = math.inf) -> None:
        self.reader, self.rate, self.left, self.closed = reader, rate, cut_after, False


class FakeWriter:
    def __init__(self, pipe: Pipe, back: Pipe) -> None:
        self.pipe, self.back, self.pending = pipe, back, bytearray()

    def write(self, data) -> None:
        if self.pipe.closed or self.back.closed and self.back.reader.at_eof():
            raise ConnectionResetError("stream closed")
        self.pending += bytes(data)

    async def drain(self) -> None:
        data, self.pending = bytes(self.pending), bytearray()
        if not data:
            return
        pipe = self.pipe
        n = int(min(len(data), pipe.left))
        for off in range(0, n, SLICE):
            piece = data[off : min(n, off + SLICE)]
            await asyncio.sleep(len(piece) / pipe.rate)
            if pipe.closed:
                raise ConnectionResetError("stream closed")
            pipe.reader.feed_data(piece)
            pipe.left -= len(piece)
        if n < len(data):
            await asyncio.Event().wait()  # cut: the rest never goes out (the link's own deadline ends this)

    def close(self) -> None:
        if not self.pipe.closed:
            self.pipe.closed = True
            self.pipe.reader.feed_eof()

    def is_closing(self) -> bool:
        return self.pipe.closed


class Info:
    def __init__(self, peer: str) -> None:
        from hivemind.p2p import PeerID

        self.peer_id = PeerID.from_base58(peer)


class FakeP2P:
    def __init__(self, net: FakeNet, me: str) -> None:
        self.net, self.me, self.handlers = net, me, {}

    async def add_binary_stream_handler(self, name, handler) -> None:
        self.handlers[name] = handler

    async def call_binary_stream_handler(self, peer_id, name):
        to = peer_id.to_base58()
        self.net.dials.append((self.me, to))
        remote = self.net.nodes.get(to)
        if remote is None:
            raise ConnectionError(f"cannot dial {to}")
        if name not in remote.handlers:  # reached, and it runs no such service: p2pd's words
            raise RuntimeError(f"Connect failed. msg=failed to negotiate protocol: protocols not supported: [{name}]")
        self.net.opened.append((self.me, to))
        self.net.opened_at.append((self.me, to, asyncio.get_running_loop().time()))
        cut = self.net.cuts.pop((self.me, to), math.inf)
        there, here = asyncio.StreamReader(), asyncio.StreamReader()
        fwd, back = Pipe(there, self.net.rate, cut), Pipe(here, self.net.rate)
        self.net.pipes.append((self.me, to, fwd))
        task = asyncio.ensure_future(remote.handlers[name](Info(self.me), there, FakeWriter(back, fwd)))
        self.net.tasks.add(task)
        task.add_done_callback(self.net.tasks.discard)
        return Info(to), here, FakeWriter(fwd, back)


class FakeNet:
    def __init__(self, rate: float = RATE) -> None:
        self.rate = rate
        self.nodes: dict[str, FakeP2P] = {}
        self.cuts: dict[tuple[str, str], float] = {}
        """(from, to) -> the next stream opened from -> to moves this many bytes forward, then stalls."""
        self.dials: list[tuple[str, str]] = []
        """(from, to) of every stream asked for, opened or not."""
        self.opened: list[tuple[str, str]] = []
        self.opened_at: list[tuple[str, str, float]] = []
        self.pipes: list[tuple[str, str, Pipe]] = []
        self.tasks: set[asyncio.Future] = set()

    def leave(self, peer: str) -> None:
        """The peer's process is gone: nobody can dial it, and its open streams end."""
        self.nodes.pop(peer, None)
        for a, b, pipe in self.pipes:
            if peer in (a, b) and not pipe.closed:
                pipe.closed = True
                pipe.reader.feed_eof()


def codec() -> PayloadCodec:
    return PayloadCodec(SHAPES, {"theta": "parameter"}, {"parameter": "lossless"}, part_elems=MIN_PART_ELEMS)


def payload(c: PayloadCodec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in c.tensors}


async def peer(net: FakeNet, me: str, pool, limits: Limits = LIMITS) -> Gossip:
    p2p = net.nodes[me] = FakeP2P(net, me)
    server = RpcServer(p2p, RUN, limits, pool, clock=asyncio.get_running_loop().time)
    g = Gossip(
        p2p,
        server,
        run_id=RUN,
        me=me,
        codec=codec(),
        limits=limits,
        faults=Faults(3),
        max_body_bytes=1 << 26,
        streams=1,
        max_wait_s=limits.max_wait_s,
    )
    await server.add(g.service())
    return g


def now() -> float:
    return asyncio.get_running_loop().time()


def eta_in(s: float):
    t = now() + s
    return lambda _peer: t


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(2) as ex:
        yield ex


A, B, C = "QmPeerA", "QmPeerB", "QmPeerC"
WIRE = sum(codec().max_part_bytes(p) for p in codec().parts())  # at most what one payload puts on the wire
ONE_PAYLOAD_S = WIRE / RATE


async def exchange(g: Gossip, r: int, peers: list[str], seed: int, eta_s: float = ETA_S):
    t0 = now()
    got = await g.exchange(r, peers, payload(g.codec, seed), eta=eta_in(eta_s))
    return got, now() - t0


async def serve_then_leave(net: FakeNet, g: Gossip, last: int, serve_s: float) -> float:
    """A leaving peer as ``Presence.leave`` does it: serve round ``last``'s payload until every partner has it
    or its serve deadline, then go; returns when it went."""
    out = g.outgoing[last]
    while g.undelivered(last) and now() < min(out.serve_until, now() + serve_s):
        await asyncio.sleep(0.25)
    net.leave(g.me)
    return now()


# ------------------------------------------------------------------------------ the rule, sans IO


def test_the_wait_rule_pulls_at_once_when_a_push_broke_and_never_waits_past_the_deadline():
    w = PartnerWait(due=300.0, give_up=500.0)
    assert w.decide(5.0, moving=True) == "wait"
    assert w.decide(5.0, moving=False) == "wait"  # nothing broke and the ETA is far: the push may still come
    w.broken = True
    assert w.decide(5.0, moving=False) == "pull"
    w.last_pull, w.pulling = 5.0, True
    assert w.decide(6.0, moving=False) == "wait"
    w.pulling = False  # that pull failed: try again, PULL_RETRY_S apart
    assert w.decide(5.0 + PULL_RETRY_S - 0.01, moving=False) == "wait"
    assert w.decide(5.0 + PULL_RETRY_S, moving=False) == "pull"
    assert w.next_change(6.0) == 5.0 + PULL_RETRY_S
    assert w.decide(500.0, moving=True) == "give up"  # moving or not: the round deadline ends it
    w.ended = "gone"
    assert w.decide(10.0, moving=True) == "drop"
    hinted = PartnerWait(due=300.0, give_up=500.0, hinted=True)
    assert hinted.decide(0.0, moving=False) == "pull"
    late = PartnerWait(due=300.0, give_up=500.0)
    assert late.decide(300.0, moving=False) == "pull"  # overdue, nothing here: one pull
    late.last_pull = 300.0
    assert late.decide(300.1, moving=False) == "give up"  # it failed: the round goes on (a dead partner)
    assert late.decide(300.1, moving=True) == "wait"  # unless something of it moves


def test_the_round_deadline_and_the_serve_deadline():
    lim = Limits(request_timeout_s=30.0, min_rate_Bps=1e6, max_wait_s=600.0)
    assert give_up_at(100.0, 150.0, 50e6, lim) == 150.0 + 30.0 + 50.0  # a transfer begun by the ETA, at the floor
    assert give_up_at(100.0, 650.0, 50e6, lim) == 700.0  # never past max_wait_s
    assert serve_until(100.0, lim) == 700.0  # a sender serves no longer than any receiver waits


# ------------------------------------------------------------------------------ the exchange, on fake streams


def test_a_push_cut_at_the_last_round_is_pulled_at_once_and_the_sender_serves_no_longer(pool):
    """The measured case: C's push to B is cut in the last round, C has B's payload and leaves, serving its own
    until B has it. B pulls as soon as the cut push ends (a stall timeout after its bytes stopped), not at C's
    ETA, and C goes as soon as B has it."""

    async def body():
        net = FakeNet()
        b, c = await peer(net, B, pool), await peer(net, C, pool)
        net.cuts[(C, B)] = WIRE // 3
        (got_b, dt_b), (got_c, dt_c) = await asyncio.gather(exchange(b, 0, [C], 1), exchange(c, 0, [B], 2))
        assert set(got_c) == {B} and set(got_b) == {C}
        for k, v in payload(c.codec, 2).items():
            assert torch.equal(got_b[C][k], v), k
        # the push's bytes stopped at ONE_PAYLOAD_S / 3; B's link cut it a stall timeout later; then one pull
        assert b.stats.pulls == 1 and b.stats.gave_up == 0
        assert dt_b < ONE_PAYLOAD_S / 3 + LIMITS.stall_timeout_s + 2 * ONE_PAYLOAD_S + 1.0, dt_b
        assert not c.undelivered(0)  # the pull delivered it: a leaving C goes at once
        went = await serve_then_leave(net, c, 0, 600.0)
        assert went - now() < 1.0

    run(body())


def test_a_cut_push_mid_run_is_pulled_and_the_next_round_goes_on(pool):
    async def body():
        net = FakeNet()
        a, b, c = await peer(net, A, pool), await peer(net, B, pool), await peer(net, C, pool)
        net.cuts[(A, C)] = 1000
        ends = []
        for r in range(3):
            for g in (a, b, c):
                g.advance(r)
            res = await asyncio.gather(*(exchange(g, r, [p for p in (A, B, C) if p != g.me], r) for g in (a, b, c)))
            assert all(len(got) == 2 for got, _ in res), r
            ends.append(max(dt for _, dt in res))
        assert c.stats.pulls == 1 and sum(g.stats.gave_up for g in (a, b, c)) == 0
        assert ends[0] < 1000 / RATE + LIMITS.stall_timeout_s + 4 * ONE_PAYLOAD_S + 1.0, ends
        assert ends[1] < 4 * ONE_PAYLOAD_S + 1.0 and ends[2] < 4 * ONE_PAYLOAD_S + 1.0, ends

    run(body())


def test_both_sides_cut_both_pull(pool):
    async def body():
        net = FakeNet()
        b, c = await peer(net, B, pool), await peer(net, C, pool)
        net.cuts[(C, B)] = 5000
        net.cuts[(B, C)] = 7000
        (got_b, dt_b), (got_c, dt_c) = await asyncio.gather(exchange(b, 0, [C], 1), exchange(c, 0, [B], 2))
        assert set(got_b) == {C} and set(got_c) == {B}
        assert b.stats.pulls == 1 and c.stats.pulls == 1
        bound = 7000 / RATE + LIMITS.stall_timeout_s + 2 * ONE_PAYLOAD_S + 1.0
        assert dt_b < bound and dt_c < bound, (dt_b, dt_c)

    run(body())


def test_a_partner_that_leaves_mid_push_serving_nothing_is_not_waited_for(pool):
    """C's process goes mid-push; its goodbye (finished, round 1: it had planned round 0) lists no round it
    serves. B stops waiting for it at the goodbye, not at C's ETA, and pulls nothing in vain. (On the main
    before this, a goodbye at round 1 did not end a wait for round 0: B waited for the ETA, then pulled a
    peer that was gone until its deadline.)"""

    async def body():
        net = FakeNet()
        b, c = await peer(net, B, pool), await peer(net, C, pool)
        net.cuts[(C, B)] = WIRE // 2
        beats: dict[str, Heartbeat] = {}  # what B last read of C
        b.gone = lambda p, r: p in beats and sends_nothing_more(beats[p], r)
        b.serves = lambda p, r: p in beats and r in beats[p].serves
        c_ex = asyncio.ensure_future(exchange(c, 0, [B], 2))

        async def c_leaves() -> float:
            await asyncio.sleep(ONE_PAYLOAD_S / 4)
            c_ex.cancel()
            net.leave(C)
            beats[C] = Heartbeat(peer=C, round=1, finished=True, serves=())
            return now()

        t0 = now()
        (got_b, dt_b), left = await asyncio.gather(exchange(b, 0, [C], 1), c_leaves())
        assert got_b == {} and b.stats.gone_skipped == 1 and b.stats.gave_up == 0 and b.stats.pulls == 0
        assert t0 + dt_b - left <= 0.5 + 1e-6, (dt_b, left)

    run(body())


def test_a_goodbye_that_still_serves_a_round_is_pulled(pool):
    """A leaving peer whose push failed lists the round in ``serves`` while it hands over: its partner pulls
    it at once (it does not take the leaving as "nothing will come", nor wait for the ETA)."""

    async def body():
        net = FakeNet()
        b, c = await peer(net, B, pool), await peer(net, C, pool)
        net.cuts[(C, B)] = 0  # its header never arrives: B sees no push at all
        beats: dict[str, Heartbeat] = {}
        b.gone = lambda p, r: p in beats and sends_nothing_more(beats[p], r)
        b.serves = lambda p, r: p in beats and r in beats[p].serves
        c.on_serving = lambda: beats.__setitem__(C, Heartbeat(peer=C, round=1, paused=True, serves=tuple(c.serving())))
        (got_b, dt_b), (got_c, _) = await asyncio.gather(exchange(b, 0, [C], 1), exchange(c, 0, [B], 2))
        assert set(got_b) == {C} and set(got_c) == {B} and b.stats.pulls == 1
        assert dt_b < LIMITS.request_timeout_s + LIMITS.stall_timeout_s + 2 * ONE_PAYLOAD_S + 1.0, dt_b
        assert c.serving() == []  # B has it: nothing served any more

    run(body())


def test_a_moving_transfer_is_not_waited_for_past_the_round_deadline(pool):
    """A partner whose payload trickles in (moving, never stalled) is given up at the round deadline."""

    async def body():
        net = FakeNet()
        net.rate = 2000.0  # ~80 s for the payload: longer than the 20 s any wait may last
        slow = Limits(**{**LIMITS.__dict__, "max_wait_s": 20.0})
        b, c = await peer(net, B, pool, slow), await peer(net, C, pool, slow)
        t0 = now()
        (got_b, dt_b), _ = await asyncio.gather(
            exchange(b, 0, [C], 1, eta_s=5.0), asyncio.wait_for(exchange(c, 0, [B], 2, eta_s=5.0), 30)
        )
        assert got_b == {} and b.stats.gave_up == 1
        assert dt_b <= 20.0 + 0.5 + 1e-6, dt_b
        assert now() - t0 < 30.0

    run(body())


def test_a_partner_two_rounds_ahead_is_not_waited_for_unless_it_serves_the_round(pool):
    """B is two rounds behind C. C's heartbeat (round 2) lists no round 0 in ``serves``: its exchange of round 0
    is over, nothing of it will come, and B goes on at once, pulling nothing. When C does list it (its push to
    B failed and it still serves it), B pulls it at once. (Before, B waited for C's ETA every round, then pulled a
    payload C no longer served: two pipeline replicas a round or two apart each waited out every round's deadline
    and the swarm crawled at 30 s a round, CI's 411 s pipeline test.)"""

    async def body():
        net = FakeNet()
        b, c = await peer(net, B, pool), await peer(net, C, pool)
        beats = {C: Heartbeat(peer=C, round=2, serves=())}
        b.gone = lambda p, r: p in beats and sends_nothing_more(beats[p], r)
        b.serves = lambda p, r: p in beats and r in beats[p].serves
        got, dt = await exchange(b, 0, [C], 1, eta_s=10.0)
        assert got == {} and b.stats.gone_skipped == 1 and b.stats.pulls == 0 and b.stats.gave_up == 0
        assert dt <= 0.5 + 1e-6, dt

        net.cuts[(C, B)] = 0  # C's push of round 1 never reaches B: C serves it to a puller
        c.on_serving = lambda: beats.__setitem__(C, Heartbeat(peer=C, round=3, serves=tuple(c.serving())))
        (got_b, dt_b), _ = await asyncio.gather(exchange(b, 1, [C], 3, eta_s=10.0), exchange(c, 1, [B], 4))
        assert set(got_b) == {C} and b.stats.pulls == 1, (got_b, b.stats.pulls)
        assert dt_b < LIMITS.request_timeout_s + LIMITS.stall_timeout_s + 2 * ONE_PAYLOAD_S + 1.0, dt_b

    run(body())


def test_broken_promises_in_a_row_are_a_fault_and_anything_moving_resets_them():
    from locomm.protocol.timing import BROKEN_PROMISES, Promises

    p = Promises()
    nothing = PartnerWait(due=1.0, give_up=2.0)
    assert [p.settle("x", nothing, False) for _ in range(BROKEN_PROMISES)] == [False] * (BROKEN_PROMISES - 1) + [True]
    assert not p.settle("x", nothing, False)  # the count starts again
    slow = PartnerWait(due=1.0, give_up=2.0, moved=True)  # a fair share of a busy link: late, moving
    for _ in range(BROKEN_PROMISES - 2):
        assert not p.settle("x", nothing, False)
    assert not p.settle("x", slow, False) and "x" not in p.broken
    for why in ("refused", "gone"):  # other groups than ours, or it left: no promise was made
        assert not any(p.settle("y", PartnerWait(due=1.0, give_up=2.0, ended=why), False) for _ in range(9))
    for _ in range(BROKEN_PROMISES - 1):
        p.settle("z", nothing, False)
    assert not p.settle("z", nothing, True)  # delivered: reset


def test_a_partner_that_answers_but_never_sends_is_a_fault_every_few_rounds(pool):
    """C is alive (its gossip service answers, it takes B's pushes) and in B's plan, and never exchanges: every
    round B pulls at C's ETA, is answered "not served", and goes on. After BROKEN_PROMISES such rounds, a fault
    (three faults ban C: then B skips it without waiting). A partner whose payload moves, slowly, is never one."""
    from locomm.protocol.timing import BROKEN_PROMISES

    async def body():
        net = FakeNet()
        b, c = await peer(net, B, pool), await peer(net, C, pool)
        for r in range(BROKEN_PROMISES * 3):
            got, dt = await exchange(b, r, [C], r, eta_s=5.0)
            assert got == {} and dt < 5.0 + PULL_RETRY_S + 1.0, (r, dt)
            b.advance(r + 1)
            c.advance(r + 1)  # it keeps up (and takes our pushes), it just never sends
        assert b.faults.count[C] == 3 and C in b.faults.banned and b.stats.broken_promises == 3
        got, dt = await exchange(b, BROKEN_PROMISES * 3, [C], 0, eta_s=5.0)
        assert got == {} and dt < 0.5  # banned: not waited for

        slow = FakeNet(rate=RATE / 20)  # a partner whose payload is moving, late: given up on, never a fault
        b2, c2 = await peer(slow, B, pool), await peer(slow, C, pool)
        for r in range(BROKEN_PROMISES + 1):
            await asyncio.gather(exchange(b2, r, [C], r, eta_s=1.0), exchange(c2, r, [B], r + 100, eta_s=1.0))
            b2.advance(r + 1)
            c2.advance(r + 1)
        assert b2.faults.total == 0 and b2.stats.broken_promises == 0

    run(body())


def test_a_live_partner_that_serves_no_exchange_is_not_waited_for_and_breaks_its_promises(pool):
    """C is reached (its p2pd answers, as a live Sybil's does: it answers hellos, so it counts as a member) and
    runs no exchange service at all: our push to it fails "protocols not supported" at once. B stops waiting for
    it then, not at its ETA (measured with live Sybils on loopback, `benchmarks/ghosts.py --live`: each such
    partner cost its ETA, 84% of the honest peers' time, and was never a fault, since it counted as
    unreachable). A member of the round that runs no exchange of the run is a fault each round it is planned
    (three ban it), and a leaving B serves it nothing. An unreachable partner (gone) stays no fault."""
    from locomm.protocol.timing import BROKEN_PROMISES

    async def body():
        net = FakeNet()
        b = await peer(net, B, pool)
        net.nodes[C] = FakeP2P(net, C)  # alive, no gossip service
        for r in range(3):
            got, dt = await exchange(b, r, [C], r, eta_s=ETA_S)
            assert got == {} and dt < 1.0, (r, dt)  # not its ETA (300 s)
            assert not b.undelivered(r)  # and a leaving B serves it nothing (it runs no exchange: it never pulls)
            assert b.faults.count[C] == r + 1
            b.advance(r + 1)
        assert C in b.faults.banned and b.stats.unreachable == 0
        assert (B, C) in net.dials
        dialled = len(net.dials)
        got, dt = await exchange(b, 3, [C], 3, eta_s=ETA_S)
        assert got == {} and dt < 0.5 and len(net.dials) == dialled  # banned: skipped, not even dialled

        gone = FakeNet()
        b2 = await peer(gone, B, pool)  # C has no p2pd at all: unreachable, a dead partner costs its ETA
        for r in range(BROKEN_PROMISES):
            got, dt = await exchange(b2, r, [C], r, eta_s=5.0)
            assert got == {} and 5.0 <= dt < 5.0 + 1.0, (r, dt)
            b2.advance(r + 1)
        assert b2.faults.total == 0 and b2.stats.unreachable == BROKEN_PROMISES

    run(body())


# ------------------------------------------------------------------------------ pushes in turn


def test_the_push_order_is_a_shift_on_the_ring_so_each_receiver_takes_one_flow_at_a_time():
    ring = [A, B, C, "QmPeerD"]
    orders = {me: push_order(me, [p for p in ring if p != me]) for me in ring}
    assert orders[A] == [B, C, "QmPeerD"] and orders[C] == ["QmPeerD", A, B]
    for k in range(3):  # at the k-th push, every receiver is some one sender's target
        assert sorted(o[k] for o in orders.values()) == sorted(ring)


def test_pushes_go_in_turn_and_a_stalled_one_holds_the_link_one_turn_at_most(pool):
    """With an upload rate measured, a peer's pushes go one at a time in ring order: the next one starts when
    the one before it ended, or ``TURN_SLACK`` payload-times after it began if it is still going (a stalled or
    slow partner never holds the others' payloads back for longer). On the main before, every push started at
    once (through one uplink, three peers' crossing flows moved at 58-65 Mbit/s of 77.5)."""

    async def body():
        net = FakeNet()
        gs = [await peer(net, p, pool) for p in (A, B, C)]
        for g in gs:
            g.stats.up_Bps = RATE  # measured before: one payload takes ONE_PAYLOAD_S alone
        await asyncio.gather(*(exchange(g, 0, [p for p in (A, B, C) if p != g.me], k) for k, g in enumerate(gs)))
        dials = {me: [(to, t) for m, to, t in net.opened_at if m == me] for me in (A, B, C)}
        assert [to for to, _ in dials[A]] == [B, C] and [to for to, _ in dials[B]] == [C, A], dials
        for g in gs:
            (_, t1), (_, t2) = dials[g.me]
            one = g.stats.bytes_sent / 2 / RATE  # one push's time on its stream
            assert one * 0.95 <= t2 - t1 < TURN_SLACK * ONE_PAYLOAD_S, (g.me, t2 - t1)  # it waited for the first

        net = FakeNet()
        a, b, c = [await peer(net, p, pool) for p in (A, B, C)]
        a.stats.up_Bps = RATE
        net.cuts[(A, B)] = WIRE // 3  # A's first push stalls a third of the way
        got = await asyncio.gather(exchange(a, 1, [B, C], 1), exchange(b, 1, [A, C], 2), exchange(c, 1, [A, B], 3))
        (_, t_b), (_, t_c) = [(to, t) for m, to, t in net.opened_at if m == A][:2]
        assert abs((t_c - t_b) - TURN_SLACK * ONE_PAYLOAD_S) < 0.05, t_c - t_b  # not the stall's 10 s
        assert set(got[1][0]) == {A, C} and set(got[2][0]) == {A, B}  # B pulled the rest of A's payload

    run(body())


def test_an_exchange_cancelled_while_its_own_push_runs_leaves_no_unretrieved_error(pool, caplog):
    """A leaving peer's exchange is cancelled (``presence.finish_or_stop``) while it waits for its own push. That
    wait was ``wait_for(gather(pushes))``: cancelled, wait_for cancels the gather and never retrieves its
    CancelledError, and each one printed "_GatheringFuture exception was never retrieved" with a traceback on the
    leaving peer's stderr (benchmarks/chaos.py seed 12)."""
    caplog.set_level(logging.ERROR, logger="asyncio")

    async def body():
        net = FakeNet()
        b, c = await peer(net, B, pool), await peer(net, C, pool)
        net.cuts[(C, B)] = WIRE // 2  # C's push stalls; B's to C arrives
        c_ex = asyncio.ensure_future(exchange(c, 0, [B], 2))
        b_ex = asyncio.ensure_future(exchange(b, 0, [C], 1))
        await asyncio.sleep(3 * ONE_PAYLOAD_S)  # C has B's payload and waits for its own push (cut at ~10 s)
        assert not c_ex.done() and c.stats.bytes_received > 0
        c_ex.cancel()
        with pytest.raises(asyncio.CancelledError):
            await c_ex
        b_ex.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await b_ex

    run(body())
    gc.collect()
    assert "never retrieved" not in caplog.text, caplog.text[-2000:]
