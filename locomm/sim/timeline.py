"""Per-worker timelines of the daemon's schedule, round by round, with its deadlines.

What a worker does in round r (``peer/dataparallel/node.py: Node._train``), and what this charges for it:

    start_r = plan_{r-1}                 with overlap (default): the exchange of r-1 runs meanwhile
            = end_{r-1}                  without overlap (--no-overlap): it waits for it first
    compute H inner steps                H * step_s / speed_w (with ``apply_delay_steps`` = k > 0:
                                         k steps, wait for end_{r-1}, then H - k steps)
    plan_r  = max(end of compute, end_{r-1})   the previous exchange is applied here, one round late
    end_r   = when round r's exchange is over for this worker (below)

Exchanges, by how the daemon runs them:

- ``direct`` (NoLoCo, GASLoC, SparseLoCo: ``peer/transport/gossip.py``). At plan_r the worker pushes its payload
  to each partner; a push to j starts once j has opened round r - 1 (its receive window) and runs as
  a flow of a max-min fair fluid model of every uplink and downlink (``sim/flows.py``), which also
  applies the byte-sized transfer deadlines (floor rate over a window, size deadline). The worker
  waits for partner p's payload until p's ETA, as the daemon computes it from p's heartbeat (p's
  expected plan time, the payload's raw size times p's partners over p's measured upload rate, plus
  ``stall_timeout_s`` and a quarter of p's round time), at most ``max_wait_s`` after it started
  waiting, and for as long as p's transfer is moving. A partner whose payload is not here by then is
  skipped for the round (its bytes, if they come later, are not used). end_r is when every partner
  has arrived or been skipped and the worker's own pushes are over (``gossip.exchange`` awaits them).
- ``butterfly`` (DiLoCo: hivemind's DecentralizedAverager, ``peer/dataparallel/averaging.py``). Group assembly: a
  worker calls ``step()`` at plan_r; the group (target size = all members) assembles when the last
  member arrives, plus ``MATCHMAKING_LATENCIES`` one-way latencies (DHT declare and lookup, join
  request, the leader's begin message). A member later than ``request_timeout_s`` after the first
  (the step timeout) is left out: it looks for a group until its own timeout and steps alone. The
  all-reduce itself (hivemind's ``AllReduceRunner``, parts of equal size since the daemon passes no
  bandwidth): every member streams part j of its tensors to member j and gets part j's average back,
  all pairs at once, chunk by chunk, so each member's uplink and downlink each carry
  2 * S * (N - 1) / N bytes and everybody waits for the slowest member:
      T = max_i 2 * S * (N - 1) / N / min(up_i, down_i) + 2 * latency.
  If T exceeds the averager's ``allreduce_timeout`` (the daemon sizes it by bytes:
  ``request_timeout_s + 2 S / floor rate``) the step fails for the whole group at assembly + that
  timeout, and every member steps alone.
- ``allreduce`` (DDP, simulator only): a barrier on the slowest member, then a ring,
  T = 2 (N - 1) (latency + (S / N) / bw_min).

Simplifications, stated: transfers of different rounds do not share bandwidth with each other; a
push refused because the receiver is two rounds behind is assumed to go through as soon as the
receiver opens the round (the daemon retries and the receiver pulls); codec time is not charged
(it overlaps the wire in the daemon); compute speed is constant per worker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from locomm.protocol.rounds import RECEIVE_WINDOW
from locomm.protocol.timing import Limits, ema, partner_eta, push_order, turn_s, wait_deadline
from locomm.sim.flows import Flow, run_flows
from locomm.sim.network import NetworkModel, RoundRecord

STREAM_OPEN_LATENCIES = 2
"""One-way latencies before a push's first byte moves: opening the stream (a round trip)."""
MATCHMAKING_LATENCIES = 6
"""One-way latencies of hivemind's group assembly once the last member is there (DHT declare and
lookup, join request and acceptance, the leader's begin message)."""


