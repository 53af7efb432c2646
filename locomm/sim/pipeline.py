"""Pipeline mode in one process: S stages x R replicas on the sans-IO core, on the stage daemon's schedule.

Notable:
- Every stage replica is a real :class:`locomm.train.stage.StageWorker` (the stage
  server's compute core); every boundary crossing goes through the stage server's
  :class:`locomm.compression.boundary.BoundaryCoder`, so lossy stages really change what the
  next stage sees and the bytes counted are those the daemon sends (token window,
  activation, gradient).
- Routing is the daemon's: :func:`locomm.protocol.routing.route`, seeded by (run seed,
  origin, the origin's micro-batch counter, stage) over the replicas' names (``names``: the
  peer ids of a real swarm, to draw exactly its routes; evaluation micro-batches count too,
  as in the daemon). Stage-0 replica r draws data shard r of R (``shards`` to change that).
- The stage daemon's schedule (``peer/pipeline/stage.py``): stage 0 steps after each batch, a later
  stage after every batch's worth of micro-batches it served (``StageWorker.maybe_step``).
  Each replica's data clock (stage 0: its step; later stages: the largest stage-0 step
  among the micro-batches it served) ends replica-sync round r at (r + 1) H; the replicas
  of a stage then run the outer algorithm on that stage's parameters through the daemon's
  payload codec (``protocol/rounds.py``): round r's exchange is applied at the end of round
  r + 1, keeping the local progress made meanwhile (``overlap=False``: applied as soon as
  every partner has planned the round), then re-projected onto span(U). A sibling that has
  not planned the round yet is waited for (the daemon waits up to ``timing.sibling_wait_s``;
  the simulator has no clock); a round still incomplete when training ends is dropped, as
  the daemon's last settle gives up on it. A single replica runs its outer step alone, as
  the daemon does.
- Micro-batches run one at a time in the order (step, micro-batch, stage-0 replica), the
  order a daemon with ``in_flight = 1`` sees when the stage-0 replicas take turns.
- The network is recorded, not lived: :mod:`locomm.sim.pipeline_replay` re-times the
  record (1F1B, replica syncs overlapped as above) for any link and compute speed.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from locomm.compression.boundary import BoundaryCoder
from locomm.compression.payload import PayloadCodec
from locomm.config import ConfigError, RunSpec
from locomm.data import BatchSampler, TokenSplits, eval_batches, load_corpus
from locomm.model.stages import Geometry, StageModule, build_stages
from locomm.protocol import build_outer
from locomm.protocol.rounds import Planned, Rounds
from locomm.protocol.routing import route
from locomm.protocol.timing import Limits
from locomm.sim.pipeline_replay import (
    MicroTrace,
    PipelineResult,
    Timeline,
    flops_stage_s,
    overlap_by_stage,
    replay,
    summarize,
)
from locomm.train.stage import StageWorker

__all__ = [
    "MicroTrace",
    "PipelineResult",
    "PipelineSim",
    "Timeline",
    "flops_stage_s",
    "overlap_by_stage",
    "replay",
    "run_pipeline_simulation",
    "summarize",
]


class PipelineSim:
    """S stages x R replicas of one run spec, trained in one process on the stage daemon's schedule."""

    def __init__(
        self,
        spec: RunSpec,
        replicas: int,
        *,
        splits: TokenSplits | None = None,
        subspace: bool | None = None,
        eval_every: int = 0,
        overlap: bool = True,
        names: Sequence[Sequence[str | int]] | None = None,
        shards: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """``names[s][r]``: the routing and membership id of replica r of stage s (default: r).
        ``shards[r]``: the data shard (index, count) of stage-0 replica r (default: (r, R))."""
        if spec.pipeline.stages < 2:
            raise ConfigError("pipeline.stages: the pipeline simulator needs at least 2 stages")
        if not 1 <= replicas <= 16:
            raise ConfigError(f"replicas: must be in [1, 16], got {replicas}")
        self.spec = spec
        self.S, self.R = spec.pipeline.stages, replicas
        self.names = [list(n) for n in names] if names is not None else [list(range(replicas))] * self.S
        if len(self.names) != self.S or any(len(n) != replicas for n in self.names):
            raise ConfigError(f"names: one name per replica of each of the {self.S} stages")
        self.geo = Geometry.of(spec, subspace=subspace)
        self.coder = BoundaryCoder(spec, self.geo)
        self.splits = splits if splits is not None else load_corpus(spec.data)
        self.eval_every = eval_every
        self.overlap = overlap
        self.limits = Limits.from_network(spec.network)
        # Every replica starts from the same weights: each builds the same unsplit model and slices it.
        self.workers: list[list[Any]] = [[None] * self.S for _ in range(self.R)]
        for r in range(self.R):
            for s, mod in enumerate(build_stages(spec, self.geo)):
                self.workers[r][s] = StageWorker(spec, s, geo=self.geo, module=mod)
        shards = list(shards) if shards is not None else [(r, self.R) for r in range(self.R)]
        self.samplers = [
            BatchSampler(self.splits, spec.data, seed=spec.train.seed, worker_id=i, num_workers=n) for i, n in shards
        ]
        self._val = eval_batches(self.splits.val, spec.data, spec.train.eval_batches)
        self.M = spec.data.batch_size // spec.pipeline.micro_batch_size
        self.mb_size = spec.pipeline.micro_batch_size
        self.H = spec.outer.inner_steps
        self.algos: list[list[Any]] = []
        self.rounds: list[list[Rounds]] = []
        self.coders: list[PayloadCodec] = []
        if spec.outer.algo not in ("none", "ddp"):
            for s in range(self.S):
                algos = [build_outer(spec.outer, self.workers[r][s].params(), self.names[s][r]) for r in range(self.R)]
                self.algos.append(algos)
                self.rounds.append([Rounds.of_spec(a, spec, overlap=overlap, pipeline=True) for a in algos])
                shapes = {k: tuple(p.shape) for k, p in self.workers[0][s].params().items()}
                a0 = algos[0]
                self.coders.append(PayloadCodec(shapes, a0.payload_roles, spec.compression, encoded=a0.payload_encoded))
        self.mb_seq = [0] * self.R
        """Each stage-0 replica's micro-batch counter (the daemon's ``_mb_seq``: evaluation included)."""
        self.clock = [[0] * self.R for _ in range(self.S)]
        """Data clocks of the stages after 0 (stage 0's is its step)."""
        self.rounds_due = [[0] * self.R for _ in range(self.S)]
        self.due: list[list[list[int]]] = [[[] for _ in range(self.R)] for _ in range(self.S)]
        """Rounds whose sync fell due and waits for the previous exchange to be complete."""
        self.wire: dict[tuple[int, int], dict[Any, Any]] = defaultdict(dict)
        """(stage, round) -> {name: the payload as partners receive it} of every replica that planned it."""
        self._sync_rec: dict[int, tuple[dict[int, float], dict[tuple[int, int], list[int]]]] = {}
        self._t: dict[tuple[str, int], float] = defaultdict(float)
        self._n: dict[tuple[str, int], int] = defaultdict(int)

    # -- one micro-batch -----------------------------------------------------------------

    def _timed(self, key: tuple[str, int], fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        self._t[key] += time.perf_counter() - t0
        self._n[key] += 1
        return out

    def _path(self, origin: int, mb: int) -> list[int]:
        """The replica of each stage that micro-batch ``mb`` of stage-0 replica ``origin`` is routed to."""
        seed, o = self.spec.train.seed, self.names[0][origin]
        return [origin] + [self.names[s].index(route(seed, o, mb, s, self.names[s])) for s in range(1, self.S)]

    def micro_batch(self, origin: int, window: torch.Tensor) -> tuple[float, MicroTrace]:
        """Forward through a routed path of replicas, backward along the same path; returns the loss."""
        mb = self.mb_seq[origin]
        self.mb_seq[origin] += 1
        step = self.workers[origin][0].step  # the header's step: stage 0's data clock
        x, y = window[:, :-1], window[:, 1:]
        path = self._path(origin, mb)
        tok = len(self.coder.encode_window(window))
        fwd_b, bwd_b = [], []
        h: torch.Tensor | None = None
        for s in range(self.S - 1):
            key = mb if s == 0 else (origin, mb)
            h = self._timed(("f", s), self.workers[path[s]][s].forward, key, x, h)
            data = self.coder.encode_activation(h, x)
            fwd_b.append(len(data) + tok)
            h = self.coder.decode_activation(data, x)
            self.clock[s + 1][path[s + 1]] = max(self.clock[s + 1][path[s + 1]], step)
        last = self.S - 1
        loss, g = self._timed(("fb", last), self.workers[path[last]][last].forward_backward, x, y, h)
        self._after_backward(last, path[last])
        for s in range(self.S - 2, -1, -1):
            data = self.coder.encode_gradient(g, x)
            bwd_b.append(len(data))
            key = mb if s == 0 else (origin, mb)
            g = self._timed(("b", s), self.workers[path[s]][s].backward, key, self.coder.decode_gradient(data, x))
            if s > 0:
                self._after_backward(s, path[s])
        return loss, MicroTrace(origin, tuple(path), tuple(fwd_b), tuple(reversed(bwd_b)))

    # -- the stage daemon's schedule -------------------------------------------------------

    def _after_backward(self, s: int, j: int) -> None:
        """A stage after 0 served a micro-batch: step when due, start a sync round its data clock ended."""
        self.workers[j][s].maybe_step()
        self._clock_moved(s, j, self.clock[s][j])

    def _stage0_step(self, r: int) -> bool:
        """Stage-0 replica r steps after its batch; returns whether a sync round ended there."""
        w = self.workers[r][0]
        if w.accumulated:
            w.apply_step()
        else:  # every micro-batch of the batch was lost: the step is skipped, the schedule goes on
            w.step += 1
        return self._clock_moved(0, r, w.step)

    def _clock_moved(self, s: int, j: int, clock: int) -> bool:
        done = clock // self.H
        if done <= self.rounds_due[s][j] or not self.rounds:
            return False
        self.rounds_due[s][j] = done
        self.due[s][j].append(done - 1)
        self._drain(s)
        return True

    def _drain(self, s: int) -> None:
        """Settle and plan what can be: a sync that fell due first applies the previous round (one round late,
        once every partner has planned it), then plans its own; blocking: applied as soon as it is complete."""
        moved = True
        while moved:
            moved = False
            for j in range(self.R):
                rs = self.rounds[s][j]
                if rs.pending is not None and (self.due[s][j] or not self.overlap) and self._complete(s, rs.pending):
                    self._settle(s, j)
                    moved = True
                if self.due[s][j] and rs.pending is None:
                    self._plan(s, j, self.due[s][j].pop(0))
                    moved = True

    def _complete(self, s: int, planned: Planned) -> bool:
        return all(p in self.wire[(s, planned.round_idx)] for p in planned.exchange.peers)

    def _settle(self, s: int, j: int) -> None:
        rs = self.rounds[s][j]
        assert rs.pending is not None
        r = rs.pending.round_idx
        got = {p: self.wire[(s, r)][p] for p in rs.pending.exchange.peers}
        rs.settle(self.workers[j][s].params(), rs.pending.received(self.names[s][j], got))
        self.workers[j][s].module.project_()
        oldest = min(x.pending.round_idx if x.pending is not None else r + 1 for x in self.rounds[s])
        for key in [k for k in self.wire if k[0] == s and k[1] < oldest]:
            del self.wire[key]

    def _plan(self, s: int, j: int, r: int) -> None:
        planned = self.rounds[s][j].start(r, sorted(self.names[s]), self.workers[j][s].params())
        received, nbytes = self.coders[s].transmit(planned.exchange.payload)
        self.wire[(s, r)][self.names[s][j]] = received
        sizes, peers = self._sync_rec.setdefault(r, ({}, {}))
        sizes[s] = max(sizes.get(s, 0.0), float(nbytes))
        peers[(s, j)] = [self.names[s].index(p) for p in planned.exchange.peers]

    def _settle_last(self) -> None:
        """The end of the run: a complete pending round is applied, an incomplete one dropped (the daemon's last
        settle gives up on it)."""
        for s in range(len(self.rounds)):
            for j, rs in enumerate(self.rounds[s]):
                self.due[s][j].clear()
                if rs.pending is not None and self._complete(s, rs.pending):
                    self._settle(s, j)
                rs.pending = None

    # -- the run ---------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean over stage-0 replicas of the validation loss through routed replicas and the wire's coding, as
        the daemon's stage 0 evaluates (each micro-batch takes a number of its origin's counter)."""
        mbs = self.mb_size
        per_origin = []
        for r in range(self.R):
            total, n = 0.0, 0
            for x, y in self._val:
                for i in range(0, x.shape[0], mbs):
                    xs, ys = x[i : i + mbs], y[i : i + mbs]
                    mb = self.mb_seq[r]
                    self.mb_seq[r] += 1
                    path = self._path(r, mb)
                    h = _eval(self.workers[r][0].module, xs, None)
                    for s in range(1, self.S):
                        h = self.coder.decode_activation(self.coder.encode_activation(h, xs), xs)
                        h = _eval(self.workers[path[s]][s].module, xs, h)
                    total += float(StageModule.loss(h, ys))
                    n += 1
            per_origin.append(total / max(1, n))
        return sum(per_origin) / len(per_origin)

    def run(self, steps: int, on_step: Callable[[int, PipelineResult], None] | None = None) -> PipelineResult:
        if steps < 1:
            raise ConfigError(f"steps: must be >= 1, got {steps}")
        res = PipelineResult(
            stages=self.S,
            replicas=self.R,
            steps=steps,
            tokens_per_step=self.R * self.spec.data.batch_size * self.spec.data.seq_len,
            subspace=self.geo.subspace,
            k=self.geo.k,
            tokens_per_micro=self.mb_size * self.spec.data.seq_len,
            overlap=self.overlap,
        )
        t0 = time.perf_counter()
        res.eval_steps.append(0)
        res.val_loss.append(self.evaluate())
        for step in range(steps):
            batches = [self.samplers[r].next() for r in range(self.R)]
            windows = [torch.cat([x, y[:, -1:]], dim=1) for x, y in batches]
            traces, losses = [], []
            for m in range(self.M):  # stage-0 replicas take turns, one micro-batch in flight
                for r in range(self.R):
                    loss, tr = self.micro_batch(r, windows[r][m * self.mb_size : (m + 1) * self.mb_size])
                    losses.append(loss)
                    traces.append(tr)
            synced = [self._stage0_step(r) for r in range(self.R)]
            if any(synced):
                res.sync_steps.append(step + 1)
            res.traces.append(traces)
            res.train_loss.append(sum(losses) / len(losses))
            if not math.isfinite(res.train_loss[-1]):
                raise FloatingPointError(f"training loss became {res.train_loss[-1]} at step {step}")
            if self.eval_every and (step + 1) % self.eval_every == 0 and step + 1 < steps:
                res.eval_steps.append(step + 1)
                res.val_loss.append(self.evaluate())
            if on_step:
                on_step(step, res)
        self._settle_last()
        for r in range(len(res.sync_steps)):
            sizes, peers = self._sync_rec.get(r, ({}, {}))
            res.sync_bytes.append(sizes)
            res.sync_peers.append(peers)
        res.eval_steps.append(steps)
        res.val_loss.append(self.evaluate())
        res.wall_s = time.perf_counter() - t0
        S = self.S
        res.fwd_s = [self._t[("f", s)] / max(1, self._n[("f", s)]) for s in range(S - 1)]
        res.bwd_s = [self._t[("b", s)] / max(1, self._n[("b", s)]) for s in range(S - 1)]
        # The last stage runs forward and backward in one call: split it 1:2 like the others.
        fb = self._t[("fb", S - 1)] / max(1, self._n[("fb", S - 1)])
        res.fwd_s.append(fb / 3)
        res.bwd_s.append(2 * fb / 3)
        return res

    def stage_parameters(self) -> list[int]:
        """Parameters of each stage that cost FLOPs (the embedding lookup costs none)."""
        out = []
        for s in range(self.S):
            mod = self.workers[0][s].module
            out.append(sum(p.numel() for n, p in mod.named_parameters() if not n.startswith("embed.")))
        return out


def _eval(module: StageModule, x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    """A forward in eval mode, as the daemon's ``eval_mid`` runs it."""
    module.eval()
    out = module(x, h)
    module.train()
    return out


def run_pipeline_simulation(
    spec: RunSpec,
    *,
    replicas: int,
    steps: int,
    link_bps: float,
    latency_s: float,
    tflops: float,
    subspace: bool | None,
    quiet: bool,
    eval_every: int = 0,
) -> dict[str, Any]:
    """`locomm-peer simulate --pipeline SxR`: train, replay the timeline, return the JSON summary."""
    import sys  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    console = Console(stderr=True)
    try:
        sim = PipelineSim(spec, replicas, subspace=subspace, eval_every=eval_every)
    except (ConfigError, ValueError) as e:
        console.print(f"[red]error:[/] {e}")
        sys.exit(2)

    def on_step(step: int, res: PipelineResult) -> None:
        if not quiet and (step + 1) % 10 == 0:
            console.print(f"step {step + 1}/{steps}: train {res.train_loss[-1]:.3f}")

    try:
        res = sim.run(steps, on_step=on_step)
    except FloatingPointError as e:
        console.print(f"[red]error:[/] {e}")
        sys.exit(2)
    out = summarize(sim, res, link_bps=link_bps, latency_s=latency_s, tflops=tflops)
    if not quiet:
        console.print(
            f"pipeline {sim.S}x{sim.R} ({'k=' + str(sim.geo.k) if sim.geo.subspace else 'no subspace'}): "
            f"val {out['final_val_loss']:.4f} (from {out['initial_val_loss']:.3f}), "
            f"{out['bytes_per_token_per_boundary']:.1f} B/token/boundary (fwd+bwd), "
            f"{out['tokens_per_s']:,.0f} tokens/s predicted, bubble {100 * out['bubble_fraction']:.1f}%"
        )
    return out
