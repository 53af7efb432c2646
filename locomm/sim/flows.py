"""A fluid model of concurrent transfers: max-min fair sharing of every peer's uplink and downlink.

Each transfer (a ``Flow``) runs from ``start`` at the rate progressive filling gives it: all active
flows' rates grow together until a link (a sender's uplink or a receiver's downlink) is full, the
flows through that link freeze, and the rest grow on (TCP flows sharing a bottleneck come close to
this). Rates change only when a flow starts, ends or is cut, so the run is a short event loop.

The daemon's byte-sized deadlines (``protocol.timing.Limits``, as ``rpc.Link`` applies them) act on
each flow:
- floor rate: over any ``rate_window_s`` of the transfer it must move ``min_rate_Bps * rate_window_s``
  bytes, or it is cut (checked at event times and every window/8 while a flow runs below the floor);
- size deadline: it must end within ``Limits.deadline_s(nbytes)`` of its start.
A stall (no bytes for ``stall_timeout_s``) cannot happen in a fluid model: an active flow always moves.

Flows that share no link are independent, so ``run_flows`` splits them into connected components
first (NoLoCo pairs and GASLoC matchings are components of two flows each).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from locomm.protocol.timing import Limits


@dataclass
class Flow:
    src: int
    dst: int
    nbytes: float
    start: float
    done: float = math.inf
    """Time the last byte arrived (inf: cut, or never)."""
    cut: float = math.inf
    """Time the receiver's deadlines cut the transfer off (inf: not cut)."""
    history: list[tuple[float, float]] = field(default_factory=list)
    after: Flow | None = None
    """Starts in turn after this flow (the daemon's pushes, ``gossip.Gossip._pushes_in_turn``): when it ended
    (done or cut), or ``turn_s`` after it began, whichever comes first, and never before ``start``. Must share
    this flow's component (the same sender)."""
    turn_s: float = math.inf

    def moved_at(self, t: float) -> float:
        """Bytes moved by time ``t`` (piecewise linear between recorded events)."""
        h = self.history
        if not h or t <= h[0][0]:
            return 0.0
        for (t0, b0), (t1, b1) in zip(h, h[1:]):
            if t <= t1:
                return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else b1
        return h[-1][1]


def FlowLimits(  # noqa: N802 - the old class's name, for old callers
    *, floor_Bps: float = 0.0, window_s: float = math.inf, request_timeout_s: float = math.inf
) -> Limits:
    """Only the per-transfer deadlines (floor rate, window, size deadline's slack) as ``Limits``."""
    return Limits(
        request_timeout_s=request_timeout_s,
        stall_timeout_s=math.inf,
        min_rate_Bps=floor_Bps,
        rate_window_s=window_s,
        max_wait_s=math.inf,
    )


