"""The bookkeeping of the exchange layer: one round's outgoing payload, one incoming payload, the
counters, and the per-peer fault ledger with its local ban list (used by every service on the host)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from locomm.compression.payload import Part, PayloadCodec
from locomm.peer.transport.meter import NotServed, TransferCut, Unreachable
from locomm.peer.transport.paths import PathLog
from locomm.peer.transport.rpc import RpcServer
from locomm.protocol.messages import ErrorCode

log = logging.getLogger(__name__)


@dataclass
class GossipStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges_ok: int = 0
    """Partner-rounds whose payload arrived."""
    exchanges_failed: int = 0
    """Partner-rounds whose payload did not arrive in time."""
    bytes_undelivered: int = 0
    """Part of bytes_sent that went into pushes the partner refused or cut (a retry sends them again)."""
    pushes_ok: int = 0
    pushes_failed: int = 0
    pulls: int = 0
    unreachable: int = 0
    gave_up: int = 0
    """Partner-rounds we stopped waiting for at their deadline (their payload never came)."""
    gave_up_on: list[tuple[int, str]] = field(default_factory=list)
    """Those (round, partner) pairs."""
    broken_promises: int = 0
    """Faults recorded for partners planned BROKEN_PROMISES rounds in a row that sent nothing (protocol/timing)."""
    gone_skipped: int = 0
    """Partner-rounds we stopped waiting for because the partner had left (its final heartbeat said so)."""
    last_exchange: float = 0.0
    up_Bps: float = 0.0
    """Measured upload rate (bytes/s per partner stream set), an EMA over pushes."""
    encode_s: float = 0.0
    """Codec-pool time spent encoding our payloads' parts (threads: it overlaps the wire and the compute)."""
    decode_s: float = 0.0
    """Codec-pool time spent decoding partners' parts."""
    paths: PathLog = field(default_factory=PathLog)
    """How each partner's payload arrived (pushed / pulled, direct / relayed): ``exchange`` events."""


BAN_S = 600.0
"""How long a peer's first ban lasts; each later ban of the same peer lasts twice the one before, up to
``BAN_MAX_S``. A ban that lasted for good cut honest peers off each other for the rest of their lives: in chaos
seed 15 two peers whose own links were being dropped and shaped sent nothing for 9 planned rounds, were banned
as promise breakers, and were never exchanged with again. A liar pays again after each ban, sooner banned for
longer: 10 min, 20, 40, ... a day."""
BAN_MAX_S = 24 * 3600.0


class Faults:
    """Faults per peer and the local ban list: ``max_faults`` faults since a peer's last ban ban it for a while
    (``BAN_S``, doubling per ban). ``clock``: monotonic seconds (a test's virtual time)."""

    def __init__(
        self,
        max_faults: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        ban_s: float = BAN_S,
        on_ban: Callable[[str, float, int], None] | None = None,
    ) -> None:
        self.max_faults = max_faults
        self.on_ban = on_ban
        """``on_ban(peer, seconds, faults)`` at each ban (the host writes a "banned" event)."""
        self.count: dict[str, int] = defaultdict(int)
        """Every fault of each peer, over this process's life."""
        self.bans: dict[str, int] = defaultdict(int)
        """How many times each peer was banned."""
        self.clock = clock
        self.ban_s = ban_s
        self._strikes: dict[str, int] = defaultdict(int)
        self._until: dict[str, float] = {}
        self._began: dict[str, list[float]] = {}

    @property
    def total(self) -> int:
        return sum(self.count.values())

    @property
    def banned(self) -> frozenset[str]:
        """The peers banned now (a ban that has run out is lifted here)."""
        now = self.clock()
        for peer, until in list(self._until.items()):
            if until <= now:
                del self._until[peer]
                log.info("the ban of %s ended (%d so far)", peer[-8:], self.bans[peer])
        return frozenset(self._until)

    def is_banned(self, peer: str) -> bool:
        """Whether ``peer`` is banned now (one lookup: asked for every stream)."""
        until = self._until.get(peer)
        return until is not None and until > self.clock()

    def ban(self, peer: str) -> None:
        """Ban ``peer`` now: ``ban_s`` the first time, twice as long for each other ban of it that began in the
        last ``BAN_MAX_S`` (so a flaky honest peer's bans shrink back), ``BAN_MAX_S`` at most."""
        now = self.clock()
        self.bans[peer] += 1
        recent = self._began[peer] = [t for t in self._began.get(peer, []) if t > now - BAN_MAX_S] + [now]
        self._strikes[peer] = 0
        span = min(BAN_MAX_S, self.ban_s * 2.0 ** min(len(recent) - 1, 32))
        self._until[peer] = now + span
        log.warning("banned %s for %.0f s after %d faults", peer[-8:], span, self.count[peer])
        if self.on_ban is not None:
            self.on_ban(peer, span, self.count[peer])

    def record(self, peer: str, why: str) -> None:
        self.count[peer] += 1
        self._strikes[peer] += 1
        log.warning("fault from %s (%d): %s", peer[-8:], self.count[peer], why)
        if self._strikes[peer] >= self.max_faults and not self.is_banned(peer):
            self.ban(peer)


