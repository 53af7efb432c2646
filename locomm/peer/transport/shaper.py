"""A volunteer's traffic cap: one token bucket per direction, shared by every stream of the peer.

``locomm-peer join --max-upload-mbit X --max-download-mbit Y`` makes one :class:`Shaper`; the host hands it
to its :class:`~locomm.peer.transport.rpc.RpcServer`, which attaches it to its P2P instance, so every
:class:`~locomm.peer.transport.rpc.Link` on that P2P (served streams, and the client links ``open_link`` / ``request``
open: gossip pushes and pulls, state sync serving and fetching, stage frames, replica syncs) takes its bytes
from the same two buckets. Four parallel pushes under a 20 Mbit/s cap share 20 Mbit/s.

Notable:
- **FIFO by reservation.** A taker reserves its bytes at once (the bucket may go into debt) and sleeps until
  the debt it joined is paid, so takers are served in the order they asked, with no lock and no polling; a
  cancelled taker gives its reservation back. Links take at most ``SLICE`` bytes at a time, before each
  write and after each read (on reads, the TCP / yamux window carries the backpressure to the sender).
- **Our own throttling is not the partner's slowness.** Time a Link spends waiting on the bucket is not
  counted as waiting on the wire (floor-rate windows, stalls) and moves its size deadline back by as much.
  The partner, though, cannot tell a capped peer from a slow one: its deadlines hold each transfer (all the
  streams of one push together) to the swarm's floor ``network.min_rate_mbit``. Hence :meth:`Shaper.check`
  (a cap below the floor is refused at start) and :meth:`Shaper.max_concurrent` (how many transfers may run
  at once in one direction and each keep the floor).
- **Outside the cap:** the DHT's own traffic (small signed records, p2pd's routing) and DiLoCo's hivemind
  averager (``averaging.py``: its own p2pd, not on our Links). hivemind's ``DecentralizedAverager(bandwidth=)``
  is only a load-balancing weight for the all-reduce, not a rate limit.
- ``None`` in a direction: no bucket, and a Link does not even await it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import weakref
from typing import Any

from locomm.config.base import ConfigError
from locomm.peer.transport.meter import Clock

SLICE = 1 << 16
"""The most bytes a Link moves per token-taking under a cap: keeps the bucket's output smooth."""
BURST_S = 0.25
"""Default depth of a bucket, in seconds of its rate: the most a quiet peer may send at once."""
HEADROOM = 1.25
""":meth:`Shaper.max_concurrent` gives each transfer this much more than the floor: exactly the floor would be
cut by the first hiccup (or by a state-sync request served alongside)."""