def maxmin_rates(src: np.ndarray, dst: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """Max-min fair rates (bytes/s) of flows src[i] -> dst[i] under per-node up/down capacities."""
    n = len(src)
    rate = np.zeros(n)
    frozen = np.zeros(n, dtype=bool)
    cap_up = up.astype(float).copy()
    cap_down = down.astype(float).copy()
    while not frozen.all():
        live = ~frozen
        n_up = np.bincount(src[live], minlength=len(up)).astype(float)
        n_down = np.bincount(dst[live], minlength=len(down)).astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            share_up = np.where(n_up > 0, cap_up / n_up, np.inf)
            share_down = np.where(n_down > 0, cap_down / n_down, np.inf)
        inc = min(share_up.min(), share_down.min())
        rate[live] += inc
        cap_up -= inc * n_up
        cap_down -= inc * n_down
        full_up = cap_up <= 1e-9 * np.maximum(up, 1.0)
        full_down = cap_down <= 1e-9 * np.maximum(down, 1.0)
        frozen |= full_up[src] | full_down[dst]
    return rate


def _components(flows: Sequence[Flow]) -> list[list[int]]:
    """Groups of flow indices that share a link (union-find over uplinks and downlinks)."""
    parent: dict[tuple[str, int], tuple[str, int]] = {}

    def find(x: tuple[str, int]) -> tuple[str, int]:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for f in flows:
        a, b = find(("u", f.src)), find(("d", f.dst))
        if a != b:
            parent[a] = b
    groups: dict[tuple[str, int], list[int]] = {}
    for i, f in enumerate(flows):
        groups.setdefault(find(("u", f.src)), []).append(i)
    return list(groups.values())


def run_flows(
    flows: Sequence[Flow], up_Bps: Sequence[float], down_Bps: Sequence[float], limits: Limits | None = None
) -> None:
    """Fill in each flow's ``done`` (or ``cut``) time, in place."""
    up, down = np.asarray(up_Bps, dtype=float), np.asarray(down_Bps, dtype=float)
    limits = limits if limits is not None else Limits.never()
    for comp in _components(flows):
        _run_component([flows[i] for i in comp], up, down, limits)


def _release(flows: list[Flow], prev: list[int], start: np.ndarray, t: float) -> None:
    """Set the start of every flow whose turn has come by ``t`` (its predecessor ``flows[prev[i]]`` ended, or
    began ``turn_s`` ago); a release can release the next one at the same instant (an empty predecessor)."""
    changed = True
    while changed:
        changed = False
        for i, (f, j) in enumerate(zip(flows, prev)):
            if j < 0 or math.isfinite(start[i]) or not math.isfinite(start[j]):
                continue
            turn = min(flows[j].done, flows[j].cut, start[j] + f.turn_s)
            if turn <= t + 1e-12:
                start[i] = max(f.start, turn)
                changed = True


def _next_turn(flows: list[Flow], prev: list[int], start: np.ndarray) -> float:
    """The earliest instant a flow still waiting for its turn is released by its predecessor's ``turn_s``."""
    times = [
        max(f.start, start[j] + f.turn_s)
        for i, (f, j) in enumerate(zip(flows, prev))
        if j >= 0 and not math.isfinite(start[i]) and math.isfinite(start[j])
    ]
    return min(times, default=math.inf)


def _run_component(flows: list[Flow], up: np.ndarray, down: np.ndarray, limits: Limits) -> None:
    left = np.array([f.nbytes for f in flows], dtype=float)
    index = {id(f): i for i, f in enumerate(flows)}
    prev = [-1 if f.after is None else index[id(f.after)] for f in flows]
    start = np.array([f.start if f.after is None else math.inf for f in flows])
    src = np.array([f.src for f in flows])
    dst = np.array([f.dst for f in flows])
    open_ = np.ones(len(flows), dtype=bool)  # neither finished nor cut
    floor, window = limits.min_rate_Bps, limits.rate_window_s
    checks: set[float] = set()
    begun = np.zeros(len(flows), dtype=bool)

    def begin(t: float) -> None:
        """Flows whose start is now known: their history, deadlines and floor checks (an empty one is done)."""
        _release(flows, prev, start, t)
        for i, f in enumerate(flows):
            if begun[i] or not math.isfinite(start[i]):
                continue
            begun[i] = True
            f.start = float(start[i])
            f.history = [(f.start, 0.0)]
            if f.nbytes <= 0:
                f.done = f.start
                open_[i] = False
            elif floor > 0:
                checks.add(f.start + window)

    t = float(start[np.isfinite(start)].min()) if np.isfinite(start).any() else 0.0
    begin(t)
    size_deadline = np.array([limits.deadline_s(float(n)) for n in left])  # after each flow's start
    while open_.any():
        begin(t)
        active = open_ & (start <= t + 1e-12)
        if not active.any():
            t = min(float(start[open_].min()), _next_turn(flows, prev, start))
            if not math.isfinite(t):
                break  # only flows whose predecessor never starts: they never start either
            continue
        idx = np.flatnonzero(active)
        rates = maxmin_rates(src[idx], dst[idx], up, down)
        finish = left[idx] / rates
        candidates = [t + float(finish.min()), _next_turn(flows, prev, start)]
        later = start[open_ & ~active]
        if len(later):
            candidates.append(float(later.min()))
        if floor > 0:
            candidates.append(float((start[idx] + size_deadline[idx]).min()))
            candidates += [c for c in checks if c > t + 1e-12]
            if (rates < floor).any():
                candidates.append(t + window / 8)
        t_next = max(min(candidates), t + 1e-12)
        dt = t_next - t
        left[idx] -= rates * dt
        t = t_next
        for i in idx:
            f = flows[i]
            f.history.append((t, f.nbytes - max(0.0, left[i])))
            if left[i] <= 1e-6 * max(1.0, f.nbytes):
                f.done = t
                open_[i] = False
            elif floor > 0 and (
                t >= start[i] + size_deadline[i] - 1e-12
                or (
                    t - f.start >= window - 1e-9
                    and f.history[-1][1] - f.moved_at(t - window) < floor * window * (1 - 1e-9)
                )
            ):
                f.cut = t
                open_[i] = False
