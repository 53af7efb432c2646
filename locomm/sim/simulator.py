"""N virtual workers in one process, driving the protocol core exactly as a peer would.

Notable:
- Each worker is a real ``Trainer`` (same model, data and inner loop as a peer),
  all sharing one token array; only its shard and seed differ.
- The daemon's round schedule, ``protocol/rounds.py`` (one ``Rounds`` per worker): with
  overlap (the default, as the daemon's) a round's exchange is applied one round late,
  ``rounds.apply_step`` inner steps into the next round, keeping the local progress made
  meanwhile (``rounds.apply_late``). ``overlap=False`` is ``--no-overlap``.
- Given a ``network``, each worker lives on its own timeline (``sim/timeline.py``) and
  the daemon's deadlines (``protocol/timing.py``) decide whose payload arrives in time; a partner that misses
  its deadline is skipped for the round, so the numerics depend on the network. Without
  one, everybody answers, and ``network_for`` re-times the recorded traffic on any
  network, reporting how many (round, worker) would have used other partners there
  (when nonzero, simulate again with that network instead of trusting the replay).
- Payload tensors pass through the daemon's own role-aware codec
  (``compression/payload.py``), so byte counts are what the daemon sends and lossy
  stages really change what peers receive. SparseLoCo's payload is already its codec's
  bytes. DiLoCo's goes raw (fp32) through hivemind's averager, as in the daemon.
- ``attackers={worker: kind}`` makes those workers poison their outer updates
  (``protocol/attacks.py``, applied to theta at plan time as the daemon's ``--attack`` does);
  every honest worker's screening (``Rounds.rejected``/``clipped``, the run spec's
  ``[defence]``) is counted per exchange in ``SimResult.defence``, and ``val_loss`` is the
  honest workers' mean.
- DDP runs as one shared replica whose step averages the N workers' gradients; its
  bytes are those of N workers ring-all-reducing gradients every step (blocking).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from locomm.compression.payload import PayloadCodec, PayloadError
from locomm.config import TENSOR_ROLES, ConfigError, RunSpec
from locomm.data import BatchSampler, TokenSplits, load_corpus
from locomm.protocol import DDP, Payload, build_outer
from locomm.protocol.attacks import ATTACKS, corrupt
from locomm.protocol.rounds import Planned, Rounds
from locomm.protocol.sparseloco import SparseLoCo
from locomm.protocol.timing import Limits
from locomm.sim.network import NetworkModel, RoundRecord
from locomm.sim.timeline import Schedule, Timeline, replay_schedule
from locomm.train import Trainer


@dataclass
class SimResult:
    algo: str
    workers: int
    rounds: int
    inner_steps: int
    steps: list[int] = field(default_factory=list)
    """Inner steps done at each evaluation."""
    val_loss: list[float] = field(default_factory=list)
    """Mean over (honest) workers of each worker's own validation loss, at each evaluation."""
    val_spread: list[float] = field(default_factory=list)
    """Max minus min of the workers' validation losses."""
    records: list[RoundRecord] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    bytes_received: list[int] = field(default_factory=list)
    bytes_coded: list[float] = field(default_factory=list)
    """Bytes each worker sent, counted with every payload through the spec's codec: the same count for every
    method (DiLoCo's butterfly moves raw fp32, as hivemind's averager does, so ``bytes_sent`` is larger)."""
    train_loss: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    overlap: bool = True
    apply_delay_steps: int = 0
    deadlines: Limits = field(default_factory=Limits)
    timeline: Timeline | None = None
    """The run's own timeline, when it was simulated on a network."""
    round_done: list[float] = field(default_factory=list)
    """When every worker held its round-r model, on the run's own network (empty without one)."""
    defence: Counter = field(default_factory=Counter)
    """What honest workers' screening did, per exchange: {attacker,honest}_{exchanges,rejected,clipped}
    (an exchange: one sender's update in one receiver's settle) and ``fallbacks`` (DiLoCo's own step)."""

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1]

    def record_index(self, step: int) -> int:
        """Index of the network record that completes inner step ``step`` (DDP records every step)."""
        return step - 1 if self.algo == "ddp" else step // self.inner_steps - 1

    def curve_times(self, round_times: list[float]) -> list[float]:
        """Simulated time of each evaluation, given each record's completion time."""
        return [0.0 if s == 0 else round_times[self.record_index(s)] for s in self.steps]


