"""N virtual workers in one process, driving the protocol core exactly as a peer would.

Notable:
- Each worker is a real ``Trainer`` (same model, data and inner loop as a peer),
  all sharing one token array; only its shard and seed differ.
- Training does not depend on timing here (rounds are synchronous in the
  simulator), so the network is recorded, not lived: each round logs who sent how
  many bytes to whom, and ``network.replay`` turns that log into a wall-clock
  timeline for any link speed afterwards. One training run gives the timeline at
  80 Mbit/s and at 10 Gbit/s.
- Payload tensors pass through the daemon's own role-aware codec
  (``compression/payload.py``: the same parts, stacks and rounding), so byte
  counts are what the daemon sends and lossy stages really change what peers
  receive. SparseLoCo's payload is already its codec's bytes.
- DDP runs as one shared replica whose step averages the N workers' gradients
  (replicas of plain data parallelism are identical by construction); its bytes
  are those of N workers all-reducing gradients every step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from locomm.compression.payload import PayloadCodec
from locomm.config import TENSOR_ROLES, ConfigError, RunSpec
from locomm.data import BatchSampler, TokenSplits, load_corpus
from locomm.protocol import DDP, Exchange, Payload, build_outer
from locomm.sim.network import NetworkModel, RoundRecord, replay
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
    """Mean over workers of each worker's own validation loss, at each evaluation."""
    val_spread: list[float] = field(default_factory=list)
    """Max minus min of the workers' validation losses."""
    records: list[RoundRecord] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    bytes_received: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    wall_s: float = 0.0

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

    def __init__(self, spec: RunSpec, workers: int, *, splits: TokenSplits | None = None,
                 codec: str | None = None, eval_every: int = 1) -> None:
        algo = spec.outer.algo
        if algo == "none":
            raise ConfigError("outer.algo: 'none' is single-node training; pick ddp, diloco, noloco, gasloc "
                              "or sparseloco to simulate")
        if not 2 <= workers <= 64:
            raise ConfigError(f"workers: must be in [2, 64], got {workers}")
        if algo == "noloco" and spec.outer.group_size > workers:
            raise ConfigError(f"outer.group_size: {spec.outer.group_size} is larger than the {workers} workers")
        if algo == "gasloc" and spec.outer.topology == "kpeers" and spec.outer.k_peers >= workers:
            raise ConfigError(f"outer.k_peers: {spec.outer.k_peers} needs more than {workers} workers")
        self.spec = spec
        self.workers = workers
        self.splits = splits if splits is not None else load_corpus(spec.data)
        compression = spec.compression if codec is None else {r: codec for r in TENSOR_ROLES}
        self.compression = compression
        self.eval_every = max(1, eval_every)
        self.members = list(range(workers))
        if algo == "ddp":
            self.trainers = [Trainer(spec, splits=self.splits)]
            self.samplers = [BatchSampler(self.splits.train, spec.data, seed=spec.train.seed, worker_id=w,
                                          num_workers=workers) for w in range(workers)]
            self.ddp = [DDP(w) for w in range(workers)]
        else:
            self.trainers = [Trainer(spec, splits=self.splits, worker_id=w, num_workers=workers)
                             for w in range(workers)]
            self.algos = [build_outer(spec.outer, self._params(w), w) for w in range(workers)]
        shapes = {k: tuple(p.shape) for k, p in self._params(0).items()}
        # The daemon's codec: the same parts, stacks and rounding, so both count the same bytes.
        if algo == "ddp":
            self.coder = PayloadCodec(shapes, {"grad": "outer_gradient"}, compression)
        else:
            a0 = self.algos[0]
            self.coder = PayloadCodec(shapes, a0.payload_roles, compression, encoded=a0.payload_encoded)

    def _params(self, w: int) -> dict[str, torch.Tensor]:
        return dict(self.trainers[w].model.named_parameters())

    # -- one round -----------------------------------------------------------------

    def _outer_round(self, r: int, res: SimResult) -> None:
        H = self.spec.outer.inner_steps
        losses = []
        for t in self.trainers:
            for _ in range(H):
                losses.append(t.train_step())
        res.train_loss.append(sum(losses) / len(losses))
        plans: list[Exchange] = [a.plan(r, self.members, self._params(w)) for w, a in enumerate(self.algos)]
        wire: list[Payload] = []
        sizes: dict[int, float] = {}
        for w, plan in enumerate(plans):
            received, nbytes = self.coder.transmit(plan.payload)
            wire.append(received)
            sizes[w] = nbytes
        collective = plans[0].collective
        kind = "direct"
        if collective:
            kind = "allgather" if self.spec.outer.algo == "sparseloco" else "allreduce"
        n = len(self.members)
        for w, (a, plan) in enumerate(zip(self.algos, plans)):
            peers = [m for m in self.members if m != w] if collective else plan.peers
            got = {w: plan.payload}  # a worker's own payload never crosses the wire
            got.update({j: wire[j] for j in peers})
            a.apply(r, self._params(w), got)
            if kind == "allreduce":  # ring all-reduce: each worker sends and receives 2(N-1)/N of S
                res.bytes_sent[w] += 2 * (n - 1) / n * sizes[w]
                res.bytes_received[w] += 2 * (n - 1) / n * sizes[w]
            else:  # all-gather or direct: every piece reaches each peer once
                res.bytes_sent[w] += sizes[w] * len(peers)
                res.bytes_received[w] += sum(sizes[j] for j in peers)
        res.records.append(RoundRecord(steps=H, bytes_sent=sizes, kind=kind,
                                       peers={} if collective else {w: list(p.peers) for w, p in enumerate(plans)},
                                       members=self.members))

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
            res.records.append(RoundRecord(steps=1, bytes_sent={w: nbytes for w in self.members}, kind="allreduce",
                                           peers={}, members=self.members))
        res.train_loss.append(sum(losses) / len(losses))

    # -- the run -------------------------------------------------------------------

    def evaluate(self) -> list[float]:
        return [t.evaluate() for t in self.trainers]

    def run(self, rounds: int, on_round: Callable[[int, SimResult], None] | None = None) -> SimResult:
        if rounds < 1:
            raise ConfigError(f"rounds: must be >= 1, got {rounds}")
        H = self.spec.outer.inner_steps
        res = SimResult(algo=self.spec.outer.algo, workers=self.workers, rounds=rounds, inner_steps=H,
                        bytes_sent=[0] * self.workers, bytes_received=[0] * self.workers)
        t0 = time.perf_counter()
        losses = self.evaluate()
        res.steps.append(0)
        res.val_loss.append(sum(losses) / len(losses))
        res.val_spread.append(max(losses) - min(losses))
        for r in range(rounds):
            if self.spec.outer.algo == "ddp":
                self._ddp_round(r, res)
            else:
                self._outer_round(r, res)
            if (r + 1) % self.eval_every == 0 or r == rounds - 1:
                losses = self.evaluate()
                if not all(math.isfinite(v) for v in losses):
                    raise FloatingPointError(f"{self.spec.outer.algo}: validation loss diverged at round {r}")
                res.steps.append((r + 1) * H)
                res.val_loss.append(sum(losses) / len(losses))
                res.val_spread.append(max(losses) - min(losses))
            if on_round:
                on_round(r, res)
        res.wall_s = time.perf_counter() - t0
        return res

    def weight_distance(self) -> float:
        """Largest L2 distance between two workers' weights (0 for DDP)."""
        flat = [torch.cat([p.detach().flatten() for p in t.model.parameters()]) for t in self.trainers]
        return max((float((a - b).norm()) for i, a in enumerate(flat) for b in flat[i + 1:]), default=0.0)


def time_to_target(res: SimResult, round_times: list[float], target: float) -> float:
    """Simulated seconds until the mean validation loss first reaches ``target`` (inf if never)."""
    for t, loss in zip(res.curve_times(round_times), res.val_loss):
        if loss <= target:
            return t
    return math.inf


def network_for(res: SimResult, *, link_bps: float, latency_s: float, heterogeneity: float, step_s: float,
                seed: int = 0) -> tuple[float, list[float], float]:
    """Replay a run on a network: (wall-clock s, per-record completion times, idle fraction)."""
    net = NetworkModel.build(res.workers, link_bps=link_bps, latency_s=latency_s, heterogeneity=heterogeneity,
                             step_s=step_s, seed=seed)
    tl, done = replay(res.records, net, res.workers)
    return tl.wall(), done, tl.idle_fraction()