@dataclass
class Timeline:
    """Per-worker clocks of a run and how each worker's time was spent."""

    workers: int
    compute: list[float] = field(default_factory=list)
    """Seconds each worker spent computing inner steps."""
    clock: list[float] = field(default_factory=list)
    """Each worker's last event: the end of its last exchange (its outer update applied)."""
    plans: list[list[float]] = field(default_factory=list)
    """plans[r][w]: when worker w planned round r (end of its compute, and of its previous exchange)."""
    ends: list[list[float]] = field(default_factory=list)
    """ends[r][w]: when worker w's round-r exchange was over (applied at the end of round r + 1)."""
    skipped: int = 0
    """Partner payloads a worker went on without (deadline, cut, or a failed all-reduce)."""
    cut: int = 0
    """Transfers cut off by the byte-sized deadlines."""

    def wall(self) -> float:
        return max(self.clock, default=0.0)

    def compute_utilisation(self) -> list[float]:
        """Each worker's share of the run's wall-clock spent computing."""
        wall = self.wall()
        return [c / wall if wall > 0 else 1.0 for c in self.compute]

    def round_done(self, overlap: bool) -> list[float]:
        """When every worker held its round-r model (what an evaluation after round r sees): with overlap the
        plan time of round r (its exchange is applied one round late), for the last round the end of its
        exchange (the daemon drains it before the final evaluation); without overlap the end of round r's."""
        if not self.plans:
            return []
        if not overlap:
            return [max(e) for e in self.ends]
        return [max(p) for p in self.plans[:-1]] + [max(self.ends[-1])]

    def idle_fraction(self) -> float:
        """1 - mean compute utilisation (kept for old callers; compute_utilisation is the measure)."""
        u = self.compute_utilisation()
        return 1.0 - sum(u) / len(u) if u else 0.0


