"""Membership, sans-IO: the typed heartbeat record, the members of a round, and the stage choice.

A heartbeat is what one peer publishes about itself in the DHT (``peer/transport/swarm.py`` moves it). Every
field is parsed and checked here, once, when a record is read: :meth:`Heartbeat.parse` returns
``None`` for a record with any bad field (wrong type, not finite, out of range, too long), so one
malformed record from any peer is a dropped record, never an exception inside a round loop.

The members of round r are the live peers admitted by r and whose last round is not far behind r
(:func:`members_for_round`), sorted by peer id. A joiner announces a join_round a little ahead of the
swarm, so every peer includes it from the same round on. Local bans never change the members: a banned
partner is skipped at exchange time instead.

Admission is bounded (:func:`admission_rounds`): at most ``max(JOIN_CAP_MIN, JOIN_CAP_FRACTION x the
members admitted before)`` new members per round, a rule every peer computes alike from the same signed
records; a flood of joiners (or of identities minted by one attacker) is admitted a few per round, in an
order by hash of the peer id, and the rest wait their turn. Without a flood every joiner is admitted at the
round it announced, exactly as before.

Nothing here does I/O or reads a clock: ``now`` is passed in (DHT time, seconds since the epoch).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import ipaddress
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MEMBER_LAG_ROUNDS = 3
"""A peer whose last heartbeat is more than this many rounds behind round r is not a member of r."""
NOT_ADMITTED = 2**31 - 1
"""join_round of a joiner that has not synced yet: nobody counts it as a member."""
MAX_ROUND = 2**31 - 1
JOIN_CAP_MIN = 16
"""New members one round admits at least (a swarm of up to this many founders starts together)."""
JOIN_CAP_FRACTION = 0.25
"""... and at most this fraction of the members admitted before it, when that is more."""
MAX_ADDRS = 16
MAX_ADDR_LEN = 256
MAX_CLOCK_SKEW_S = 30.0
"""A heartbeat written further than this in the reader's future is not fresh: a time its writer chose does not
keep it alive (a future ``time`` kept a dead or fake peer fresh for the record's whole life)."""
MAX_SERVED_ROUNDS = 4
"""Rounds a heartbeat's ``serves`` may list (a sender keeps the payloads of its last two rounds)."""
MAX_VERSION_LEN = 64
MAX_ISLAND_LEN = 64


class BadField(ValueError):
    """A heartbeat field of the wrong type, or out of its range."""


def _int(v: Any, lo: int = 0, hi: int = MAX_ROUND) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadField(f"not an int in [{lo}, {hi}]: {v!r}")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise BadField(f"not a finite number: {v!r}")
    return float(v)


def _nonneg(v: Any) -> float:
    x = _float(v)
    if x < 0:
        raise BadField(f"negative: {v!r}")
    return x


def _opt_float(v: Any) -> float | None:
    return None if v is None else _float(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadField(f"not a bool: {v!r}")
    return v


def _str(v: Any, n: int = MAX_VERSION_LEN) -> str:
    if not isinstance(v, str) or len(v) > n:
        raise BadField(f"not a string of at most {n} characters")
    return v


def _addrs(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list | tuple) or len(v) > MAX_ADDRS:
        raise BadField(f"not a list of at most {MAX_ADDRS} addresses")
    return tuple(_str(m, MAX_ADDR_LEN) for m in v)


def _rounds(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list | tuple) or len(v) > MAX_SERVED_ROUNDS:
        raise BadField(f"not a list of at most {MAX_SERVED_ROUNDS} rounds")
    return tuple(_int(r) for r in v)


def _stage(v: Any) -> int | None:
    return None if v is None or v == -1 else _int(v, 0, 1024)


_PARSE = {
    "round": _int,
    "join_round": _int,
    "step": lambda v: _int(v, 0, 2**62),
    "time": _nonneg,
    "version": _str,
    "incarnation": lambda v: _str(v, 32),
    "maddrs": _addrs,
    "avg_maddrs": _addrs,
    "started": _bool,
    "finished": _bool,
    "paused": _bool,
    "serves": _rounds,
    "leaving": _bool,
    "eta_s": lambda v: None if v is None else _nonneg(v),
    "loss": _opt_float,
    "val_loss": _opt_float,
    "tokens_per_s": _nonneg,
    "bytes_sent": lambda v: _int(v, 0, 2**62),
    "last_exchange": _opt_float,
    "round_t0": _opt_float,
    "round_s": _nonneg,
    "up_Bps": _nonneg,
    "partners": lambda v: _int(v, 0, 1 << 16),
    "faults": lambda v: _int(v, 0, 2**62),
    "banned": lambda v: _int(v, 0, 2**62),
    "stage": _stage,
    "clock": lambda v: _int(v, 0, 2**62),
    "mb_per_s": _nonneg,
    "microbatches": lambda v: _int(v, 0, 2**62),
    "rerouted": lambda v: _int(v, 0, 2**62),
    "lost": lambda v: _int(v, 0, 2**62),
    "island": lambda v: _str(v, MAX_ISLAND_LEN),
    "island_rep": _bool,
    "island_proof": lambda v: _str(v, 128),
    "island_commit": lambda v: _str(v, 64),
    "island_salt": lambda v: _str(v, 64),
}


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """One peer's published state, every field typed and checked (see :meth:`parse`)."""

    peer: str
    round: int = 0
    """The round this peer is in (pipeline: its data clock // H)."""
    join_round: int = 0
    """The first round this peer is a member of (NOT_ADMITTED before it synced)."""
    step: int = 0
    time: float = 0.0
    """DHT time the record was written."""
    expires: float = math.inf
    version: str = ""
    incarnation: str = ""
    """Random per process start: a new one is a restart, which has none of the old process's payloads."""
    maddrs: tuple[str, ...] = ()
    avg_maddrs: tuple[str, ...] = ()
    """DiLoCo only: the addresses of this peer's hivemind averager DHT."""
    started: bool = False
    finished: bool = False
    """It left: its final heartbeat (data-parallel: a member of no round from ``round`` on)."""
    paused: bool = False
    """Its volunteer paused it (``locomm-peer pause``): it serves its state but trains no round from ``round``
    on, so nobody waits for it; on resume it announces a new ``join_round``, as a joiner does."""
    serves: tuple[int, ...] = ()
    """Rounds whose payload it serves to partners that pull it (a push of it failed, or it is leaving): a
    partner waiting on one of them pulls it now, and does not take its leaving as "nothing will come"."""
    leaving: bool = False
    """It is leaving: its exchanges are over, it serves its last payload (``serves``) and pulls nothing more."""
    eta_s: float | None = None
    """Seconds until this peer expects to finish its current round's inner steps (None: not training)."""
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float = 0.0
    bytes_sent: int = 0
    last_exchange: float | None = None
    # What partners need for an ETA of this peer's payload (protocol/timing.py).
    round_t0: float | None = None
    """Wall-clock time this peer's current round's compute began."""
    round_s: float = 0.0
    """How long a round takes this peer (an EMA); 0 before its first round."""
    up_Bps: float = 0.0
    partners: int = 0
    faults: int = 0
    banned: int = 0
    # Pipeline mode.
    stage: int | None = None
    clock: int = 0
    mb_per_s: float = 0.0
    microbatches: int = 0
    rerouted: int = 0
    lost: int = 0
    # Islands (peer/island/member.py).
    island: str = ""
    """The island this peer trains in ('': none)."""
    island_rep: bool = False
    """It represents its island in the outer rounds; the island's other members are members of no round."""
    island_proof: str = ""
    """A closed island's HMAC of this peer id (hex; ``peer/island/member.py``)."""
    island_commit: str = ""
    """While its island forms: the hash of the salt it will reveal (hex; ``peer/island/wire.island_order``)."""
    island_salt: str = ""
    """Once every member of its island committed: the salt itself (hex); the salts order the representatives."""
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """Fields this version does not know (a newer peer's), kept for display only."""

    @classmethod
    def parse(cls, peer: Any, value: Any, expires: float = math.inf) -> Heartbeat | None:
        """The heartbeat in a DHT value, or None when the record is malformed in any field."""
        if not isinstance(peer, str) or not 0 < len(peer) <= 128 or not isinstance(value, Mapping):
            return None
        known: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        try:
            for k, v in value.items():
                parse = _PARSE.get(k)
                if parse is not None:
                    known[k] = parse(v)
                elif isinstance(k, str) and len(extra) < 16:
                    extra[k] = v
            return cls(peer=peer, expires=_float(expires) if math.isfinite(expires) else expires, extra=extra, **known)
        except (BadField, TypeError):
            return None

    def record(self) -> dict[str, Any]:
        """The DHT value for this heartbeat (what :meth:`parse` reads back), without peer and expiry."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("peer", "expires", "extra"):
            del out[k]
        out["maddrs"], out["avg_maddrs"], out["serves"] = list(self.maddrs), list(self.avg_maddrs), list(self.serves)
        out["stage"] = -1 if self.stage is None else self.stage
        return out

    @property
    def admitted(self) -> bool:
        return self.join_round < NOT_ADMITTED


def join_cap(established: int) -> int:
    """How many new members one round admits, given how many were admitted before it."""
    return max(JOIN_CAP_MIN, math.ceil(JOIN_CAP_FRACTION * established))


def admission_rounds(beats: Iterable[Heartbeat], since: Mapping[str, int] | None = None) -> dict[str, int]:
    """The round from which each admitted peer counts as a member: its announced ``join_round``, or the round
    the reader first saw it alive when that is later (``since``: ``protocol/sightings.py``; an identity
    backdating its ``join_round`` skipped the cap below), later still when that round's admissions are full
    (:func:`join_cap`).

    Peers are taken in order of (that round, sha256 of the peer id) and each gets the first round at or after
    it with a free slot, so the result is a function of the records and the sightings: every peer that reads
    the same heartbeats computes the same rounds for honest joiners, which announce a round after the one they
    were first seen in.
    """
    since = since or {}

    def declared(b: Heartbeat) -> int:
        return max(b.join_round, since.get(b.peer, 0))

    order = sorted(
        (b for b in beats if b.admitted), key=lambda b: (declared(b), hashlib.sha256(b.peer.encode()).digest())
    )
    used: dict[int, int] = {}
    assigned: list[int] = []  # effective rounds so far, sorted
    out: dict[str, int] = {}
    for b in order:
        r = declared(b)
        while used.get(r, 0) >= join_cap(bisect.bisect_left(assigned, r)):
            r += 1
        used[r] = used.get(r, 0) + 1
        bisect.insort(assigned, r)
        out[b.peer] = r
    return out


def sends_nothing_more(b: Heartbeat, round_idx: int) -> bool:
    """Whether a partner's heartbeat says nothing more of its payload of ``round_idx`` will come: it left or
    paused, or it is two rounds past that one (its exchange of the round is over: what it pushed has come or is
    moving, nothing is retried), and it does not list the round in ``serves`` (what it still serves is pulled).
    Without the last case a replica two rounds behind its sibling waited out every round's deadline for
    payloads the sibling no longer served, and held it there (a 2-stage pipeline at 30 s a round)."""
    return (b.finished or b.paused or b.round >= round_idx + 2) and round_idx not in b.serves


def restarted(b: Heartbeat | None, planned: str | None) -> bool:
    """Whether a partner restarted since we planned with it (``planned``: its incarnation then; None or '': not
    known). A new process has none of the old one's payloads and sends nothing of its rounds: a partner killed
    while starting and started again every 10-30 s was waited for 255 s in chaos (issue 31)."""
    return bool(planned) and b is not None and bool(b.incarnation) and b.incarnation != planned


def newer(b: Heartbeat, prev: Heartbeat) -> bool:
    """Whether a record read replaces the one held for that peer: a later (round, time), or a restart (another
    incarnation, written later) whose round may be lower. A replayed record of an earlier process is older by
    its time, and a replay of the held one does not move the round back. (A restart whose clock is behind the
    old process's is read once the old record expires.)"""
    if b.incarnation and prev.incarnation and b.incarnation != prev.incarnation:
        return b.time > prev.time
    return (b.round, b.time) >= (prev.round, prev.time)


def may_still_pull(b: Heartbeat | None, last: int, now: float, ttl: float) -> bool:
    """Whether a partner that has not taken our payload of round ``last`` may still pull it, as a leaving peer
    judges it: its heartbeat is fresh (younger than ``ttl``), it has not left, paused or begun leaving itself
    (its exchanges are over), and it is at most a round past ``last`` (a loaded partner may be seconds behind;
    one two rounds on has ended that exchange). Two peers leaving together each waited for the other to pull,
    up to ``max_wait_s``, when the other's leaving did not count (issue 31: a leaver served for 157.8 s)."""
    if b is None or b.finished or b.paused or b.leaving:
        return False
    return b.round <= last + 1 and now - b.time < ttl


def members_for_round(
    beats: Iterable[Heartbeat],
    round_idx: int,
    me: str,
    fresh_s: float = 0.0,
    now: float = 0.0,
    since: Mapping[str, int] | None = None,
) -> list[str]:
    """The members of round r, from a snapshot every peer reads alike.

    A peer is a member of r when it was admitted by r (its :func:`admission_rounds` round ``<= r``) and either
    its last published round is within ``MEMBER_LAG_ROUNDS`` of r or its heartbeat is younger than
    ``fresh_s`` at ``now`` and not from further than ``MAX_CLOCK_SKEW_S`` in its future (a live peer that is
    merely slow, or fast, stays in). A round counter far ahead of r keeps nobody in by itself: one stored
    heartbeat claiming round 10^6 was a member of every round for its record's whole life (hours). A peer
    that died drops out when both fail: its frozen round counter is content every peer reads alike, so where
    rounds are longer than the heartbeat TTL (any real run) it drops out for everyone at the same round,
    whenever each one reads.
    A peer that left (``finished``, its final heartbeat) or was paused is a member of no round from its last
    published one on: it exchanged up to the round before. ``me`` is always included (a peer not yet admitted
    trains alone, and nobody expects it). An island's members other than its representative take part in no
    round: the island is one participant. ``since``: the round the reader first saw each peer alive
    (:func:`admission_rounds`); ``beats`` are those of peers it has seen alive (``peer/host.py``).
    """
    beats = list(beats)
    admitted = admission_rounds(beats, since)
    members = {
        h.peer
        for h in beats
        if admitted.get(h.peer, NOT_ADMITTED) <= round_idx
        and not ((h.finished or h.paused) and h.round <= round_idx)
        and not (h.island and not h.island_rep)
        and (
            round_idx - MEMBER_LAG_ROUNDS <= h.round <= round_idx + MEMBER_LAG_ROUNDS
            or -MAX_CLOCK_SKEW_S <= now - h.time < fresh_s
        )
    }
    members.add(me)
    return sorted(members)


def islands_led(beats: Iterable[Heartbeat]) -> bool:
    """Whether every island a live heartbeat names has published its representative: until then a founding
    swarm that waits for its peers would start round 0 without the island (``join --wait-for-peers``)."""
    beats = [b for b in beats if not b.finished]
    named = {b.island for b in beats if b.island}
    return named <= {b.island for b in beats if b.island and b.island_rep}


def robust_top(values: Iterable[int], slack: int = 1) -> int:
    """The largest of ``values`` within ``slack`` of their (lower) median (the largest, with fewer than 3; 0
    with none): fewer than half of them, claiming a far-off round or step, move it by ``slack`` at most. (It
    was the value two thirds reach: 3 identities of 7 claiming round 10^9 sent a joiner there.)"""
    ordered = sorted(values)
    if not ordered:
        return 0
    if len(ordered) < 3:
        return ordered[-1]
    q = ordered[(len(ordered) - 1) // 2]
    return max(v for v in ordered if v <= q + slack)


def swarm_round(beats: Iterable[Heartbeat]) -> int:
    """The swarm's round as a joiner should take it: :func:`robust_top` of the admitted peers' rounds (a paused
    peer's is where it stopped, not the swarm's)."""
    return robust_top(b.round for b in beats if b.admitted and not b.paused)  # a paused round stays behind


DONORS = 5
"""Peers a joiner asks for their state (what most of them agree on wins: ``peer/transport/state_sync.py``)."""
STATE_RETRY_S = (2.0, 4.0, 8.0, 8.0)
"""Waits between a joiner's whole state downloads (each asks the donors of a fresh heartbeat read); after the last
it goes on from its own weights."""


def netgroup(addrs: Iterable[str]) -> str:
    """The network group of a peer as its live connections show it (the remote multiaddrs this node's p2pd
    holds to it, not what it declares): an IPv4 /16 or an IPv6 /32, as Bitcoin Core buckets its peers
    (``CNetAddr::GetGroup``), so identities minted on one machine, or one provider's block, share a group.
    A direct connection decides over a relayed one; a relayed one names the relay's group (the peer's own
    address is hidden behind it); a DNS name is its own group; no connection: ``"?"`` (one group for all)."""
    direct = [a for a in addrs if "/p2p-circuit" not in a]
    relayed = [a for a in addrs if "/p2p-circuit" in a]
    for a, kind in [*((a, "") for a in direct), *((a, "relay:") for a in relayed)]:
        parts = a.split("/")
        if len(parts) < 3:
            continue
        proto, host = parts[1], parts[2]
        try:
            if proto == "ip4":
                ip = ipaddress.IPv4Address(host)
                return f"{kind}ip4:{ipaddress.IPv4Network((ip, 16), strict=False)}"
            if proto == "ip6":
                ip6 = ipaddress.IPv6Address(host)
                if ip6.ipv4_mapped is not None:
                    return f"{kind}ip4:{ipaddress.IPv4Network((ip6.ipv4_mapped, 16), strict=False)}"
                return f"{kind}ip6:{ipaddress.IPv6Network((ip6, 32), strict=False)}"
        except ValueError:
            continue
        if proto in ("dns", "dns4", "dns6", "dnsaddr"):
            return f"{kind}dns:{host.lower()}"
    return "?"


DONOR_MIN_AGE_ROUNDS = 3
"""A state donor first seen alive (by the joiner or its ``--initial-peers``) this many rounds ago or more is asked
before one seen since (``state_donors(young_after=)``). Few enough that a swarm of peers that joined an hour ago
is all old; enough that identities minted this minute are young."""


def state_donors(
    beats: Iterable[Heartbeat],
    top: int,
    progress: Callable[[Heartbeat], int],
    *,
    slack: int = 1,
    n: int = DONORS,
    prefer: Collection[str] = (),
    groups: Mapping[str, str] | None = None,
    since: Mapping[str, int] | None = None,
    young_after: int | None = None,
) -> list[str]:
    """Whom a joiner asks for state, for every driver: live admitted peers that have started (not leaving, not
    paused, not an island follower, which serves no fresh state), none further along than ``slack`` past ``top``
    (the swarm's robust top: one claiming round 10^9 is not asked).

    The order: the peers in ``prefer`` first (the user's ``--initial-peers``: the identities the user chose to
    trust, which minted identities claiming the top round cannot push out of the list); then one peer of each
    network group before a second of any (``groups``: peer -> :func:`netgroup` of its live connections; a peer
    not in it is in ``"?"``), so identities minted behind one address fill one donor slot while other groups
    have peers to ask; within that, the peers within ``slack`` of ``top`` before the others, and among them
    the old before the young: a peer is young when it was first seen alive after round ``young_after``
    (``since``: that round, by us or a peer we trust: ``Host.ages``; a peer nobody we trust has seen is young),
    so identities minted in the last few rounds stand behind peers that have trained for longer, whatever
    round they claim; then nearest to ``top``, further along first, then the one seen alive longest.
    ``progress``: a heartbeat's round (data-parallel) or data clock (a pipeline stage); ``since`` and
    ``young_after`` are rounds. Callers pass ``young_after`` as the swarm's round less
    ``DONOR_MIN_AGE_ROUNDS``."""
    near = [
        b
        for b in beats
        if b.admitted
        and b.started
        and not (b.finished or b.paused)
        and not (b.island and not b.island_rep)
        and progress(b) <= top + slack
    ]
    seen = since or {}

    def key(b: Heartbeat) -> tuple[bool, bool, int, int, int]:
        far = abs(progress(b) - top) > slack
        young = young_after is not None and not far and seen.get(b.peer, MAX_ROUND) > young_after
        return far, young, abs(progress(b) - top), -progress(b), seen.get(b.peer, MAX_ROUND)

    base = sorted(near, key=key)
    taken: dict[str, int] = {}
    rank: dict[str, int] = {}
    for b in base:  # a peer's place within its group: 0 for the best of each group
        g = (groups or {}).get(b.peer, "?")
        rank[b.peer] = taken.get(g, 0)
        taken[g] = rank[b.peer] + 1
    order = sorted(base, key=lambda b: (b.peer not in prefer, rank[b.peer]))  # stable: base order within
    return [b.peer for b in order[:n]]


def observed_time(written: float, now: float, prev: tuple[float, float, float] | None) -> float:
    """A heartbeat's time on the reader's clock, bounded by what the reader saw, not by the writer's clock.

    ``written``: the record's own ``time`` (the writer's clock, which may be off or lie); ``now``: the reader's
    clock at this read; ``prev``: for this peer, the (``written``, result, reader's time) of the read before,
    or None. A version seen before keeps the time it was given. A new version was written after our read of the
    previous one, so it is placed no earlier than that read and no later than now: a writer 30 s behind no longer
    looks stale to every reader (pipeline replicas and island members dropped it), and one ahead of us (or lying)
    no longer stays fresh for a record's whole life. The first version read is trusted up to ``now``."""
    if prev is not None and prev[0] == written:
        return prev[1]
    if prev is None:
        return min(written, now)
    return min(now, max(written, prev[2]))


def live(beats: Iterable[Heartbeat], now: float, fresh_s: float, *, stage: int | None = None) -> list[Heartbeat]:
    """Unfinished peers whose heartbeat is younger than ``fresh_s`` (of one ``stage``, when given). The host
    gives each heartbeat the reader's time (:func:`observed_time`), so a writer's clock does not decide this."""
    return [b for b in beats if not b.finished and now - b.time < fresh_s and (stage is None or b.stage == stage)]


def pick_stage(beats: Iterable[Heartbeat], stages: int, me: str, fresh_s: float = math.inf, now: float = 0.0) -> int:
    """``--stage auto``: the stage with the fewest live replicas (a heartbeat younger than ``fresh_s``; a paused
    replica serves nothing, so it does not count), ties to the lowest."""
    counts = [0] * stages
    for b in live(beats, now, fresh_s):
        if b.peer != me and b.stage is not None and b.stage < stages and not b.paused:
            counts[b.stage] += 1
    return min(range(stages), key=lambda s: (counts[s], s))