class Simulator:
    """Runs ``spec.outer.algo`` on ``workers`` virtual workers."""

    def __init__(
        self,
        spec: RunSpec,
        workers: int,
        *,
        splits: TokenSplits | None = None,
        codec: str | None = None,
        eval_every: int = 1,
        overlap: bool = True,
        network: NetworkModel | None = None,
        attackers: Mapping[int, str] | None = None,
        sparse_codec: str | None = None,
    ) -> None:
        algo = spec.outer.algo
        if sparse_codec is not None and algo != "sparseloco":
            raise ConfigError(f"sparse_codec: only SparseLoCo encodes its own payload, not {algo}")
        if algo == "none":
            raise ConfigError(
                "outer.algo: 'none' is single-node training; pick ddp, diloco, noloco, gasloc or sparseloco to simulate"
            )
        if not 2 <= workers <= 64:
            raise ConfigError(f"workers: must be in [2, 64], got {workers}")
        if network is not None and len(network.speed) != workers:
            raise ConfigError(f"network: built for {len(network.speed)} workers, not {workers}")
        if algo == "noloco" and spec.outer.group_size > workers:
            raise ConfigError(f"outer.group_size: {spec.outer.group_size} is larger than the {workers} workers")
        if algo == "gasloc" and spec.outer.topology == "kpeers" and spec.outer.k_peers >= workers:
            raise ConfigError(f"outer.k_peers: {spec.outer.k_peers} needs more than {workers} workers")
        self.attackers = dict(attackers or {})
        for w, kind in self.attackers.items():
            if not 0 <= w < workers or kind not in ATTACKS or algo == "ddp":
                raise ConfigError(f"attackers: {w}: {kind!r} needs a worker < {workers}, one of {ATTACKS}, no ddp")
        self.honest = [w for w in range(workers) if w not in self.attackers]
        self.attack_gen = torch.Generator().manual_seed(spec.train.seed + 7919)
        self.spec = spec
        self.workers = workers
        self.splits = splits if splits is not None else load_corpus(spec.data)
        compression = spec.compression if codec is None else {r: codec for r in TENSOR_ROLES}
        self.compression = compression
        self.eval_every = max(1, eval_every)
        self.members = list(range(workers))
        self.overlap = overlap and algo != "ddp"  # DDP is a blocking all-reduce every step
        self.deadlines = Limits.from_network(spec.network)
        self.network = network
        self.schedule = (
            Schedule(
                network,
                workers,
                overlap=self.overlap,
                apply_delay_steps=spec.outer.apply_delay_steps,
                deadlines=self.deadlines,
            )
            if network is not None
            else None
        )
        if algo == "ddp":
            self.trainers = [Trainer(spec, splits=self.splits)]
            self.samplers = [
                BatchSampler(self.splits, spec.data, seed=spec.train.seed, worker_id=w, num_workers=workers)
                for w in range(workers)
            ]
            self.ddp = [DDP(w) for w in range(workers)]
        else:
            self.trainers = [
                Trainer(spec, splits=self.splits, worker_id=w, num_workers=workers) for w in range(workers)
            ]
            if sparse_codec is None:
                self.algos = [build_outer(spec.outer, self._params(w), w) for w in range(workers)]
            else:  # a sparse codec the run spec does not offer (benchmarks/tune.py's sparseloco_tiles)
                self.algos = [SparseLoCo(spec.outer, self._params(w), w, codec=sparse_codec) for w in range(workers)]
            H, delay = spec.outer.inner_steps, spec.outer.apply_delay_steps
            self.rounds = [
                Rounds(a, H, overlap=self.overlap, apply_delay_steps=delay, defence=spec.defence) for a in self.algos
            ]
        shapes = {k: tuple(p.shape) for k, p in self._params(0).items()}
        # The daemon's codec: the same parts, stacks and rounding, so both count the same bytes.
        if algo == "ddp":
            self.coder = PayloadCodec(shapes, {"grad": "outer_gradient"}, compression)
        else:
            a0 = self.algos[0]
            self.coder = PayloadCodec(shapes, a0.payload_roles, compression, encoded=a0.payload_encoded)

    def _params(self, w: int) -> dict[str, torch.Tensor]:
        return dict(self.trainers[w].model.named_parameters())

    def _plan_params(self, w: int) -> dict[str, torch.Tensor]:
        """What worker ``w`` plans from: its weights, or an attacker's corruption of them."""
        params = self._params(w)
        kind = self.attackers.get(w)
        return params if kind is None else corrupt(kind, params, self.algos[w].phi, self.attack_gen)

    def _settle(self, w: int, res: SimResult) -> None:
        """Settle worker ``w``'s pending round and count what an honest worker's screening did."""
        rs = self.rounds[w]
        if rs.settle(self._params(w)) is None or w in self.attackers:
            return
        rejected, clipped = {j for j, _ in rs.rejected}, {j for j, _ in rs.clipped}
        for j in rs.outcome.senders:
            side = "attacker" if j in self.attackers else "honest"
            res.defence[f"{side}_exchanges"] += 1
            res.defence[f"{side}_rejected"] += j in rejected
            res.defence[f"{side}_clipped"] += j in clipped
        res.defence["fallbacks"] += rs.fallback is not None

    # -- one round -----------------------------------------------------------------

    def _outer_round(self, r: int, res: SimResult) -> None:
        H = self.spec.outer.inner_steps
        losses = []
        for w, t in enumerate(self.trainers):
            for i in range(H):
                if self.rounds[w].due(i):
                    self._settle(w, res)
                loss = t.train_step()
                if w not in self.attackers:
                    losses.append(loss)
            self._settle(w, res)
        res.train_loss.append(sum(losses) / len(losses))
        planned: list[Planned] = [rs.start(r, self.members, self._plan_params(w)) for w, rs in enumerate(self.rounds)]
        plans = [p.exchange for p in planned]
        butterfly = self.spec.outer.algo == "diloco"
        wire: list[Payload] = []
        sizes: dict[int, float] = {}
        coded: dict[int, float] = {}
        for w, plan in enumerate(plans):
            if butterfly:  # hivemind's averager moves raw fp32, no codec
                wire.append(plan.payload)
                sizes[w] = float(sum(v.numel() * v.element_size() for v in plan.payload.values()))
                coded[w] = float(self.coder.coded_bytes(plan.payload))
            else:
                try:
                    received, nbytes = self.coder.transmit(plan.payload)
                except PayloadError:  # the daemon's receivers answer NOT_FINITE (a fault): nobody takes it
                    received, nbytes = None, float(self.coder.raw_bytes())
                wire.append(received)
                sizes[w] = coded[w] = nbytes
        raw = float(max(1, self.coder.raw_bytes())) if not butterfly else None
        peers = {
            w: ([m for m in self.members if m != w] if plan.collective else list(plan.peers))
            for w, plan in enumerate(plans)
        }
        rec = RoundRecord(
            steps=H,
            bytes_sent=sizes,
            kind="butterfly" if butterfly else "direct",
            peers={} if butterfly else peers,
            members=list(self.members),
            raw_bytes=None if butterfly else {w: raw for w in self.members},
        )
        if self.schedule is not None:
            answered = self.schedule.step(rec)
            rec.answered = {w: sorted(a) for w, a in enumerate(answered)}
        else:
            answered = [set(peers[w]) for w in self.members]
        res.records.append(rec)
        for w in self.members:
            refused = {j for j in answered[w] if wire[j] is None}
            if w not in self.attackers:  # refused on the wire: counted as the screening would count a rejection
                for j in refused:
                    side = "attacker" if j in self.attackers else "honest"
                    res.defence[f"{side}_exchanges"] += 1
                    res.defence[f"{side}_rejected"] += 1
            got = planned[w].received(w, {j: wire[j] for j in sorted(answered[w] - refused)})
            if butterfly:  # the daemon's count: (N-1)/N of the payload, twice, over the group that formed
                g = len(answered[w]) + 1
                res.bytes_sent[w] += 2 * (g - 1) / g * sizes[w]
                res.bytes_received[w] += 2 * (g - 1) / g * sizes[w]
                res.bytes_coded[w] += 2 * (g - 1) / g * coded[w]
            else:  # pushes go to every partner; what arrived in time is used
                res.bytes_sent[w] += sizes[w] * len(peers[w])
                res.bytes_coded[w] += coded[w] * len(peers[w])
                res.bytes_received[w] += sum(sizes[j] for j in answered[w])
            self.rounds[w].arrived(got)
            if not self.overlap:
                self._settle(w, res)

    def _ddp_round(self, r: int, res: SimResult) -> None:
        t = self.trainers[0]
        model = t.model
        params = dict(model.named_parameters())
        losses = []
        n = len(self.members)
        for _ in range(self.spec.outer.inner_steps):
            payloads: list[Payload] = []
            for w, sampler in enumerate(self.samplers):
                x, y = sampler.next()
                model.train()
                with t.autocast():
                    loss = model(x.to(t.device), y.to(t.device))
                model.zero_grad(set_to_none=True)
                loss.backward()
                losses.append(loss.item())
                grads = {k: p.grad.detach().clone() for k, p in params.items()}
                payloads.append(self.ddp[w].plan(self.members, grads).payload)
            wire = []
            nbytes = 0
            for pl in payloads:
                received, nb = self.coder.transmit(pl)
                wire.append(received)
                nbytes = max(nbytes, nb)
            grads = {k: p.grad for k, p in params.items()}
            # Every replica computes the same mean; the shared one does it once (own payload uncoded).
            self.ddp[0].apply(grads, {0: payloads[0], **{w: wire[w] for w in self.members[1:]}})
            t.apply_gradients()  # the averaged gradients, exactly as a single node steps
            for w in self.members:
                res.bytes_sent[w] += 2 * (n - 1) / n * nbytes
                res.bytes_received[w] += 2 * (n - 1) / n * nbytes
                res.bytes_coded[w] += 2 * (n - 1) / n * nbytes
            rec = RoundRecord(
                steps=1, bytes_sent={w: nbytes for w in self.members}, kind="allreduce", peers={}, members=self.members
            )
            if self.schedule is not None:
                self.schedule.step(rec)
            res.records.append(rec)
        res.train_loss.append(sum(losses) / len(losses))

    # -- the run -------------------------------------------------------------------

    def evaluate(self) -> list[float]:
        return [t.evaluate() for t in self.trainers]

    def run(self, rounds: int, on_round: Callable[[int, SimResult], None] | None = None) -> SimResult:
        if rounds < 1:
            raise ConfigError(f"rounds: must be >= 1, got {rounds}")
        H = self.spec.outer.inner_steps
        res = SimResult(
            algo=self.spec.outer.algo,
            workers=self.workers,
            rounds=rounds,
            inner_steps=H,
            bytes_sent=[0] * self.workers,
            bytes_received=[0] * self.workers,
            bytes_coded=[0.0] * self.workers,
            overlap=self.overlap,
            apply_delay_steps=self.spec.outer.apply_delay_steps,
            deadlines=self.deadlines,
        )
        t0 = time.perf_counter()
        self._record_eval(res, 0)
        for r in range(rounds):
            if self.spec.outer.algo == "ddp":
                self._ddp_round(r, res)
            else:
                self._outer_round(r, res)
            if r == rounds - 1 and self.spec.outer.algo != "ddp":
                for w in range(self.workers):  # the daemon settles its last exchange before evaluating
                    self._settle(w, res)
            if (r + 1) % self.eval_every == 0 or r == rounds - 1:
                self._record_eval(res, (r + 1) * H)
            if on_round:
                on_round(r, res)
        if self.schedule is not None:
            res.timeline = self.schedule.tl
            res.round_done = self.schedule.tl.round_done(self.overlap)
        res.wall_s = time.perf_counter() - t0
        return res

    def _record_eval(self, res: SimResult, step: int) -> None:
        losses = [self.trainers[w].evaluate() for w in self.honest] if self.attackers else self.evaluate()
        if not all(math.isfinite(v) for v in losses):
            raise FloatingPointError(f"{self.spec.outer.algo}: validation loss diverged at step {step}")
        res.steps.append(step)
        res.val_loss.append(sum(losses) / len(losses))
        res.val_spread.append(max(losses) - min(losses))

    def weight_distance(self) -> float:
        """Largest L2 distance between two workers' weights (0 for DDP)."""
        flat = [torch.cat([p.detach().flatten() for p in t.model.parameters()]) for t in self.trainers]
        return max((float((a - b).norm()) for i, a in enumerate(flat) for b in flat[i + 1 :]), default=0.0)