class Schedule:
    """Drives the per-worker timelines one round at a time; tells each worker whose payload it got."""

    def __init__(
        self,
        net: NetworkModel,
        workers: int,
        *,
        overlap: bool = True,
        apply_delay_steps: int = 0,
        deadlines: Limits | None = None,
        round_compute: Sequence[Sequence[float]] | None = None,
        round_overhead_s: float = 0.0,
    ) -> None:
        """``round_compute[r][w]``: measured seconds of worker w's round-r compute, in place of the model's
        (to check the network and schedule model against a real run with the real compute times).
        ``round_overhead_s``: the daemon's per-round work besides inner steps, between the end of compute
        (and of the wait for the previous exchange) and the plan: applying the exchange, snapshotting the
        weights, reading the DHT's member list (0: not charged).
        ``deadlines``: the daemon's ``Limits`` (default: none)."""
        self.net = net
        self.round_compute = round_compute
        self.overhead = round_overhead_s
        self.n = workers
        self.overlap = overlap
        self.delay = apply_delay_steps
        self.dl = deadlines if deadlines is not None else Limits.never()
        self.tl = Timeline(workers, compute=[0.0] * workers, clock=[0.0] * workers)
        self.prev_plan = [0.0] * workers
        self.prev_end = [0.0] * workers
        self.entered = [0.0] * workers  # when each worker opened its current round (gossip.advance)
        self.opened: list[list[float]] = []  # opened[r][w]: when worker w opened round r
        self.round_s = [0.0] * workers  # the heartbeat's EMA of a round's compute time
        self.up_Bps = [0.0] * workers  # the heartbeat's EMA of the measured upload rate per push
        self.partners = [1] * workers
        self.r = 0

    # -- one round -----------------------------------------------------------------------

    def _compute(self, steps: int) -> list[float]:
        """Each worker's plan time for this round (compute, and the wait for the previous exchange)."""
        plan = []
        for w in range(self.n):
            start = self.prev_plan[w] if self.overlap else self.prev_end[w]
            c = self._compute_s(w, steps)
            k = self.delay if (self.overlap and 0 < self.delay < steps and self.r > 0) else 0
            if k:
                t = max(start + c * k / steps, self.prev_end[w]) + c * (steps - k) / steps
            else:
                t = start + c
                if self.overlap:
                    t = max(t, self.prev_end[w])
            t += self.overhead
            self.entered[w] = start
            self.tl.compute[w] += c
            plan.append(t)
        return plan

    def _compute_s(self, w: int, steps: int) -> float:
        if self.round_compute is not None:
            return float(self.round_compute[self.r][w])
        return self.net.compute_s(w, steps)

    def step(self, rec: RoundRecord) -> list[set[int]]:
        """Advance every worker through one round; returns, per worker, the peers whose payload it used."""
        plan = self._compute(rec.steps)
        self.opened.append(list(self.entered))
        if rec.kind == "direct":
            end, got = self._direct(rec, plan)
        elif rec.kind == "butterfly":
            end, got = self._butterfly(rec, plan)
        elif rec.kind == "allreduce":
            end, got = self._ring(rec, plan)
        else:
            raise ValueError(f"unknown exchange kind {rec.kind!r}")
        for w in range(self.n):  # the heartbeat's round time
            self.round_s[w] = ema(self.round_s[w], self._compute_s(w, rec.steps))
        self.tl.plans.append(plan)
        self.tl.ends.append(end)
        self.prev_plan, self.prev_end = plan, end
        self.tl.clock = list(end)
        self.r += 1
        return got

    def _eta(self, me: int, p: int, plan: list[float], raw: float) -> float:
        """The time by which worker ``me``, waiting from its plan time, expects partner ``p``'s payload: the
        daemon's ETA from p's heartbeat (p has sent once it planned; otherwise it computes this round)."""
        now = plan[me]
        return partner_eta(
            round_idx=self.r,
            partner_round=self.r + 1 if plan[p] <= now else self.r,
            round_t0=self.entered[p],
            round_s=self.round_s[p],
            up_Bps=self.up_Bps[p],
            partners=self.partners[p],
            own_round_s=self.round_s[me],
            wire_bytes=raw,
            limits=self.dl,
            now=now,
        )

    def _direct(self, rec: RoundRecord, plan: list[float]) -> tuple[list[float], list[set[int]]]:
        lat = self.net.latency_s
        flows: dict[tuple[int, int], Flow] = {}
        for w in range(self.n):
            # In turn, in ring order (gossip.Gossip._pushes_in_turn): each push starts when the one before it
            # ended, or TURN_SLACK payload-times (at w's measured upload rate) after it began.
            hold_s = turn_s(rec.bytes_sent[w], self.up_Bps[w], self.dl)
            before: Flow | None = None
            for j in push_order(w, list(rec.peers.get(w, []))):
                # j takes round-r pushes once it has opened round r - RECEIVE_WINDOW.
                back = self.r - RECEIVE_WINDOW
                t0 = max(plan[w], self.opened[back][j] if back >= 0 else 0.0) + STREAM_OPEN_LATENCIES * lat
                before = flows[(w, j)] = Flow(w, j, rec.bytes_sent[w], t0, after=before, turn_s=hold_s)
        run_flows(list(flows.values()), self.net.up_Bps, self.net.down_Bps, self.dl)
        self.tl.cut += sum(1 for f in flows.values() if math.isfinite(f.cut))
        raw = rec.raw_bytes or rec.bytes_sent
        end = list(plan)
        got: list[set[int]] = [set() for _ in range(self.n)]
        for w in range(self.n):
            peers = rec.peers.get(w, [])
            if not peers:
                continue
            t_end = plan[w]
            for p in peers:
                f = flows.get((p, w))
                if f is None:  # p does not count w as a partner: nothing will come
                    t_end = max(t_end, wait_deadline(plan[w], self._eta(w, p, plan, raw.get(p, 0)), self.dl))
                    self.tl.skipped += 1
                    continue
                deadline = wait_deadline(plan[w], self._eta(w, p, plan, raw.get(p, 0)), self.dl)
                arrived = f.done + lat
                if math.isfinite(f.done) and (arrived <= deadline or f.start <= deadline):
                    got[w].add(p)  # here in time, or moving when the ETA passed: waited for
                    t_end = max(t_end, arrived)
                else:
                    self.tl.skipped += 1
                    t_end = max(t_end, deadline if f.start > deadline else max(f.cut, deadline))
            for j in peers:  # gossip.exchange awaits its own pushes too
                f = flows[(w, j)]
                t_end = max(t_end, (f.done if math.isfinite(f.done) else f.cut) + 2 * lat)
                if math.isfinite(f.done) and f.done > f.start:
                    rate = f.nbytes / (f.done - f.start)
                    self.up_Bps[w] = ema(self.up_Bps[w], rate)
            self.partners[w] = len(peers)
            end[w] = t_end
        return end, got

    def _butterfly(self, rec: RoundRecord, plan: list[float]) -> tuple[list[float], list[set[int]]]:
        members = sorted(rec.members, key=lambda m: plan[m])
        first = plan[members[0]]
        timeout = self.dl.request_timeout_s
        group = [m for m in members if plan[m] <= first + timeout]
        late = [m for m in members if m not in group]
        end = list(plan)
        got: list[set[int]] = [set() for _ in range(self.n)]
        for m in late:  # looked for a group until its own step timeout, then stepped alone
            end[m] = plan[m] + timeout
            self.tl.skipped += len(rec.members) - 1
        if len(group) < 2:
            for m in group:
                end[m] = plan[m] + timeout
            return end, got
        last = plan[group[-1]] if not late else first + timeout
        assembled = last + MATCHMAKING_LATENCIES * self.net.latency_s
        nbytes = max(rec.bytes_sent[m] for m in group)
        dur = self.net.butterfly_allreduce_s(group, nbytes)
        ar_timeout = self.dl.allreduce_deadline_s(nbytes)
        ok = dur <= ar_timeout
        for m in group:
            end[m] = assembled + (dur if ok else ar_timeout)
            if ok:
                got[m] = set(group) - {m}
            else:
                self.tl.skipped += len(group) - 1
        return end, got

    def _ring(self, rec: RoundRecord, plan: list[float]) -> tuple[list[float], list[set[int]]]:
        start = max(plan[m] for m in rec.members)
        dur = self.net.ring_allreduce_s(rec.members, max(rec.bytes_sent[m] for m in rec.members))
        end = list(plan)
        got: list[set[int]] = [set() for _ in range(self.n)]
        for m in rec.members:
            end[m] = start + dur
            got[m] = set(rec.members) - {m}
        return end, got


