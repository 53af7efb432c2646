"""The waiting rules both transports follow: one ``Limits``, the partner ETA and the EMAs.

Sans-IO: no clock is read here. Every function takes the time it needs (``now``) and
answers in the same clock, so the daemon passes ``time.time()`` and the simulator its
virtual time, and both get the same decision from the same numbers.

Notable:
- ``Limits`` holds the byte-sized deadlines of ``[network]`` (``config.NetworkConfig``).
  A transfer is cut off when it stalls (no byte for ``stall_timeout_s``), when it runs
  past its declared size at the floor rate (``deadline_s``), or when, over any
  ``rate_window_s`` of waiting, it moved less than the floor. The RPC layer
  (``peer/transport/rpc.py``), the fluid flow model (``sim/flows.py``) and the simulator's
  timeline (``sim/timeline.py``) all read this one class. ``Limits.never()`` waits
  forever (a simulator without deadlines).
- ``partner_eta``: when a partner's payload of round r should have arrived, from what
  its heartbeat says (its round, when that round's compute began, its round time, its
  upload rate, its number of partners):
      ready  = now                               if it has sent round r already
             = round_t0 + (r - round + 1) * round_s   otherwise
      arrive = max(ready, now) + wire_bytes * partners / up_Bps
      eta    = arrive + stall_timeout_s + round_s / 4     (slack: a stall, compute jitter)
  and ``now`` (no wait) once its round is ``PASSED_ROUNDS`` past r: it has applied r
  and dropped that payload.
  A worker pulls it once that time has passed with nothing arriving (``wait_deadline``).
- ``give_up_at``: the round deadline. Nobody waits past it for a partner's payload, moving
  or not: ``min(start + max_wait_s, eta + deadline_s(wire_bytes))``. ``serve_until``: a
  sender serves a round's payload to pullers until ``start + max_wait_s``, no longer.
- ``PartnerWait``: the push/pull decision of one receiver for one partner and round (pull at
  once when a push broke or the partner asks to be pulled; give up at the round deadline).
- ``ema``: the heartbeat's round time and upload rate are ``0.7 * old + 0.3 * new``
  (the first sample taken as is).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

EMA_KEEP = 0.7
"""Weight of the old value in the round-time and upload-rate averages."""
ETA_JITTER_ROUNDS = 0.25
"""Slack in a partner's ETA for jitter in its compute, in rounds of its own."""
PASSED_ROUNDS = 2
"""A partner whose heartbeat round is this far past r has applied round r (one round late) and dropped its
payload of r: nobody waits for it."""
MIN_OWN_ROUND_S = 1.0
"""A partner that published no round time is assumed to take our own, at least this long."""


