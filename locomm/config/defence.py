"""The run spec's ``[defence]`` section: how a receiver screens its partners' outer updates.

A frozen, keyword-only dataclass with a docstring per field, validated at construction. The rules it
configures live in :mod:`locomm.protocol.defence` (docs/run-spec.md, ``[defence]``).
"""

from __future__ import annotations

from dataclasses import dataclass

from locomm.config.base import check, choice, positive

DEFENCE_MODES = ("clip", "reject", "off")


@dataclass(frozen=True, kw_only=True)
class DefenceConfig:
    """Poisoning defence for outer updates (one rule per algorithm; locomm/protocol/defence.py)."""

    mode: str = "clip"
    """clip: scale an update that is over its bound down to the bound (NoLoCo/GASLoC: the partner's deviation
    from the receiver's phi; SparseLoCo: the sender's values), and reject it beyond ``reject_factor``;
    reject: drop every update over its bound; off: no screening (finiteness and shapes are still checked by
    the wire layer). A non-finite update is always rejected, and DiLoCo's mean always falls back to the own
    step when it fails its check."""
    factor: float = 3.0
    """An update's bound is ``factor`` x the reference size: the larger of the receiver's own (its own
    distance from phi, its own sparse values) and the running median of accepted ones."""
    reject_factor: float = 30.0
    """In clip mode, an update over ``reject_factor`` x the reference is rejected, not clipped: it carries
    nothing worth keeping. Must be >= factor."""
    window: int = 32
    """Accepted sizes kept for the running median, per receiver (and per tensor for SparseLoCo)."""
    warmup: int = 3
    """Accepted sizes needed before the median counts; until then the reference is the receiver's own."""
    diloco_factor: float = 10.0
    """DiLoCo: the averaged pseudo-gradient falls back to the own one when its norm exceeds this many times
    the own pseudo-gradient's norm (or is not finite). hivemind's averager gives only the mean, so no
    contribution can be attributed or clipped."""

    @property
    def enabled(self) -> bool:
        """Whether updates are screened at all."""
        return self.mode != "off"

    def __post_init__(self) -> None:
        choice(self, "mode", DEFENCE_MODES)
        positive(self, "factor", "window", "diloco_factor")
        check(self.factor >= 1, "factor", f"must be >= 1 (an honest update at the reference passes), got {self.factor}")
        check(
            self.reject_factor >= self.factor,
            "reject_factor",
            f"must be >= factor={self.factor}, got {self.reject_factor}",
        )
        check(self.warmup >= 0, "warmup", f"must be >= 0, got {self.warmup}")
        check(self.warmup <= self.window, "warmup", f"must be <= window={self.window}, got {self.warmup}")
