"""The simulator's network and compute cost model (alpha-beta, per-worker links).

Each worker i has an uplink and a downlink of ``link_bps * b_i`` bits/s, a one-way
latency ``latency_s``, and computes an inner step in ``step_s / c_i`` seconds. With
heterogeneity X, b_i and c_i are drawn independently as 10^(-X*u), u ~ U(0, 1):
X = 0 is a uniform swarm, X = 1 puts the slowest worker up to 10x below the fastest.

Collectives (S = bytes per worker, N workers, bw_min = the slowest link of the ring):
    ring all-reduce (DDP, DiLoCo):  T = 2(N-1) * (latency + (S/N) * 8 / bw_min)
    ring all-gather (SparseLoCo):   T = (N-1) * latency + max_i (sum_{j != i} S_j) * 8 / bw_i
and both start only when the slowest member is ready (a barrier).

Direct exchange (NoLoCo groups, GASLoC neighbours), worker i with peers P_i, each
peer j sending S_j to each of its deg_j peers through its shared uplink:
    T_i = latency + max( S_i * |P_i| * 8 / up_i,           # i's uplink
                         sum_{j in P_i} S_j * 8 / down_i,  # i's downlink
                         max_{j in P_i} S_j * deg_j * 8 / up_j )  # the slowest sender's uplink
and it starts when i and all of P_i are ready (no global barrier).

Blocking exchange: every algorithm here waits for its round's exchange before the
next inner step (no overlap), so the comparison is like for like.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
    def build(cls, workers: int, *, link_bps: float, latency_s: float, heterogeneity: float, step_s: float,
              seed: int = 0) -> "NetworkModel":
        if not 0 <= heterogeneity <= 3:
            raise ValueError(f"heterogeneity must be in [0, 3], got {heterogeneity}")
        rng = np.random.Generator(np.random.PCG64([seed, 0xBEEF]))
        bw = 10 ** (-heterogeneity * rng.random(workers))
        speed = 10 ** (-heterogeneity * rng.random(workers))
        links = tuple(float(link_bps * b) for b in bw)
        return cls(up_bps=links, down_bps=links, speed=tuple(float(s) for s in speed), latency_s=latency_s,
                   step_s=step_s)

    def compute_s(self, worker: int, steps: int) -> float:
        return steps * self.step_s / self.speed[worker]

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

    def direct_exchange_s(self, me: int, peers: Sequence[int], nbytes: Mapping[int, float],
                          degree: Mapping[int, int]) -> float:
        if not peers:
            return 0.0
        up = nbytes[me] * len(peers) * 8 / self.up_bps[me]
        down = sum(nbytes[j] for j in peers) * 8 / self.down_bps[me]
        senders = max(nbytes[j] * max(1, degree.get(j, 1)) * 8 / self.up_bps[j] for j in peers)
        return self.latency_s + max(up, down, senders)


@dataclass
class Timeline:
    """Per-worker clocks and how each worker's time was spent."""

    clock: list[float]
    compute: list[float]
    comm: list[float]
    idle: list[float]

    @classmethod
    def start(cls, n: int) -> "Timeline":
        return cls([0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n)

    def wall(self) -> float:
        return max(self.clock)

    def idle_fraction(self) -> float:
        wall = self.wall()
        if wall <= 0:
            return 0.0
        # Time a worker spends waiting on others, including after it finished, over all worker-time.
        waiting = sum(i + (wall - c) for i, c in zip(self.idle, self.clock))
        return waiting / (wall * len(self.clock))


@dataclass
class RoundRecord:
    """What one round put on the network (the replayable part of a simulation)."""

    steps: int
    """Inner steps each worker computed before the exchange."""
    bytes_sent: dict[int, float]
    """Bytes each worker sent to EACH of its peers (direct) or its contribution (collective)."""
    kind: str
    """'allreduce', 'allgather' or 'direct'."""
    peers: dict[int, list[int]]
    """For 'direct': each worker's peers this round (absent or empty: no exchange)."""
    members: list[int]


def replay(records: Sequence[RoundRecord], net: NetworkModel, workers: int,
           on_round: "callable | None" = None) -> tuple[Timeline, list[float]]:
    """Simulated wall-clock: per-worker timeline, and the time at which each round was done by all."""
    tl = Timeline.start(workers)
    round_done: list[float] = []
    for rec in records:
        ready = [tl.clock[w] + net.compute_s(w, rec.steps) for w in range(workers)]
        for w in range(workers):
            tl.compute[w] += ready[w] - tl.clock[w]
        if rec.kind in ("allreduce", "allgather"):
            start = max(ready[m] for m in rec.members)
            if rec.kind == "allreduce":
                dur = net.ring_allreduce_s(rec.members, max(rec.bytes_sent[m] for m in rec.members))
            else:
                dur = net.ring_allgather_s(rec.members, rec.bytes_sent)
            for m in rec.members:
                tl.idle[m] += start - ready[m]
                tl.comm[m] += dur
                tl.clock[m] = start + dur
        else:
            degree = {w: len(p) for w, p in rec.peers.items()}
            new_clock = list(ready)
            for w in range(workers):
                peers = rec.peers.get(w, [])
                start = max([ready[w]] + [ready[j] for j in peers])
                dur = net.direct_exchange_s(w, peers, rec.bytes_sent, degree)
                tl.idle[w] += start - ready[w]
                tl.comm[w] += dur
                new_clock[w] = start + dur
            tl.clock = new_clock
        round_done.append(max(tl.clock))
        if on_round:
            on_round(rec, tl)
    return tl, round_done


def flops_step_s(params: int, tokens_per_step: int, tflops: float) -> float:
    """Seconds per inner step at ``tflops`` effective: 6 FLOPs per parameter per token."""
    if tflops <= 0 or math.isnan(tflops):
        raise ValueError(f"tflops must be positive, got {tflops}")
    return 6 * params * tokens_per_step / (tflops * 1e12)