@dataclass(frozen=True)
class Limits:
    """The deadlines of every transfer and every wait on a peer (``[network]`` of the run spec)."""

    request_timeout_s: float = 30.0
    """Bound on a small request; also the slack on top of a transfer's size deadline."""
    stall_timeout_s: float = 20.0
    """A transfer with no byte moved for this long is cut off."""
    min_rate_Bps: float = 10e6 / 8
    """Floor rate of a transfer, bytes/s (0: no floor, no size deadline)."""
    rate_window_s: float = 30.0
    """Over any window this long a transfer must move ``min_rate_Bps * rate_window_s`` bytes."""
    max_streams_per_peer: int = 16
    """Open streams one remote peer may hold at once."""
    max_inbound_streams: int = 256
    """Open inbound streams a peer serves at once, from everyone together (peer ids are free)."""
    max_wait_s: float = 600.0
    """The most a worker waits for a partner's payload, whatever the partner's ETA says."""

    @classmethod
    def from_network(cls, cfg: Any) -> Limits:
        """The limits a run spec's ``[network]`` section (``config.NetworkConfig``) sets."""
        return cls(
            request_timeout_s=cfg.request_timeout_s,
            stall_timeout_s=cfg.stall_timeout_s,
            min_rate_Bps=cfg.min_rate_mbit * 1e6 / 8,
            rate_window_s=cfg.rate_window_s,
            max_streams_per_peer=cfg.max_streams_per_peer,
            max_inbound_streams=cfg.max_inbound_streams,
            max_wait_s=cfg.max_wait_s,
        )

    @classmethod
    def never(cls) -> Limits:
        """No deadline at all: every transfer completes, every wait lasts (a simulator without limits)."""
        inf = math.inf
        return cls(
            request_timeout_s=inf,
            stall_timeout_s=inf,
            min_rate_Bps=0.0,
            rate_window_s=inf,
            max_streams_per_peer=2**31 - 1,
            max_inbound_streams=2**31 - 1,
            max_wait_s=inf,
        )

    def deadline_s(self, nbytes: float, streams: int = 1) -> float:
        """How long ``nbytes`` may take on one of ``streams`` parallel streams at the floor rate."""
        if self.min_rate_Bps <= 0:
            return math.inf
        return self.request_timeout_s + nbytes * max(1, streams) / self.min_rate_Bps

    def allreduce_deadline_s(self, payload_bytes: float) -> float:
        """Deadline of a butterfly all-reduce of ``payload_bytes`` per member: each member sends and
        receives 2 S (N - 1) / N < 2 S bytes, at no less than the floor rate."""
        return self.deadline_s(2 * payload_bytes)


def ema(old: float, new: float, keep: float = EMA_KEEP) -> float:
    """``keep * old + (1 - keep) * new``; the first sample (``old == 0``) is taken as is."""
    return new if old == 0 else keep * old + (1 - keep) * new


DECLARED_PACE_SLACK = 2.0
"""A partner's declared round time is taken up to this many times the pace its round counter showed us (a peer
that slowed down, e.g. by sharing its GPU, is within it; a liar declaring hours is not)."""


def partner_eta(
    *,
    round_idx: int,
    partner_round: int | None,
    round_t0: float | None,
    round_s: float | None,
    up_Bps: float | None,
    partners: int | None,
    own_round_s: float,
    wire_bytes: float,
    limits: Limits,
    now: float,
    observed_round_s: float | None = None,
) -> float:
    """The time (``now``'s clock) by which a partner's payload of ``round_idx`` should be here.

    Args:
        round_idx: the round whose payload we wait for.
        partner_round: the round counter of the partner's last heartbeat (it counts one past a round once it
            has planned, and so sent, that round); None: no heartbeat seen (taken as computing ``round_idx``).
        round_t0: when the partner's current round's compute began (None: ``now``; 0 is a time like any other).
        round_s: the partner's average round time (None or 0: ours, at least ``MIN_OWN_ROUND_S``).
        up_Bps: the partner's measured upload rate (None, 0 or below the floor: the floor rate; no floor and
            none given: no upload time).
        partners: to how many partners the partner sends (None or < 1: one).
        own_round_s: our own average round time.
        wire_bytes: the payload's size before coding (the upper bound the receiver knows).
        limits: the run's limits (the stall timeout is part of the slack).
        now: the present, in the clock of ``round_t0`` and of the answer.
        observed_round_s: the partner's round time as this reader measured it (its round counter's pace on our
            clock); the declared ``round_s`` is taken up to ``DECLARED_PACE_SLACK`` times it. None: not yet
            measured.
    """
    if partner_round is not None and partner_round >= round_idx + PASSED_ROUNDS:
        # It has applied round_idx and dropped its payload: nothing of that round will come, and a pull would
        # find nothing. Waiting for it anyway is how a peer that fell two rounds behind stays behind: its
        # pushes are refused as stale, it waits out every partner's ETA, and they wait out its.
        return now
    own = max(own_round_s, MIN_OWN_ROUND_S)
    round_s = float(round_s or own)
    if observed_round_s is not None and observed_round_s > 0:
        # What a partner declares of its pace is believed only as far as we saw it go: a liar's round time of
        # hours would be waited for max_wait_s every round, never counted as a fault.
        round_s = min(round_s, DECLARED_PACE_SLACK * observed_round_s)
    # A round that began in the future is a lie (or a clock further off than a round): it began by now.
    t0 = now if round_t0 is None else min(float(round_t0), now)
    # Never slower than the floor: a transfer below it is cut anyway, so a partner that declares less (a liar's
    # way to be waited for max_wait_s every round) is waited for as if it uploaded at the floor.
    up = max(float(up_Bps or 0.0), limits.min_rate_Bps) or math.inf
    fan_out = max(1, int(partners or 1))
    rounds_to_go = round_idx - partner_round + 1 if partner_round is not None else 1
    ready = now if rounds_to_go <= 0 else t0 + rounds_to_go * round_s
    arrive = max(ready, now) + wire_bytes * fan_out / up
    return arrive + limits.stall_timeout_s + ETA_JITTER_ROUNDS * round_s