def time_to_target(res: SimResult, round_times: list[float], target: float) -> float:
    """Simulated seconds until the mean validation loss first reaches ``target`` (inf if never)."""
    for t, loss in zip(res.curve_times(round_times), res.val_loss):
        if loss <= target:
            return t
    return math.inf


@dataclass
class NetworkRun:
    """A run's traffic re-timed on one network."""

    wall_s: float
    round_done: list[float]
    """When every worker held its round-r model (see ``network.round_done``)."""
    compute_utilisation: list[float]
    """Each worker's share of the wall-clock spent computing."""
    mismatches: int
    """(round, worker) whose partners on this network differ from the record's: a deadline fired
    differently, so the record's numerics are not this network's (simulate again with network=...)."""
    skipped: int
    """Partner payloads a worker went on without on this network."""

    @property
    def utilisation_mean(self) -> float:
        return sum(self.compute_utilisation) / len(self.compute_utilisation)

    @property
    def utilisation_min(self) -> float:
        return min(self.compute_utilisation)


def network_for(
    res: SimResult,
    *,
    link_bps: float,
    latency_s: float,
    heterogeneity: float,
    step_s: float,
    seed: int = 0,
    deadlines: Limits | None = None,
    scale: float = 1.0,
) -> NetworkRun:
    """Replay a run's recorded traffic on a network, with the run's schedule and (default) its deadlines.

    ``scale`` k > 1 replays the run as if the model were k times larger: bytes and FLOPs both x k, which is
    link and compute speed / k (latency unchanged); the deadlines' rate floor / k too, so the same deadlines
    fire as would for the larger model on the real links."""
    if scale <= 0:
        raise ValueError(f"scale: must be > 0, got {scale}")
    dl = deadlines if deadlines is not None else res.deadlines
    if scale != 1.0:
        dl = replace(dl, min_rate_Bps=dl.min_rate_Bps / scale)
    net = NetworkModel.build(
        res.workers,
        link_bps=link_bps / scale,
        latency_s=latency_s,
        heterogeneity=heterogeneity,
        step_s=step_s * scale,
        seed=seed,
    )
    return replay_on(res, net, deadlines=dl)


def replay_on(res: SimResult, net: NetworkModel, *, deadlines: Limits | None = None) -> NetworkRun:
    tl, mismatches = replay_schedule(
        res.records,
        net,
        res.workers,
        overlap=res.overlap,
        apply_delay_steps=res.apply_delay_steps,
        deadlines=deadlines if deadlines is not None else res.deadlines,
    )
    return NetworkRun(
        wall_s=tl.wall(),
        round_done=tl.round_done(res.overlap),
        compute_utilisation=tl.compute_utilisation(),
        mismatches=mismatches,
        skipped=tl.skipped,
    )
