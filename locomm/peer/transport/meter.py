"""Progress of one stream (bytes done of the declared total, rate, ETA), the clock type and the outcomes of the
exchange layer that are not faults (a cut transfer, an unreachable peer)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Clock = Callable[[], float]
"""A source of "now" in seconds (``time.monotonic``; a virtual-time loop's ``time`` in tests)."""


class TransferCut(Exception):
    """A transfer stalled, ran past its deadline, or fell below the floor rate (not a fault)."""


class Unreachable(Exception):
    """The peer could not be dialled (behind NAT, gone): not a fault."""


class NotServed(Unreachable):
    """The peer was reached (libp2p's secure channel completed with the holder of its key) and runs no such
    service: another run, a peer shutting down, or an identity that answers hellos and serves nothing (a Sybil
    counted as a member). Not a fault when it is unreachable's cause; a partner of this round's exchange that
    runs none is one (``Gossip.exchange``): it announced itself a member of a round it does not take part in."""

    MARK = "protocols not supported"
    """What p2pd says when the remote side has no handler for the protocol (``failed to negotiate protocol``)."""


class FloorWindow:
    """The floor-rate check of one stream: over any ``window_s`` of waiting on the wire, at least the floor.

    Only time spent waiting on the wire counts (not decoding or encoding, not our own traffic cap)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.waited = 0.0
        self.moved = 0
        self._marks: deque[tuple[float, int]] = deque([(0.0, 0)])

    def add(self, n: int, waited: float, floor_Bps: float) -> None:
        """``n`` bytes moved after ``waited`` s on the wire; raises TransferCut below ``floor_Bps``."""
        self.waited += waited
        self.moved += n
        self._marks.append((self.waited, self.moved))
        while len(self._marks) > 2 and self._marks[1][0] <= self.waited - self.window_s:
            self._marks.popleft()
        w0, b0 = self._marks[0]
        span = self.waited - w0
        if span >= self.window_s and (self.moved - b0) < floor_Bps * span:
            raise TransferCut(
                f"{(self.moved - b0) / span * 8 / 1e6:.2f} Mbit/s over {span:.0f} s, "
                f"below the floor of {floor_Bps * 8 / 1e6:.2f} Mbit/s"
            )


BUSY_FRACTION = 0.5
"""A direction of our link is busy while its streams together move at least this fraction of the most it was
seen to move (and at least the floor rate)."""


class LinkLoad:
    """What one direction of this peer's link moves, every stream together: the rate over the last window and
    the most seen over a whole window (the link's measured rate).

    A stream below the floor rate on a busy link is sharing it (congestion: three 190 MB flows through one
    80 Mbit/s link get about 27 Mbit/s each, and TCP does not share fairly), not talking to a slow peer, so the
    floor is not applied to it (:meth:`busy`); a stalled stream is still cut by the stall timeout, and every
    transfer by its size deadline. A lone trickle never makes the link busy: it moves less than the floor."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._marks: deque[tuple[float, int]] = deque()
        self._sum = 0
        self._since: float | None = None
        self.peak_Bps = 0.0

    def _trim(self, now: float) -> None:
        while self._marks and self._marks[0][0] <= now - self.window_s:
            self._sum -= self._marks.popleft()[1]
        if not self._marks:
            self._since = None  # idle for a whole window: the next burst is measured afresh

    def add(self, now: float, n: int) -> None:
        self._trim(now)
        if self._since is None:
            self._since = now
        self._marks.append((now, n))
        self._sum += n
        if now - self._since >= self.window_s:  # a whole window of traffic: a measure of the link
            self.peak_Bps = max(self.peak_Bps, self._sum / self.window_s)

    def rate_Bps(self, now: float) -> float:
        """Bytes per second over the last window (or since traffic began, if that is shorter)."""
        self._trim(now)
        if self._since is None:
            return 0.0
        return self._sum / max(1e-3, min(self.window_s, now - self._since))

    def busy(self, now: float, floor_Bps: float) -> bool:
        rate = self.rate_Bps(now)
        return rate >= floor_Bps and rate >= BUSY_FRACTION * self.peak_Bps


@dataclass
class Meter:
    """Progress of one stream, for the live display, ETAs and the upload-rate estimate."""

    peer: str
    direction: str  # "send" | "recv"
    total: int = 0
    done: int = 0
    t0: float = field(default_factory=time.monotonic)  # a Link resets both from its clock
    last: float = field(default_factory=time.monotonic)
    throttled_s: float = 0.0
    """Time this stream waited on the peer's own traffic cap (``shaper.py``), inside ``last - t0``."""

    @property
    def rate_Bps(self) -> float:
        dt = self.last - self.t0
        return self.done / dt if dt > 0 else 0.0

    def view(self) -> dict[str, Any]:
        rate = self.rate_Bps
        left = max(0, self.total - self.done)
        return {
            "peer": self.peer[-8:],
            "direction": self.direction,
            "done": self.done,
            "total": self.total,
            "rate_bps": rate,
            "eta_s": left / rate if rate > 0 else None,
        }