Peer = TypeVar("Peer", str, int)

TURN_SLACK = 1.5
"""A push holds the link alone for at most this many times one payload's time at our measured upload rate."""


def turn_s(wire_bytes: float, up_Bps: float, limits: Limits) -> float:
    """How long one push holds the link alone before the next one starts beside it: ``TURN_SLACK`` payload-times
    at the measured upload rate; before a rate is measured, the request timeout."""
    return TURN_SLACK * wire_bytes / up_Bps if up_Bps > 0 else limits.request_timeout_s


def push_order(me: Peer, peers: Sequence[Peer]) -> list[Peer]:
    """The order of our pushes to ``peers``: by distance after us on the ring of ``me`` and ``peers`` sorted.

    In a group where everyone exchanges with everyone, every member derives the same ring, so at the k-th
    push each member sends to the member k places after it: each receiver takes one flow at a time, and each
    flow has its sender's uplink and its receiver's downlink to itself. Pushed all at once, the flows cross:
    two through each uplink and two into each downlink, and TCP shares them unevenly (3 peers over 80 Mbit/s:
    378 MB each way moved in 46-52 s, 58-65 Mbit/s of 77.5; ``docs/results/links.md``)."""
    ring = sorted({*peers, me})
    at = {p: i for i, p in enumerate(ring)}
    return sorted(peers, key=lambda p: (at[p] - at[me]) % len(ring))


def wait_deadline(start: float, eta: float, limits: Limits) -> float:
    """Until when a worker that began waiting at ``start`` waits for a payload due at ``eta``."""
    return min(start + limits.max_wait_s, eta)


def sibling_wait_s(round_s: float, limits: Limits) -> float:
    """How long a pipeline stage replica waits for its siblings' replica-sync payloads: they step at nearly
    its own rate, so a payload is due within about two rounds and a stall timeout."""
    return min(limits.max_wait_s, limits.stall_timeout_s + 2 * round_s)


def give_up_at(start: float, eta: float, wire_bytes: float, limits: Limits) -> float:
    """The round deadline for one partner's payload: a receiver that began waiting at ``start`` never waits past
    it, whatever is still moving.

    By its ETA the partner's payload should be here, or at least on its way; a transfer on its way at no less
    than the floor rate ends within ``limits.deadline_s(wire_bytes)`` (the deadline a link cuts it at). Never
    past ``start + max_wait_s``."""
    return min(start + limits.max_wait_s, eta + limits.deadline_s(wire_bytes))


def serve_until(start: float, limits: Limits) -> float:
    """Until when a sender that began its exchange at ``start`` serves that round's payload to partners that
    pull it: no receiver waits past ``max_wait_s`` after its own start, and a receiver whose pull finds the
    payload no longer served (``STALE_ROUND``) gives up on it at once."""
    return start + limits.max_wait_s


PULL_RETRY_S = 3.0
"""A failed pull is tried again after this long (the partner may still be encoding, or busy)."""


