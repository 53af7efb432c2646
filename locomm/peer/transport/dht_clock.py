"""The DHT's time: our wall clock plus the offset on which the swarm's clocks agree.

hivemind stamps and expires every DHT record on ``hivemind.utils.get_dht_time``, which is ``time.time`` ("a
global (weakly synchronized) time"), and our records' validator bounds lifetimes on the same clock. Records
tolerate ``MAX_CLOCK_SKEW_S`` between a writer and a reader; a machine whose clock steps (an NTP step, a wrong
RTC after a suspend: ``benchmarks/chaos.py``'s clock_step, +-30 s) is that far from everyone, and two machines
stepped opposite ways are twice that, past the bound: a record one writes expires later than the other's
validator allows (2 x TTL + 2 x ``MAX_CLOCK_SKEW_S`` past its now), and hivemind's pings refuse either (its 3 s
check) for as long as the step lasts.

So the DHT time of a locomm process is ``time.time() + offset``. Every ``CHECK_S`` the host asks up to
``PEERS`` DHT nodes of its routing table for theirs (hivemind's own ``rpc_ping``, which answers with the
responder's DHT time) and moves the offset by :func:`correction`: the median of what they said and of our own
clock, so a clock moves only where a strict majority of the answers and ours agree, and a 2-peer swarm never
moves. The offset stays within ``MAX_CLOCK_SKEW_S`` of the machine's clock: identities that lie about their time
(identities are cheap in an open swarm) can move ours by no more than the skew records tolerate anyway.

The offset is the process's, as hivemind's clock is: :func:`install` points every loaded hivemind module's
``get_dht_time`` at :func:`now`; locomm's code calls :func:`now`. Peers and bootstrap nodes follow it; other
processes (``status``, ``doctor``) read the plain wall clock. DiLoCo's ``hivemind.DHT`` and averager are forked
processes: they keep the offset of the moment they were forked (a step after that is not followed there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from hivemind.dht import DHTNode
from hivemind.dht.protocol import DHTProtocol, ValidationError
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2

from locomm.protocol.membership import MAX_CLOCK_SKEW_S

log = logging.getLogger(__name__)

CHECK_S = 10.0
"""How often a host asks other DHT nodes for their time (a clock step is followed within this long)."""
PEERS = 8
"""How many DHT nodes it asks each time (chosen at random from its routing table)."""
MAX_RTT_S = 2.0
"""An answer that took longer is dropped: the midpoint of the request places the answer within half of this."""
MOVE_S = 1.0
"""The offset moves only by more than this (hivemind's pings allow 3 s): round trips' jitter leaves it be."""
BOUND_S = MAX_CLOCK_SKEW_S
"""The offset never leaves +-this (see the module docstring)."""

_ORIGINAL = time.time
_offset = 0.0


def now() -> float:
    """The DHT time of this process: the wall clock plus the offset the swarm agreed on."""
    return time.time() + _offset


def offset() -> float:
    return _offset


def correction(samples: Iterable[float], move_s: float = MOVE_S) -> float:
    """How far to move our DHT time, from ``samples`` (each another node's DHT time minus ours): the median of
    the samples and of our own 0; with an even count, the middle value nearer 0 (so one answer against ours, or a
    tie, moves nothing). 0.0 when that is within ``move_s``."""
    values = sorted([0.0, *samples])
    n = len(values)
    if n % 2:
        mid = values[n // 2]
    else:
        lo, hi = values[n // 2 - 1], values[n // 2]
        mid = lo if abs(lo) <= abs(hi) else hi
    return mid if abs(mid) > move_s else 0.0


def set_offset(value: float) -> float:
    """Set the offset, within +-BOUND_S; the offset now."""
    global _offset
    _offset = max(-BOUND_S, min(BOUND_S, value))
    return _offset


def install() -> None:
    """Point ``get_dht_time`` of every loaded hivemind module that imported hivemind's clock at :func:`now`
    (``DHTNode``, its protocol and storage compare expirations on it). Idempotent."""
    for name, module in list(sys.modules.items()):
        if (name == "hivemind" or name.startswith("hivemind.")) and getattr(module, "get_dht_time", None) is _ORIGINAL:
            module.get_dht_time = now


async def ping(protocol: DHTProtocol, peer: PeerID, timeout: float) -> tuple[float, float] | None:
    """(offset, round trip) of one hivemind DHT ping: ``peer``'s DHT time minus the midpoint of ours; None when it
    does not say its time. Errors and timeouts are raised."""
    request = dht_pb2.PingRequest(peer=protocol.node_info, validate=False)
    t0 = now()
    response = await asyncio.wait_for(protocol.get_stub(peer).rpc_ping(request), timeout)
    t1 = now()
    return (response.dht_time - (t0 + t1) / 2, t1 - t0) if response.dht_time else None


async def sample(protocol: DHTProtocol, peers: Iterable[PeerID], timeout: float = MAX_RTT_S) -> list[float]:
    """Each of ``peers``' DHT time minus ours (pinged at once; answers slower than ``timeout``, failures and nodes
    that do not say their time are left out)."""

    async def one(peer: PeerID) -> float | None:
        with contextlib.suppress(Exception):
            found = await ping(protocol, peer, timeout)
            if found is not None and found[1] <= timeout:
                return found[0]
        return None

    found = await asyncio.gather(*(one(p) for p in peers))
    return [s for s in found if s is not None]


async def check(dht: DHTNode, write: Callable[..., Any] | None = None) -> float | None:
    """Ask up to ``PEERS`` DHT nodes of ``dht``'s routing table (at random) their time and :func:`follow` the
    answers; the offset's change, or None. A change is a ``dht_clock`` event through ``write`` (an event log's)."""
    protocol = dht.protocol
    peers = [p for p in protocol.routing_table.peer_id_to_uid if p != protocol.p2p.peer_id]
    asked = random.sample(peers, min(PEERS, len(peers)))
    samples = await sample(protocol, asked)
    moved = follow(samples)
    if moved is not None and write is not None:
        write("dht_clock", offset_s=round(_offset, 3), moved_s=round(moved, 3), asked=len(asked), answers=len(samples))
    return moved


async def keep(dht: DHTNode, stop: asyncio.Event, write: Callable[..., Any] | None = None) -> None:
    """:func:`check` every ``CHECK_S`` until ``stop`` is set (a failed check is logged and the next one runs)."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), CHECK_S)
        if not stop.is_set():
            try:
                await check(dht, write)
            except Exception as e:  # noqa: BLE001 - a clock check never stops a peer
                log.warning("the clock check failed: %s: %s", type(e).__name__, e)


