"""Who this peer has seen alive, sans-IO: membership by observation, not by declaration.

A heartbeat is a signed DHT record, and a DHT record costs nothing to publish: one DHT node with no p2pd behind it
can store heartbeats for any number of identities it holds keys for (issue 32 measured 24 such ghosts admitted to
a live swarm, stalling its rounds to ``max_wait_s`` and serving as a joiner's only donors). What a ghost cannot do
is answer a stream: libp2p's secure channel (Noise) makes each side prove that it holds its peer id's private key,
so a stream that completes with a peer id is a signed challenge that peer answered, live, over a direct or relayed
connection. A peer therefore counts another (as a member, a partner, a donor, a vote on the swarm's round) only
once it has itself *seen* that identity alive: a probe of ours answered (``peer/host.py`` asks every identity it
reads a heartbeat of), or a stream it opened to us. Each sighting also notes this peer's own round then
(:meth:`Sightings.since`): an identity counts as admitted no earlier than the round we first saw it in, whatever
``join_round`` it declares (backdated identities skipped the admission cap: ``membership.admission_rounds``).

Nothing here does I/O or reads a clock: ``now`` (monotonic seconds) is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

ALIVE_S = 600.0
"""A sighting lasts this long; the host asks again before it ends (a peer that once ran a p2pd and then left it to a
DHT node publishing its heartbeats is a ghost again within this)."""
REPROBE_S = ALIVE_S / 3
"""How old a sighting may grow before the host asks that peer again (its own streams to us renew it anyway)."""
BACKOFF_S = (1.0, 60.0)
"""Wait before asking again an identity that did not answer: the first, doubling up to the second (a ghost costs
one dial a minute once it has failed a few; a NATed peer whose relay slot came late is asked again soon, and its
own hellos to us count as well)."""
MAX_TRACKED = 4096
"""Identities held at most; when full, those not seen alive (ghosts that failed their probes) make room."""


@dataclass
class _Seen:
    since: int | None = None
    """Our round when we first saw it alive (None: we had no round of our own yet)."""
    last: float = -float("inf")
    """When we last saw it alive (monotonic)."""
    next_probe: float = 0.0
    backoff: float = 0.0


class Sightings:
    """The identities this peer has seen alive, when, and when to ask each one again."""

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}
        self.first_round: int | None = None
        """The earliest round of ours a sighting was noted in (None before we had a round)."""

    def __len__(self) -> int:
        return len(self._seen)

    def __contains__(self, peer: object) -> bool:
        """Whether ``peer`` was ever seen or asked (and not forgotten since)."""
        return peer in self._seen

    def saw(self, peer: str, now: float, round_now: int | None) -> None:
        """``peer`` proved itself alive at ``now`` (it answered our probe, or opened a stream to us); this peer was
        in ``round_now`` then (None before it has a round of its own: a joiner's first view clamps nobody)."""
        s = self._entry(peer, now)
        if s is None:
            return
        if round_now is not None and (self.first_round is None or round_now < self.first_round):
            self.first_round = round_now
        if s.last < now - ALIVE_S:  # first seen, or seen again after a gap: a member from now on
            s.since = round_now
        s.last, s.backoff = now, 0.0
        s.next_probe = now + REPROBE_S

    def missed(self, peer: str, now: float) -> None:
        """Our probe of ``peer`` got no answer: ask again after a doubling wait."""
        s = self._entry(peer, now)
        if s is None:
            return
        s.backoff = min(BACKOFF_S[1], max(BACKOFF_S[0], 2 * s.backoff))
        s.next_probe = now + s.backoff

    def alive(self, peer: str, now: float) -> bool:
        s = self._seen.get(peer)
        return s is not None and now - s.last < ALIVE_S

    def unanswered(self, peer: str) -> bool:
        """Whether our last hello to ``peer`` went unanswered (it waits out a backoff)."""
        s = self._seen.get(peer)
        return s is not None and s.backoff > 0

    def due(self, peer: str, now: float) -> bool:
        """Whether to ask ``peer`` now: never asked, its sighting growing old, or its backoff over. The caller
        asks, and reports :meth:`saw` or :meth:`missed`; until then (``asking``) it is not due again."""
        s = self._seen.get(peer)
        return s is None or now >= s.next_probe

    def asking(self, peer: str, now: float, timeout_s: float) -> None:
        """A probe of ``peer`` has begun: not due again before it ends."""
        s = self._entry(peer, now)
        if s is None:
            return
        s.next_probe = max(s.next_probe, now + timeout_s)

    def since(self) -> dict[str, int]:
        """Per identity seen alive, our round when we first saw it (those seen before we had a round left out)."""
        return {p: s.since for p, s in self._seen.items() if s.since is not None}

    def ages(self) -> dict[str, int]:
        """Per identity seen alive, the round it was first seen alive in, as far as we can tell: :meth:`since`, and
        for those seen before we had a round our earliest round (they were alive before every later sighting).
        What we tell a joiner that trusts us (``hello.serve_seen``); identities never seen alive are not in it."""
        out = {}
        for p, s in self._seen.items():
            first = s.since if s.since is not None else self.first_round
            if first is not None and s.last > -float("inf"):
                out[p] = first
        return out

    def keep(self, peers: Iterable[str], now: float) -> None:
        """Forget identities outside ``peers`` (whose heartbeats we no longer read) once their sighting has ended:
        a read that misses a live member (a DHT read can return part of the swarm) does not reset when it counts."""
        keep = set(peers)
        self._seen = {p: s for p, s in self._seen.items() if p in keep or now - s.last < ALIVE_S}

    def _entry(self, peer: str, now: float) -> _Seen | None:
        s = self._seen.get(peer)
        if s is not None:
            return s
        if len(self._seen) >= MAX_TRACKED:  # make room: drop those not seen alive
            self._seen = {p: e for p, e in self._seen.items() if now - e.last < ALIVE_S}
            if len(self._seen) >= MAX_TRACKED:
                return None
        s = self._seen[peer] = _Seen()
        return s