@dataclass
class PartnerWait:
    """A receiver's wait for one partner's payload of one round: when to pull it, when to give up.

    Every wait has an owner and an end. The receiver pulls as soon as it knows a push will not bring the
    payload (the partner's push broke, cut or reset, with nothing of it moving; or the partner asked to be
    pulled, in its push's answer or in its heartbeat's ``serves``), trying again every ``PULL_RETRY_S`` until
    the partner's ETA. Once the ETA has passed with nothing moving: one pull, and if that fails the round goes
    on without it (a dead partner costs its ETA, not a deadline). It stops waiting when
    the partner refused our push (it will not send either), when it left without serving this round, when its
    pull is answered "no longer served", and at ``give_up`` (:func:`give_up_at`) in any case, transfers moving
    or not.
    """

    due: float
    """The partner's ETA: pull if nothing has come by then."""
    give_up: float
    """The round deadline (never waited past)."""
    broken: bool = False
    """A push from it broke (cut, reset) and none of its streams is moving now."""
    hinted: bool = False
    """It asks to be pulled (a push answer, or its heartbeat lists the round in ``serves``)."""
    ended: str = ""
    """Why nothing will come ("refused", "gone", "not served", "no exchange": it runs none), '' while something may."""
    last_pull: float = -math.inf
    pulling: bool = False
    moved: bool = False
    """Some of its payload came our way this round (a push or pull stream of it began)."""

    def decide(self, now: float, *, moving: bool) -> str:
        """What to do now: "wait", "pull", "drop" (nothing will come: stop without a deadline) or "give up"."""
        if self.ended:
            return "drop"
        if now >= self.give_up:
            return "give up"
        if moving or self.pulling:
            return "wait"
        if now >= self.due:  # overdue with nothing moving: one pull, and if that fails, the round goes on
            return "give up" if self.last_pull >= self.due else "pull"
        wanted = self.broken or self.hinted
        return "pull" if wanted and now - self.last_pull >= PULL_RETRY_S else "wait"

    def next_change(self, now: float) -> float:
        """The next instant ``decide`` may answer differently with no event in between."""
        times = [self.give_up, self.due, self.last_pull + PULL_RETRY_S]  # -inf + retry: never pulled, never next
        return min([t for t in times if t > now], default=self.give_up)


BROKEN_PROMISES = 3
"""Rounds in a row a partner may be planned, waited for and deliver nothing before that is a fault."""


class Promises:
    """Partners that keep promising a payload and delivering none.

    A partner in our plan promises its payload by its ETA (its heartbeat: a round in progress, a pace, an
    upload rate, clamped to what we observed). One that then sends nothing at all, no push begun and no pull
    served, while it is not gone and did not refuse us, broke that promise. ``BROKEN_PROMISES`` of them in a
    row are a fault (``Faults``: bans follow faults), and the count starts again; any round in which something
    of its payload moved resets it (the caller leaves out a partner it could not dial: a dead process, a lost
    route). So a slow partner on a fair share of a busy link (its payload moving, late)
    or a partner that left, paused or sees other groups than ours (it refused our push) is never one, while an
    identity that answers hellos and heartbeats and never sends costs each peer that plans with it
    ``BROKEN_PROMISES`` waits to its ETA per fault instead of one every round for good.
    """

    def __init__(self, limit: int = BROKEN_PROMISES) -> None:
        self.limit = limit
        self.broken: dict[str, int] = {}

    def settle(self, peer: str, wait: PartnerWait, delivered: bool) -> bool:
        """After a round's wait for ``peer``: whether this round makes it a fault."""
        if delivered or wait.moved or wait.ended in ("refused", "gone"):
            self.broken.pop(peer, None)
            return False
        n = self.broken.get(peer, 0) + 1
        if n < self.limit:
            self.broken[peer] = n
            return False
        self.broken.pop(peer, None)
        return True