class Outgoing:
    """One round's payload, encoded part by part in the codec pool once for every partner."""

    def __init__(
        self,
        round_idx: int,
        payload: Mapping[str, Any],
        codec: PayloadCodec,
        server: RpcServer,
        peers: list[str],
        stats: GossipStats | None = None,
    ) -> None:
        self.round = round_idx
        self.peers = set(peers)
        self.codec = codec
        self.enc = {t.name: len(payload[t.name]) for t in codec.tensors if t.encoded}
        self.parts = codec.parts(self.enc)
        self.xfer = random.getrandbits(31)
        self.delivered: set[str] = set()
        """Partners that have it (a push answered OK, a pull served) or will never take it (a refusal)."""
        self.failed: set[str] = set()
        """Partners a push to failed (cut, unreachable): they may pull it."""
        self.serve_until = math.inf
        """Pulls of it are served until then (``timing.serve_until``; the exchange sets it)."""
        loop = asyncio.get_running_loop()
        encode = codec.encode_part if stats is None else timed(codec.encode_part, stats, "encode_s")
        self._futures = [loop.run_in_executor(server.pool, encode, payload, p) for p in self.parts]

    async def get(self, i: int) -> bytes:
        return await self._futures[i]

    def close(self) -> None:
        for f in self._futures:
            f.cancel()


@dataclass
class Incoming:
    """A payload being received from one peer for one round (over one or more streams)."""

    xfer: int
    dest: dict[str, Any]
    expected: set[Part]
    last_progress: float
    """When a byte of it last arrived, in the Gossip's clock."""
    pulled: bool = False
    """A pull we started (not counted against the budget of pushed payloads)."""
    active: int = 0
    """Streams reading parts of it now."""
    claimed: set[Part] = field(default_factory=set)
    done: set[Part] = field(default_factory=set)
    opened_at: float = field(default_factory=time.time)
    """Wall-clock time its first stream's header was read (with the parts' times: the ``exchange`` event)."""
    first_part_at: float | None = None
    last_part_at: float | None = None

    @property
    def complete(self) -> bool:
        return self.done == self.expected


def timed(fn: Any, stats: GossipStats, key: str) -> Any:
    """``fn``, adding the seconds each call takes to ``stats.<key>`` (from any thread)."""

    def run(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            setattr(stats, key, getattr(stats, key) + time.perf_counter() - t0)

    return run


class EarlyReset(ConnectionError):
    """The stream broke before any part went out (a refusal whose answer the reset overtook)."""


def tally_lanes(
    peer: str, lanes: list[list[int]], results: list[Any]
) -> tuple[ErrorCode | str, set[int], set[int], bool]:
    """One push attempt's outcome from its streams' results (``(code, pull, held)`` or an exception).

    Returns the outcome (the first refusal, or "not served" / "unreachable" / "reset" / "cut"), the parts
    answered OK, the streams answered "held already" (their bytes delivered nothing new), and whether the partner
    asked us to let it pull.
    """
    delivered: set[int] = set()
    redundant: set[int] = set()
    hinted = False
    outcome: ErrorCode | str = ErrorCode.OK
    for k, (idx, r) in enumerate(zip(lanes, results)):
        if isinstance(r, asyncio.CancelledError):
            raise r
        if isinstance(r, NotServed):
            outcome = "not served"
        elif isinstance(r, Unreachable):
            outcome = "unreachable"
        elif isinstance(r, EarlyReset):
            outcome = "reset" if outcome == ErrorCode.OK else outcome
        elif isinstance(r, TransferCut):
            outcome = "cut" if outcome == ErrorCode.OK else outcome
        elif isinstance(r, BaseException):
            log.info("push to %s failed: %s: %s", peer[-8:], type(r).__name__, r)
            outcome = "cut" if outcome == ErrorCode.OK else outcome
        else:
            code, pull, held = r
            if code == ErrorCode.OK:
                delivered.update(idx)
            if held:
                redundant.add(k)
            hinted |= bool(pull)
            if code != ErrorCode.OK and outcome == ErrorCode.OK:
                outcome = code
    return outcome, delivered, redundant, hinted


def balance_lanes(sizes: list[tuple[int, int]], n: int) -> list[list[int]]:
    """Deal ``(index, bytes)`` items onto ``n`` streams, each to the least loaded so far (deterministic)."""
    lanes: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i, size in sizes:
        j = load.index(min(load))
        lanes[j].append(i)
        load[j] += size
    return lanes
