"""Outer-update exchanges: streamed, parallel pushes on the RPC base, a mailbox, pulls, faults and bans.

A round's exchange is symmetric push: each worker sends its payload to each of its round partners and waits
for theirs; the round goes on with whoever answered. No global barrier.

- **Streamed.** A payload is a list of parts (``compression/payload.py``). The sender encodes parts in the
  codec pool, once for all partners, and part k+1 is encoded while part k is on the wire; the receiver decodes
  each part in the pool as it arrives, into tensors it allocated once. Extra memory per payload: the encoded
  parts on the sender (at most the payload's size), the destination tensors plus two parts per stream on the
  receiver.
- **Parallel.** Above ``parallel_threshold_mb``, up to ``streams_per_transfer`` streams (p2pd's per-stream ceiling).
- **In turn.** A peer's pushes to its partners go one at a time, in ring order (``timing.push_order``: at its k-th
  push every member of a group sends to the member k places after it, so each link carries one flow), each
  starting when the one before it ended or ``TURN_SLACK`` payload-times after that one began.
- **Deadlines by bytes** (``rpc.Limits``): a stalled or trickling stream is cut off and answered ``TIMEOUT``;
  that is slowness, never a fault. Every "now" here (ETAs, stalls, links, rates) is ``clock()``, the RPC
  server's unless given.
- **Every wait has an owner and an end** (``protocol/timing.PartnerWait``, sans-IO). A receiver pulls a
  partner's payload as soon as it knows no push will bring it: the partner's push broke (cut, reset) with
  nothing of it moving, or the partner asks to be pulled (its push's answer, or ``serves(peer, round)``: its
  heartbeat says the payload is ready for that round), and otherwise once the partner's ETA (its heartbeat's
  round time and upload rate) has passed with nothing arriving. It gives up at the round deadline
  (``timing.give_up_at``), transfers moving or not, and at once when the partner refused our push, left
  without serving the round, or answers a pull with ``STALE_ROUND`` (no longer served).
- **Pull.** A peer that cannot be dialled (behind NAT) still pushes out; its partners answer its push with
  ``pull=True`` when they could not reach it, and it then pulls their payload on a stream it opens itself. A
  sender whose push was cut or refused serves the payload to pullers (``serving()``, for its heartbeat's
  ``serves``; ``on_serving`` is called when that changes) until ``timing.serve_until``, never longer.
- **Admission and memory.** ``admit(peer, round)``, when given, is asked before a push is read: a sender it
  refuses (not one of the round's partners) is answered ``UNAUTHORIZED``, a refusal, not a fault. At most
  ``max_payloads`` pushed payloads are held at once, being received or received and not yet taken by an
  exchange (``partners + 2`` once :meth:`Gossip.exchange` has seen a round's partners, unless the constructor
  fixed it); beyond it a push is answered ``NOT_READY`` before its buffer is allocated (its sender retries,
  then serves it for a pull). An exchange releases what it took; a payload that arrives for a round whose
  exchange is over is not kept. Pulls we start ourselves are not counted (we chose those partners).
- **Leaving.** ``gone(peer, round)``, when given, says a partner left before that round (its final heartbeat):
  the exchange stops waiting for it at once instead of at its deadline.
- **Faults** are protocol violations and bad payloads only (``FAULT_CODES``); repeated faults ban. Bans are
  local: a banned partner is skipped at exchange time, never removed from the round's membership (every peer
  must compute the same groups).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from hivemind.p2p import P2P

from locomm.compression.payload import Part, PayloadCodec, PayloadError
from locomm.peer.transport.rpc import Call, Clock, Limits, Link, RpcServer, Service, TransferCut, Unreachable, open_link
from locomm.peer.transport.transfers import EarlyReset as _EarlyReset
from locomm.peer.transport.transfers import (
    Faults,
    GossipStats,
    Incoming,
    Outgoing,
    balance_lanes,
    tally_lanes,
    timed,
)
from locomm.protocol.messages import (
    FAULT_CODES,
    ErrorCode,
    ProtocolViolation,
    Transfer,
    check_round,
    pull_header,
    push_header,
    transfer_fields,
    validate_transfer,
)
from locomm.protocol.rounds import RECEIVE_WINDOW  # payload buffers only for rounds this close to ours
from locomm.protocol.timing import PartnerWait, Promises, ema, give_up_at, push_order, serve_until, turn_s

__all__ = ["Faults", "Gossip", "GossipStats", "Incoming", "Outgoing"]

log = logging.getLogger(__name__)

ROUND_WINDOW = 4
"""Pushes for rounds more than this far from ours are refused (STALE_ROUND, not a fault)."""
MAX_SENDERS_PER_ROUND = 64
SPARE_PAYLOADS = 2
"""Payload buffers beyond the round's partners (a partner a round ahead, a retry overlapping its old stream)."""
PUSH_ATTEMPTS = 3


