"""A peer's partners: who may push to it in a round, by when their payloads are due, and what the
poisoning defence did to their updates.

The first two read the heartbeats the host holds and compute what every peer computes alike
(``protocol/``): the round's members (:func:`~locomm.protocol.membership.members_for_round`), a
partner's ETA (:func:`~locomm.protocol.timing.partner_eta`). :func:`note_screening` turns a round's
screening (``protocol/defence.py``) into faults and events, for both peer modes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from locomm.config import RunSpec
from locomm.peer.host import Host
from locomm.protocol.membership import members_for_round
from locomm.protocol.timing import partner_eta

KEEP_ROUNDS = 2
"""Planned partner sets kept behind the current round (pushes of older rounds are refused anyway)."""


class Partners:
    """The push check and the ETAs of one data-parallel peer."""

    def __init__(self, host: Host, spec: RunSpec, wire_bytes: int) -> None:
        self.host, self.spec = host, spec
        self.wire_bytes = max(1, wire_bytes)
        self.planned: dict[int, set[str]] = {}
        """The partners of the rounds we planned lately: the only peers whose pushes we take for them."""

    def planned_round(self, round_idx: int, peers: list[str]) -> None:
        self.planned[round_idx] = set(peers)
        for r in [r for r in self.planned if r < round_idx - KEEP_ROUNDS]:
            del self.planned[r]

    def members(self, round_idx: int) -> list[str]:
        """The members of ``round_idx`` from the heartbeats we hold."""
        host = self.host
        return members_for_round(
            host.beats.values(),
            round_idx,
            host.me,
            fresh_s=self.spec.network.heartbeat_ttl_s,
            now=host.dht_now(),
            since=host.since(),
        )

    async def admit(self, remote: str, round_idx: int) -> bool:
        """Only this round's partners may send us a payload (checked before anything is buffered).

        A round we planned admits exactly the partners we planned with. A round we have not planned yet (the
        sender is ahead of us, or we are joining) admits any member of that round by the heartbeats we hold
        (once more after a fresh read): our view of its groups may still change until we plan it (a joiner's
        first read, a peer dropping out), and refusing a partner there costs the round its payload. The
        payload budget (``Gossip``'s partners + 2) bounds what such early pushes can hold, and a payload from a
        sender that turns out not to be a partner is never used."""
        planned = self.planned.get(round_idx)
        if planned is not None:
            return remote in planned
        return await self.host.recheck(lambda: remote in self.members(round_idx))

    def eta(self, round_idx: int, own_round_s: float) -> Callable[[str], float]:
        """Monotonic time by which a partner's payload of ``round_idx`` should be here (from its heartbeat)."""

        def eta(peer: str) -> float:
            now_wall, now = self.host.dht_now(), time.monotonic()  # round_t0 is on DHT time (dht_clock)
            b = self.host.beats.get(peer)
            at = partner_eta(
                round_idx=round_idx,
                partner_round=b.round if b is not None else None,
                round_t0=b.round_t0 if b is not None else None,
                round_s=b.round_s if b is not None else None,
                up_Bps=b.up_Bps if b is not None else None,
                partners=b.partners if b is not None else None,
                own_round_s=own_round_s,
                wire_bytes=self.wire_bytes,
                limits=self.host.limits,
                now=now_wall,
                observed_round_s=self.host.observed_round_s(peer),
            )
            return now + (at - now_wall)

        return eta
