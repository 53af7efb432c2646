"""Routing of micro-batches to replicas of the next stage (sans-IO: ids in, a choice out).

Each micro-batch picks its next hop at random among the live replicas, seeded by
(run seed, origin, micro-batch id, stage, attempt), so a run's routes are reproducible
and the simulator and a real swarm draw the same way (NoLoCo's random routing). A
re-route after a timeout or a dead replica draws again among the replicas not tried
yet. ``weights`` (e.g. measured throughput) bias the draw, as SWARM does; the default
is uniform.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence


def route(
    seed: int,
    origin: str | int,
    mb: int,
    stage: int,
    replicas: Sequence[str | int],
    *,
    attempt: int = 0,
    exclude: Sequence[str | int] = (),
    weights: Mapping[str | int, float] | None = None,
) -> str | int | None:
    """The replica of ``stage`` that micro-batch ``mb`` from ``origin`` goes to (None: no candidate left)."""
    candidates = sorted((r for r in replicas if r not in set(exclude)), key=str)
    if not candidates:
        return None
    rng = random.Random(f"{seed}/{origin}/{mb}/{stage}/{attempt}")
    if weights:
        w = [max(0.0, float(weights.get(r, 0.0))) for r in candidates]
        if sum(w) > 0:
            return rng.choices(candidates, weights=w, k=1)[0]
    return candidates[rng.randrange(len(candidates))]
