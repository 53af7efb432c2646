"""The simulator's network and compute cost model (alpha-beta, per-worker links).

Each worker i has an uplink and a downlink of ``link_bps * b_i`` bits/s, a one-way
latency ``latency_s``, and computes an inner step in ``step_s / c_i`` seconds. With
heterogeneity X, b_i and c_i are drawn independently as 10^(-X*u), u ~ U(0, 1):
X = 0 is a uniform swarm, X = 1 puts the slowest worker up to 10x below the fastest.

Collectives (S = bytes per worker, N workers, bw_i = min(up_i, down_i)):
    hivemind butterfly all-reduce (DiLoCo, as the daemon runs it):
        T = max_i 2 S (N-1)/N * 8 / bw_i + 2 * latency
    ring all-reduce (DDP, simulator only):  T = 2(N-1) * (latency + (S/N) * 8 / bw_min)
Direct exchanges (NoLoCo, GASLoC, SparseLoCo: the daemon's pushes) go through the fluid
flow model of ``sim/flows.py``. How rounds follow each other (the daemon's overlap and
deadlines) is ``sim/timeline.py``, which imports this module (never the other way).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_LINK_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?(/s)?\s*$", re.IGNORECASE)
_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_link(text: str) -> float:
    """'80mbit', '1gbit', '10Gbit/s', '500kbit' -> bits per second."""
    m = _LINK_RE.match(text)
    if not m:
        raise ValueError(f"cannot read link speed {text!r}; write e.g. 80mbit, 1gbit, 10gbit")
    bps = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if bps <= 0:
        raise ValueError(f"link speed must be positive, got {text!r}")
    return bps


@dataclass(frozen=True)
class NetworkModel:
    """Per-worker link and compute speeds."""

    up_bps: tuple[float, ...]
    down_bps: tuple[float, ...]
    speed: tuple[float, ...]
    latency_s: float
    step_s: float
    """Seconds per inner step on a speed-1.0 worker."""

    @classmethod
    def build(
        cls, workers: int, *, link_bps: float, latency_s: float, heterogeneity: float, step_s: float, seed: int = 0
    ) -> NetworkModel:
        if not 0 <= heterogeneity <= 3:
            raise ValueError(f"heterogeneity must be in [0, 3], got {heterogeneity}")
        rng = np.random.Generator(np.random.PCG64([seed, 0xBEEF]))
        bw = 10 ** (-heterogeneity * rng.random(workers))
        speed = 10 ** (-heterogeneity * rng.random(workers))
        links = tuple(float(link_bps * b) for b in bw)
        return cls(
            up_bps=links, down_bps=links, speed=tuple(float(s) for s in speed), latency_s=latency_s, step_s=step_s
        )

    def compute_s(self, worker: int, steps: int) -> float:
        return steps * self.step_s / self.speed[worker]

    @property
    def up_Bps(self) -> tuple[float, ...]:
        return tuple(b / 8 for b in self.up_bps)

    @property
    def down_Bps(self) -> tuple[float, ...]:
        return tuple(b / 8 for b in self.down_bps)

    def butterfly_allreduce_s(self, members: Sequence[int], nbytes: float) -> float:
        """hivemind's AllReduceRunner with equal parts: every member's uplink and downlink carry
        2 S (N-1)/N (its parts out and their averages back in; the parts it reduces in and their
        averages out), all pairs at once and chunk by chunk, so the slowest member sets the time."""
        n = len(members)
        if n < 2:
            return 0.0
        load = 2 * nbytes * (n - 1) / n * 8
        return max(load / min(self.up_bps[m], self.down_bps[m]) for m in members) + 2 * self.latency_s

    def ring_allreduce_s(self, members: Sequence[int], nbytes: float) -> float:
        n = len(members)
        if n < 2:
            return 0.0
        bw = min(min(self.up_bps[m], self.down_bps[m]) for m in members)
        return 2 * (n - 1) * (self.latency_s + nbytes / n * 8 / bw)

    def ring_allgather_s(self, members: Sequence[int], nbytes: Mapping[int, float]) -> float:
        n = len(members)
        if n < 2:
            return 0.0
        total = sum(nbytes[m] for m in members)
        worst = max((total - nbytes[m]) * 8 / min(self.up_bps[m], self.down_bps[m]) for m in members)
        return (n - 1) * self.latency_s + worst

    def direct_exchange_s(
        self, me: int, peers: Sequence[int], nbytes: Mapping[int, float], degree: Mapping[int, int]
    ) -> float:
        if not peers:
            return 0.0
        up = nbytes[me] * len(peers) * 8 / self.up_bps[me]
        down = sum(nbytes[j] for j in peers) * 8 / self.down_bps[me]
        senders = max(nbytes[j] * max(1, degree.get(j, 1)) * 8 / self.up_bps[j] for j in peers)
        return self.latency_s + max(up, down, senders)


@dataclass
class RoundRecord:
    """What one round put on the network (the replayable part of a simulation)."""

    steps: int
    """Inner steps each worker computed before the exchange."""
    bytes_sent: dict[int, float]
    """Bytes each worker sent to EACH of its peers (direct) or its contribution (collective)."""
    kind: str
    """'direct' (the daemon's pushes), 'butterfly' (hivemind's all-reduce) or 'allreduce' (a ring, DDP)."""
    peers: dict[int, list[int]]
    """For 'direct': each worker's peers this round (absent or empty: no exchange)."""
    members: list[int]
    raw_bytes: dict[int, float] | None = None
    """Each worker's payload before coding (what the daemon's ETA assumes); None: = bytes_sent."""
    answered: dict[int, list[int]] | None = None
    """Whose payload each worker used, when the run had a network (None: everyone's)."""


def round_done(tl: Any, overlap: bool) -> list[float]:
    """``Timeline.round_done`` (``sim/timeline.py``), under the name old callers import from here."""
    return tl.round_done(overlap)


def flops_step_s(params: int, tokens_per_step: int, tflops: float) -> float:
    """Seconds per inner step at ``tflops`` effective: 6 FLOPs per parameter per token."""
    if tflops <= 0 or math.isnan(tflops):
        raise ValueError(f"tflops must be positive, got {tflops}")
    return 6 * params * tokens_per_step / (tflops * 1e12)
