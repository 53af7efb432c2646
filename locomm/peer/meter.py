"""Progress of one stream (bytes done of the declared total, rate, ETA), and the clock type of the exchange layer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Clock = Callable[[], float]
"""A source of "now" in seconds (``time.monotonic``; a virtual-time loop's ``time`` in tests)."""


@dataclass
class Meter:
    """Progress of one stream, for the live display, ETAs and the upload-rate estimate."""

    peer: str
    direction: str  # "send" | "recv"
    total: int = 0
    done: int = 0
    t0: float = field(default_factory=time.monotonic)  # a Link resets both from its clock
    last: float = field(default_factory=time.monotonic)

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