def quiet_refusals(previous: Callable[..., Any] | None) -> Callable[[Any, dict[str, Any]], None]:
    """An event loop's exception handler, less the tracebacks of hivemind's bootstrap pings that refused an
    initial peer's time (the host joins anyway and says so once; :func:`keep` then follows the swarm's time): a
    strict ``DHTNode.create`` leaves its other pings' ``ValidationError`` unretrieved, and each one printed a
    traceback (79 of 88 in benchmarks/chaos.py's seed 11); so did a ping that reached the refused node's protocol
    before the host removed its handlers (``rpc_ping``: no ``node_info``). They go to the debug log."""

    def handle(loop: Any, context: dict[str, Any]) -> None:
        e = context.get("exception")
        refused = isinstance(e, ValidationError) and "local time" in str(e)
        # and a ping that reached the refused node's protocol before its handlers were removed (chaos seed 14)
        if refused or (isinstance(e, AttributeError) and "node_info" in str(e)):
            log.debug("%s: %s", context.get("message"), e)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    return handle


def follow(samples: list[float]) -> float | None:
    """Move the offset by :func:`correction` of ``samples``; the change, or None when it did not move."""
    before = _offset
    moved = correction(samples)
    if not moved or set_offset(before + moved) == before:
        return None
    if abs(_offset) > MOVE_S:
        log.warning(
            "our clock is %+.1f s from the swarm's (the median of %d DHT nodes' answers and ours): the DHT's time is "
            "the wall clock %+.1f s from now on (is the clock synced? `timedatectl set-ntp true`)",
            -_offset,
            len(samples),
            _offset,
        )
    else:
        log.warning("our clock agrees with the swarm's again: the DHT's time is the wall clock")
    return _offset - before