def replay_schedule(
    records: Sequence[RoundRecord],
    net: NetworkModel,
    workers: int,
    *,
    overlap: bool = True,
    apply_delay_steps: int = 0,
    deadlines: Limits | None = None,
) -> tuple[Timeline, int]:
    """Re-time recorded rounds on ``net``; also returns how many (round, worker) used other partners than
    the record did (a deadline fired differently): then the numerics differ and the run must be redone."""
    sched = Schedule(net, workers, overlap=overlap, apply_delay_steps=apply_delay_steps, deadlines=deadlines)
    mismatches = 0
    for rec in records:
        got = sched.step(rec)
        if rec.answered is not None:
            mismatches += sum(1 for w in range(workers) if got[w] != set(rec.answered.get(w, ())))
        else:
            mismatches += sum(1 for w in range(workers) if got[w] != _full(rec, w))
    return sched.tl, mismatches


def replay(
    records: Sequence[RoundRecord],
    net: NetworkModel,
    workers: int,
    *,
    overlap: bool = True,
    apply_delay_steps: int = 0,
    deadlines: Limits | None = None,
) -> tuple[Timeline, list[float]]:
    """Simulated wall-clock of recorded rounds: the timeline, and when each round's model was held by all.

    Valid for the numerics of the record only where no deadline fires differently on ``net``
    (``replay_schedule`` counts those); otherwise simulate again with ``Simulator(network=net)``.
    """
    tl, _ = replay_schedule(
        records, net, workers, overlap=overlap, apply_delay_steps=apply_delay_steps, deadlines=deadlines
    )
    return tl, tl.round_done(overlap)


def _full(rec: RoundRecord, w: int) -> set[int]:
    if rec.kind == "direct":
        return set(rec.peers.get(w, ()))
    return set(rec.members) - {w}