_PAYLOAD_CODES = {"shape": ErrorCode.BAD_SHAPE, "payload": ErrorCode.BAD_PAYLOAD, "finite": ErrorCode.NOT_FINITE}
_REFUSALS = {ErrorCode[n] for n in ("BANNED", "WRONG_RUN", "BAD_VERSION", "STALE_ROUND", "UNAUTHORIZED")}
"""Answers after which the partner will not send us its payload this round."""


class Gossip:
    """One node's side of the exchange protocol, as a service on the RPC base."""

    def __init__(
        self,
        p2p: P2P,
        server: RpcServer,
        *,
        run_id: str,
        me: str,
        codec: PayloadCodec,
        limits: Limits,
        faults: Faults,
        max_body_bytes: int,
        streams: int = 4,
        parallel_threshold: int = 16 << 20,
        max_wait_s: float = 600.0,
        clock: Clock | None = None,
        admit: Callable[[str, int], Awaitable[bool]] | None = None,
        max_payloads: int | None = None,
    ) -> None:
        self.p2p, self.server, self.run_id, self.me, self.codec = p2p, server, run_id, me, codec
        self.clock = clock or server.clock
        self.limits = limits
        self.faults = faults
        self.max_body_bytes = max_body_bytes
        self.streams, self.parallel_threshold, self.max_wait_s = streams, parallel_threshold, max_wait_s
        # Under a traffic cap, only as many pushes at once as each keeps the swarm's floor rate (shaper.py).
        self._gate = server.shaper.gate(limits.min_rate_Bps) if server.shaper else contextlib.nullcontext()
        self.handler = server.handler_name("gossip")
        self.mailbox: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
        self.incoming: dict[tuple[str, int], Incoming] = {}
        self.arrived = asyncio.Condition()
        self.current_round = 0
        self.outgoing: dict[int, Outgoing] = {}
        """Our encoded payloads of the last rounds, kept for partners that pull after we moved on."""
        self.unreachable: dict[int, set[str]] = defaultdict(set)
        self.pull_hints: dict[int, set[str]] = defaultdict(set)
        self.stats = GossipStats()
        self.promises = Promises()
        """Partners that keep promising payloads and sending none (a fault every ``BROKEN_PROMISES`` rounds)."""
        self._decode_part = timed(codec.decode_part, self.stats, "decode_s")
        self.admit = admit
        """(sender, round) -> may it push to us (the node's: one of that round's partners)."""
        self.gone: Callable[[str, int], bool] | None = None  # see "Leaving" above
        self.serves: Callable[[str, int], bool] | None = None
        """(partner, round) -> its heartbeat says it serves that round's payload to pullers (pull it now)."""
        self.on_serving: Callable[[], None] | None = None
        """Called when :meth:`serving` gains a round (the node publishes its heartbeat soon)."""
        self.leaving = False
        """Set by a leaving peer: :meth:`serving` lists every round some partner has not taken yet."""
        self.settled: set[int] = set()
        """Rounds whose exchange has returned: payloads of them that arrive later are not kept."""
        self.broken: dict[tuple[str, int], float] = {}
        """(sender, round) -> when a push of it broke (cut, reset) before the payload was complete."""
        self.fixed_max_payloads = max_payloads
        self.partners = 1
        """Partners of the last round we exchanged in (sizes the payload budget unless it is fixed)."""

    @property
    def max_payloads(self) -> int:
        """Pushed payloads received at once, at most (their buffers are allocated when the first part comes)."""
        return self.fixed_max_payloads or self.partners + SPARE_PAYLOADS

    def set_partners(self, n: int) -> None:
        """This round's number of partners (``exchange`` sets it; a node may say it earlier)."""
        self.partners = max(1, n)

    def held_payloads(self) -> int:
        """Pushed payloads we hold: being received, or received and not yet taken by :meth:`exchange` (a flood
        of finished payloads counts as much as one in flight)."""
        waiting = sum(v is not None for m in self.mailbox.values() for v in m.values())
        return waiting + sum(not i.pulled for i in self.incoming.values())

    @property
    def banned(self) -> frozenset[str]:
        return self.faults.banned

    def service(self) -> Service:
        return Service("gossip", {"push": self._on_push, "pull": self._on_pull}, policy="member")

    # -- receiving ---------------------------------------------------------------------

    def _open_incoming(self, remote: str, round_idx: int, t: Transfer, pulled: bool = False) -> Incoming:
        check_round(round_idx, self.current_round, ROUND_WINDOW, RECEIVE_WINDOW)
        if remote in self.mailbox.get(round_idx, {}):
            raise ProtocolViolation(ErrorCode.NOT_READY, "already received this round's payload")
        senders = {s for (s, r) in self.incoming if r == round_idx} | set(self.mailbox.get(round_idx, {}))
        if len(senders) >= MAX_SENDERS_PER_ROUND and remote not in senders:
            raise ProtocolViolation(ErrorCode.NOT_READY, "mailbox full for this round")
        key = (remote, round_idx)
        inc = self.incoming.get(key)
        if inc is not None and inc.xfer != t.xfer:
            if pulled and not inc.pulled and not inc.active:
                inc = None  # the rest of a broken push comes whole by our pull
            elif self.clock() - inc.last_progress < self.limits.stall_timeout_s:
                raise ProtocolViolation(ErrorCode.NOT_READY, "another transfer of this payload is under way")
            inc = None  # an abandoned transfer: start over
        if inc is None:
            if not pulled and self.held_payloads() >= self.max_payloads:
                raise ProtocolViolation(ErrorCode.NOT_READY, f"holding {self.max_payloads} payloads already")
            inc = Incoming(t.xfer, self.codec.allocate(t.enc), set(self.codec.parts(t.enc)), self.clock(), pulled)
            self.incoming[key] = inc
        if inc.claimed & set(t.parts):
            # Only the same transfer can overlap here (another xfer was refused or replaced above): a retry of
            # parts another stream carries. Wasteful, not hostile.
            raise ProtocolViolation(ErrorCode.NOT_READY, "a part is already on its way on another stream")
        inc.claimed |= set(t.parts)
        return inc

    async def _receive(self, remote: str, round_idx: int, t: Transfer, link: Link, pulled: bool = False) -> bool:
        """Read and decode a transfer's parts; True when the payload is now complete (and delivered)."""
        key = (remote, round_idx)
        inc = self._open_incoming(remote, round_idx, t, pulled)
        link.expect(t.max_bytes(self.codec), t.streams)
        pending: list[tuple[Part, asyncio.Future]] = []
        inc.active += 1
        try:
            for part in t.parts:
                data = await link.read_part(self.codec.max_part_bytes(part))
                self.stats.bytes_received += len(data)
                inc.last_progress = self.clock()
                inc.last_part_at = time.time()
                if inc.first_part_at is None:
                    inc.first_part_at = inc.last_part_at
                pending.append(
                    (part, asyncio.ensure_future(self.server.decode(self._decode_part, inc.dest, part, data)))
                )
                while len(pending) > 2:  # decode overlaps the wire; at most two parts held per stream
                    p, fut = pending.pop(0)
                    await fut
                    inc.done.add(p)
            for p, fut in pending:
                await fut
                inc.done.add(p)
        except PayloadError as e:
            for _, fut in pending:
                fut.cancel()
            self.incoming.pop(key, None)
            raise ProtocolViolation(_PAYLOAD_CODES[e.kind], str(e)) from None
        except BaseException:
            for _, fut in pending:
                fut.cancel()
            if self.incoming.get(key) is inc:
                inc.claimed -= set(t.parts) - inc.done  # another stream (or a pull) may bring them
                if not inc.claimed:
                    del self.incoming[key]  # nothing of it survives: the next transfer starts clean
            if not pulled:  # the receiver's wait pulls it once none of the push's streams is moving
                self.broken[key] = self.clock()
            raise
        finally:
            inc.active -= 1
        if not inc.complete:
            return False
        self.incoming.pop(key, None)
        try:
            payload = await self.server.decode(self.codec.finish, inc.dest)
        except PayloadError as e:
            raise ProtocolViolation(_PAYLOAD_CODES[e.kind], str(e)) from None
        timing = {"opened_at": inc.opened_at, "first_part_at": inc.first_part_at, "last_part_at": inc.last_part_at}
        await self.stats.paths.arrived(round_idx, remote, pulled, self.p2p, **timing)  # peer/transport/paths.py
        async with self.arrived:
            # A round whose exchange is over has no use for it (a pull that ended late): the key alone is kept.
            self.mailbox[round_idx][remote] = None if round_idx in self.settled else payload
            self.arrived.notify_all()
        return True

    async def _on_push(self, call: Call) -> None:
        if self.admit is not None and not await self.admit(call.remote, call.msg.round):
            raise ProtocolViolation(ErrorCode.UNAUTHORIZED, f"not a partner of round {call.msg.round}")
        t = validate_transfer(call.msg.fields, self.codec, self.max_body_bytes)
        if call.remote in self.mailbox.get(call.msg.round, {}):
            # We hold this payload already (we pulled it while this push was refused or retried): the push
            # achieved what it is for, so it is answered OK, not refused, and the sender stops retrying. ``held``
            # tells the sender that these bytes delivered nothing new (it counts them as undelivered).
            await call.answer(ErrorCode.OK, pull=False, held=True)
            await call.link.discard()
            return
        await self._receive(call.remote, call.msg.round, t, call.link)
        await call.answer(ErrorCode.OK, pull=call.remote in self.unreachable.get(call.msg.round, ()))

    async def _on_pull(self, call: Call) -> None:
        r = call.msg.round
        out = self.outgoing.get(r)
        dropped = out is None and r < self.current_round - 1
        expired = out is not None and call.remote in out.peers and self.clock() > out.serve_until
        if dropped or expired:
            raise ProtocolViolation(ErrorCode.STALE_ROUND, f"round {r}'s payload is no longer served")
        if out is None or call.remote not in out.peers:
            raise ProtocolViolation(ErrorCode.NOT_READY, f"no payload of round {r} for you")
        await call.answer(ErrorCode.OK, **transfer_fields(out.xfer ^ 1, 0, 1, out.enc, out.parts))
        call.link.meter.direction = "send"
        call.link.expect(sum(self.codec.max_part_bytes(p) for p in out.parts))
        for i in range(len(out.parts)):
            data = await out.get(i)
            await call.link.write_part(data)
            self.stats.bytes_sent += len(data)
        out.delivered.add(call.remote)

    # -- sending -----------------------------------------------------------------------

    def _stream_count(self, out: Outgoing) -> int:
        raw = sum(self.codec.max_part_bytes(p) for p in out.parts)
        return max(1, min(self.streams, len(out.parts), math.ceil(raw / self.parallel_threshold)))

    async def push(self, peer: str, out: Outgoing) -> ErrorCode | str:
        """Send our payload to one partner; an ErrorCode answer, or "not served" / "unreachable" / "cut". A refusal
        that can pass (the partner has not seen our heartbeat yet, or has not opened the round) is retried, a second
        apart."""
        outcome: ErrorCode | str = ErrorCode.OK
        pending = list(range(len(out.parts)))  # parts no stream has had an OK for yet
        for attempt in range(PUSH_ATTEMPTS):
            async with self._gate:
                outcome, delivered = await self._push_once(peer, out, pending)
            # Resend only what was refused: a stream answered OK holds its parts on the receiver already,
            # and sending them again under the same xfer is a duplicate claim (UNEXPECTED_TENSOR, a fault).
            pending = [i for i in pending if i not in delivered]
            retry = outcome in (ErrorCode.UNAUTHORIZED, ErrorCode.NOT_READY, "reset")
            if not retry or not pending or out.round < self.current_round - 1:
                break
            await asyncio.sleep(1.0 + attempt)
        if outcome == "reset":
            outcome = "cut"
        if outcome == ErrorCode.OK or outcome in _REFUSALS or outcome == "not served":
            out.delivered.add(peer)  # it has our payload, or will never take it (it runs no exchange: no pull)
        if outcome == ErrorCode.OK:
            self.stats.pushes_ok += 1
        else:
            self.stats.pushes_failed += 1
            if outcome == "unreachable":
                self.stats.unreachable += 1
                self.unreachable[out.round].add(peer)
            why = outcome if isinstance(outcome, str) else outcome.name
            log.info("push to %s for round %d: %s", peer[-8:], out.round, why)
            if peer not in out.delivered:  # it may pull it: say so in our heartbeat
                out.failed.add(peer)
                if self.on_serving is not None:
                    self.on_serving()
        return outcome

    async def _push_once(self, peer: str, out: Outgoing, which: list[int]) -> tuple[ErrorCode | str, set[int]]:
        """One attempt at sending parts ``which`` of ``out``; the outcome and the parts answered OK."""
        n = max(1, min(self._stream_count(out), len(which)))
        lanes = balance_lanes([(i, self.codec.max_part_bytes(out.parts[i])) for i in which], n)
        t0 = self.clock()
        by_lane: dict[int, list[int]] = {}  # bytes each stream put on the wire
        times: dict[str, float] = {"started_at": time.time()}  # wall-clock, for the ``push`` event

        async def lane(k: int, idx: list[int]) -> tuple[ErrorCode, bool, bool]:
            await out.get(idx[0])  # the receiver's header clock starts when we dial: have data ready first
            times.setdefault("dialed_at", time.time())
            link = await open_link(
                self.p2p, peer, self.handler, self.limits, "send", n, clock=self.clock, loads=self.server.loads
            )
            self.server.meters.append(link.meter)
            sent_here = by_lane[k] = [0]
            try:
                parts = [out.parts[i] for i in idx]
                await link.write_header(push_header(self.run_id, out.round, self.me, out.xfer, k, n, out.enc, parts))
                link.expect(sum(self.codec.max_part_bytes(p) for p in parts), n)
                try:
                    for i in idx:
                        data = await out.get(i)
                        await link.write_part(data)
                        sent_here[0] += len(data)
                        times.setdefault("first_part_at", time.time())
                        times["last_part_at"] = time.time()
                except (ConnectionError, TransferCut) as e:
                    # The receiver may have answered early (a refusal) and closed: read its answer if it did.
                    with contextlib.suppress(Exception):
                        code, resp = await asyncio.wait_for(link.read_answer(), 2.0)
                        return code, bool(resp.get("pull")), bool(resp.get("held"))
                    if isinstance(e, ConnectionError) and sent_here[0] == 0:
                        raise _EarlyReset(str(e)) from None
                    raise
                code, resp = await link.read_answer(extra_s=self.limits.request_timeout_s)
                return code, bool(resp.get("pull")), bool(resp.get("held"))
            finally:
                with contextlib.suppress(ValueError):
                    self.server.meters.remove(link.meter)
                link.writer.close()

        lanes = [idx for idx in lanes if idx]
        results = await asyncio.gather(*(lane(k, idx) for k, idx in enumerate(lanes)), return_exceptions=True)
        sent = sum(b[0] for b in by_lane.values())
        self.stats.bytes_sent += sent
        outcome, delivered, redundant, hinted = tally_lanes(peer, lanes, results)
        if self.stats.paths.sink is not None:  # where a push's time went: encode, dial, wire, the answer
            why = outcome if isinstance(outcome, str) else outcome.name
            self.stats.paths.sink("push", round=out.round, peer=peer, outcome=why, bytes=sent, **times)
        if hinted:
            self.pull_hints[out.round].add(peer)
        # What went out on streams that did not answer OK, or whose parts the receiver held already.
        self.stats.bytes_undelivered += sum(
            by_lane.get(k, [0])[0] for k, idx in enumerate(lanes) if k in redundant or not set(idx) <= delivered
        )
        if outcome == ErrorCode.OK:
            dt = max(1e-3, self.clock() - t0)
            rate = sent / dt
            self.stats.up_Bps = ema(self.stats.up_Bps, rate)
        return outcome, delivered

    def _pushes_in_turn(self, order: list[str], out: Outgoing, wire: int) -> dict[str, asyncio.Task]:
        """One task per partner, pushing in ``order``: each push starts when the one before it ended, or
        ``turn_s`` after that one started, whichever comes first (``turn_s``: ``TURN_SLACK`` x one payload at our
        measured upload rate; before a rate is measured, the request timeout: ``timing.turn_s``)."""
        hold_s = turn_s(wire, self.stats.up_Bps, self.limits)
        loop = asyncio.get_running_loop()

        async def in_turn(peer: str, before: asyncio.Event | None, released: asyncio.Event) -> ErrorCode | str:
            if before is not None:
                await before.wait()
            timer = loop.call_later(hold_s, released.set)
            try:
                return await self.push(peer, out)
            finally:
                timer.cancel()
                released.set()

        tasks: dict[str, asyncio.Task] = {}
        before: asyncio.Event | None = None
        for peer in order:
            released = asyncio.Event()
            tasks[peer] = asyncio.create_task(in_turn(peer, before, released))
            before = released
        return tasks

    async def pull(self, peer: str, round_idx: int) -> bool | None:
        """Fetch a partner's payload of ``round_idx`` over a stream we open: True when it arrived, None when the
        partner no longer serves it (``STALE_ROUND``: nothing will come), False when this try failed."""
        try:
            link = await open_link(
                self.p2p, peer, self.handler, self.limits, "recv", clock=self.clock, loads=self.server.loads
            )
        except Unreachable:
            return False
        self.server.meters.append(link.meter)
        try:
            await link.write_header(pull_header(self.run_id, round_idx, self.me))
            code, resp = await link.read_answer()
            if code != ErrorCode.OK:
                return None if code == ErrorCode.STALE_ROUND else False
            t = validate_transfer(resp, self.codec, self.max_body_bytes)
            self.stats.pulls += 1
            return await self._receive(peer, round_idx, t, link, pulled=True)
        except ProtocolViolation as v:
            if v.code in FAULT_CODES:
                self.faults.record(peer, f"pulled payload: {v.message}")
            return False
        except (TransferCut, ConnectionError, asyncio.IncompleteReadError) as e:
            log.info("pull from %s: %s", peer[-8:], e)
            return False
        finally:
            with contextlib.suppress(ValueError):
                self.server.meters.remove(link.meter)
            link.writer.close()

    # -- one round ---------------------------------------------------------------------

    async def exchange(
        self, round_idx: int, peers: list[str], payload: Mapping[str, Any], eta: Callable[[str], float] | None = None
    ) -> dict[str, Any]:
        """Push to every partner, then wait for theirs; returns {peer: payload} of who answered.

        ``eta(peer)`` is the time (in ``self.clock``'s terms) by which the partner's payload should have arrived.
        """
        peers = [p for p in peers if not self.faults.is_banned(p) and p != self.me]
        self.set_partners(len(peers))
        if not peers:
            return {}
        out = self.outgoing[round_idx] = Outgoing(round_idx, payload, self.codec, self.server, peers, self.stats)
        start = self.clock()
        out.serve_until = serve_until(start, self.limits)
        wire = sum(self.codec.max_part_bytes(part) for part in out.parts)  # a partner's payload is as large
        pushes = self._pushes_in_turn(push_order(self.me, peers), out, wire)
        waits: dict[str, PartnerWait] = {}
        for p in peers:
            due = min(eta(p) if eta else start + self.limits.request_timeout_s, start + self.max_wait_s)
            waits[p] = PartnerWait(due, min(give_up_at(start, due, wire, self.limits), start + self.max_wait_s))
        pulls: dict[str, asyncio.Task] = {}
        missing: set[str] = set(peers)
        try:
            while True:
                have = self.mailbox.get(round_idx, {})
                missing = {p for p in missing if p not in have}
                now = self.clock()
                for p in list(missing):
                    w = waits[p]
                    moving = self._observe(w, p, round_idx, pushes[p], pulls.get(p), now)
                    what = w.decide(now, moving=moving)
                    if what == "pull":
                        w.last_pull, w.pulling = now, True
                        pulls[p] = asyncio.create_task(self.pull(p, round_idx))
                    elif what == "drop":
                        missing.discard(p)
                    elif what == "give up":  # the round deadline: whatever is moving, no longer
                        missing.discard(p)
                        if p in pulls:
                            pulls[p].cancel()
                        self.stats.gave_up += 1
                        self.stats.gave_up_on.append((round_idx, p))
                if not missing:
                    break
                wake = min(waits[p].next_change(now) for p in missing)
                async with self.arrived:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.arrived.wait(), min(0.5, max(0.0, wake - now)))
            # Our own pushes end by their own deadlines (a link cuts them), never past the round's. (asyncio.wait,
            # not wait_for around a gather: on a timeout wait_for cancels the gather and never retrieves its
            # CancelledError, a "_GatheringFuture exception was never retrieved" traceback in chaos seed 12.)
            if pushes:
                await asyncio.wait(list(pushes.values()), timeout=max(0.0, out.serve_until - self.clock()))
        finally:  # every push and pull this exchange started is over when it returns
            tasks = [*pushes.values(), *pulls.values()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for p in peers:
                self.broken.pop((p, round_idx), None)
        box = self.mailbox.get(round_idx, {})
        got = {p: v for p, v in box.items() if p in set(peers) and v is not None}
        for p in box:  # taken (or never to be used): the key stays, so a late push of it is answered "held"
            box[p] = None
        self.settled.add(round_idx)
        self.stats.exchanges_ok += len(got)
        self.stats.exchanges_failed += len(peers) - len(got)
        for p in peers:  # one we cannot dial is gone or cut off from us, not lying: its heartbeat will say
            if waits[p].ended == "no exchange" and p not in got:  # a member of this round running none: a liar
                self.faults.record(p, f"round {round_idx}: announced as a member, runs no exchange of this run")
                continue
            if p not in self.unreachable.get(round_idx, ()) and self.promises.settle(p, waits[p], p in got):
                self.stats.broken_promises += 1
                self.faults.record(p, f"planned for {self.promises.limit} rounds in a row, sent nothing by its ETA")
        if got:
            self.stats.last_exchange = time.time()
        if missing := ", ".join(m[-8:] for m in set(peers) - set(got)):
            log.info("round %d: no payload from %s; going on with %d of %d", round_idx, missing, len(got), len(peers))
        return got

    def _observe(
        self, w: PartnerWait, p: str, round_idx: int, push: asyncio.Task, pull: asyncio.Task | None, now: float
    ) -> bool:
        """Bring partner ``p``'s wait up to date with what happened (our push's answer, our pull's, its push's
        streams, its heartbeat); whether a transfer of its payload to us is moving now."""
        pushed = push.result() if push.done() and not push.cancelled() and push.exception() is None else None
        if pushed in _REFUSALS:
            w.ended = w.ended or "refused"  # it refused us: it will not send either
        elif pushed == "not served":
            w.ended = w.ended or "no exchange"  # alive, and runs no exchange of this run: nothing will come
        if pull is not None and pull.done():
            w.pulling = False
            if not pull.cancelled() and pull.exception() is None and pull.result() is None:
                w.ended = w.ended or "not served"
        inc = self.incoming.get((p, round_idx))
        moving = inc is not None and inc.active > 0 and now - inc.last_progress < self.limits.stall_timeout_s
        w.moved = w.moved or inc is not None
        w.broken = (p, round_idx) in self.broken and not moving
        w.hinted = p in self.pull_hints.get(round_idx, ()) or (self.serves is not None and self.serves(p, round_idx))
        if not (w.ended or moving or w.hinted) and self.gone is not None and self.gone(p, round_idx):
            w.ended = "gone"  # it left or paused, serving nothing of this round: skip it without a timeout
            self.stats.gone_skipped += 1
        return moving

    def serving(self) -> list[int]:
        """Rounds whose payload we serve to pullers because a push of it failed (leaving: any partner has not
        taken it): for our heartbeat's ``serves``."""
        now = self.clock()
        return sorted(
            r
            for r, o in self.outgoing.items()
            if (o.peers if self.leaving else o.failed) - o.delivered and now <= o.serve_until
        )

    def undelivered(self, round_idx: int) -> set[str]:
        """Partners of ``round_idx`` that may still take our payload: no push answered OK or refused, no pull."""
        return set() if (out := self.outgoing.get(round_idx)) is None else out.peers - out.delivered

    def advance(self, round_idx: int) -> None:
        """We are now in ``round_idx``: drop mailbox rounds and buffers that can no longer be used."""
        self.current_round, old = round_idx, round_idx - 1
        for key in [k for k in self.incoming if k[1] < old]:
            del self.incoming[key]
        for r in [r for r in self.outgoing if r < old]:
            self.outgoing.pop(r).close()
        for key in [k for k in self.broken if k[1] < old]:
            del self.broken[key]
        self.settled = {r for r in self.settled if r >= old}
        for d in (self.mailbox, self.unreachable, self.pull_hints):
            for r in [r for r in d if r < old]:
                del d[r]