class Bucket:
    """One direction's token bucket: ``rate_Bps`` bytes per second, at most ``rate_Bps * burst_s`` saved up."""

    def __init__(self, rate_Bps: float, burst_s: float, clock: Clock) -> None:
        self.rate = rate_Bps
        self.depth = rate_Bps * burst_s
        self.clock = clock
        self.tokens = self.depth
        self.stamp = clock()
        self.granted = 0
        """Bytes handed out so far (its meter: ``granted`` over a long window is the rate held)."""
        self.waiting = 0
        """Takers asleep on the bucket now."""

    def reserve(self, n: int) -> float:
        """Take ``n`` bytes of tokens now (into debt if need be); the seconds until the debt is paid."""
        now = self.clock()
        self.tokens = min(self.depth, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= n
        self.granted += n
        return -self.tokens / self.rate if self.tokens < 0 else 0.0

    async def take(self, n: int) -> float:
        """Sleep until ``n`` bytes of tokens are ours (FIFO with every other taker); the seconds slept."""
        wait = self.reserve(n)
        if wait <= 0:
            return 0.0
        self.waiting += 1
        try:
            await asyncio.sleep(wait)
        except asyncio.CancelledError:
            self.tokens += n  # nothing went out: give the reservation back
            self.granted -= n
            raise
        finally:
            self.waiting -= 1
        return wait


class Shaper:
    """The peer's upload and download caps (Mbit/s; ``None``: unlimited)."""

    def __init__(
        self,
        up_mbit: float | None,
        down_mbit: float | None,
        *,
        clock: Clock = time.monotonic,
        burst_s: float = BURST_S,
    ) -> None:
        for name, v in (("--max-upload-mbit", up_mbit), ("--max-download-mbit", down_mbit)):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number of Mbit/s, got {v}")
        if not (math.isfinite(burst_s) and burst_s > 0):
            raise ConfigError(f"burst_s must be positive, got {burst_s}")
        self.up_mbit, self.down_mbit = up_mbit, down_mbit
        self.up = Bucket(up_mbit * 1e6 / 8, burst_s, clock) if up_mbit is not None else None
        self.down = Bucket(down_mbit * 1e6 / 8, burst_s, clock) if down_mbit is not None else None
        self._gates: dict[tuple[str, int], asyncio.Semaphore] = {}

    @property
    def limited(self) -> bool:
        return self.up is not None or self.down is not None

    async def send(self, n: int) -> float:
        """Wait for ``n`` bytes of upload tokens; the seconds waited."""
        return await self.up.take(n) if self.up is not None else 0.0

    async def recv(self, n: int) -> float:
        """Take ``n`` bytes of download tokens (after reading them); the seconds waited."""
        return await self.down.take(n) if self.down is not None else 0.0

    def max_concurrent(self, floor_Bps: float, direction: str = "up") -> int | None:
        """How many transfers may run at once in ``direction`` with each kept ``HEADROOM`` above the floor
        ``floor_Bps`` (a partner holds all the streams of one transfer together to it), at least one;
        ``None``: no cap, no bound."""
        bucket = self.up if direction == "up" else self.down
        if bucket is None or floor_Bps <= 0:
            return None
        return max(1, int(bucket.rate / (HEADROOM * floor_Bps) + 1e-9))

    def gate(self, floor_Bps: float, direction: str = "up") -> contextlib.AbstractAsyncContextManager[Any]:
        """One of the peer's ``max_concurrent(floor_Bps, direction)`` slots for a transfer: ``async with
        shaper.gate(floor):`` around each push keeps every one at the floor (a no-op without a cap)."""
        k = self.max_concurrent(floor_Bps, direction)
        if k is None:
            return contextlib.nullcontext()
        key = (direction, k)
        if key not in self._gates:
            self._gates[key] = asyncio.Semaphore(k)
        return self._gates[key]

    def check(self, network: Any) -> None:
        """Refuse, at start, a cap below ``HEADROOM`` x the swarm's floor rate (``network.min_rate_mbit`` of the run
        spec): partners would cut transfers of ours held at the floor. Raises ConfigError with the fix."""
        floor = float(network.min_rate_mbit)
        need = HEADROOM * floor
        for flag, cap, who in (
            ("--max-upload-mbit", self.up_mbit, "partners would cut your uploads (pushes, served state sync)"),
            ("--max-download-mbit", self.down_mbit, "senders would cut their transfers to you"),
        ):
            if cap is not None and floor > 0 and cap < need:
                raise ConfigError(
                    f"{flag} {cap:g} is below {HEADROOM:g}x the swarm's floor rate network.min_rate_mbit={floor:g}: "
                    f"{who}; raise the cap to at least {need:g}, or join a run whose spec sets a lower floor"
                )

    def view(self) -> dict[str, Any]:
        """For metrics and status: the caps and the bytes granted so far."""
        return {
            "max_upload_mbit": self.up_mbit,
            "max_download_mbit": self.down_mbit,
            "up_granted": self.up.granted if self.up else None,
            "down_granted": self.down.granted if self.down else None,
        }


_ATTACHED: weakref.WeakKeyDictionary[Any, Shaper] = weakref.WeakKeyDictionary()


def attach(p2p: Any, shaper: Shaper) -> None:
    """Make ``shaper`` the one every Link on ``p2p`` uses (``RpcServer(shaper=...)`` does this)."""
    _ATTACHED[p2p] = shaper


def shaper_of(p2p: Any) -> Shaper | None:
    """The shaper attached to ``p2p``, if any."""
    try:
        return _ATTACHED.get(p2p)
    except TypeError:  # not weak-referenceable (a test double): never attached
        return None
