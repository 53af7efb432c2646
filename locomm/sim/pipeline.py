"""Pipeline mode in one process: S stages x R replicas on the sans-IO core, and a cost model for its timeline.

Notable:
- Every stage replica is a real :class:`locomm.train.stage.StageWorker` (the stage
  server's compute core); every boundary crossing goes through the stage server's
  :class:`locomm.compression.boundary.BoundaryCoder`, so lossy stages really change what the
  next stage sees and the bytes counted are those the daemon sends (token window,
  activation, gradient).
- Routing is the daemon's: :func:`locomm.protocol.routing.route`, seeded per micro-batch.
  Stage-0 replica r draws its own data shard (worker r of R). Steps follow the
  workers' own rule (a replica steps after a batch's worth of micro-batches).
- Every ``outer.inner_steps`` steps the replicas of each stage run the configured outer
  algorithm (``protocol/``, unchanged) on that stage's parameters, through the daemon's
  payload codec; the result is re-projected onto span(U).
- The network is recorded, not lived (as in ``sim/simulator.py``): each micro-batch's
  route and bytes are logged, and :func:`replay` turns the log into a timeline for any
  link speed and compute speed: a discrete-event run of the 1F1B schedule (each stage
  replica computes one task at a time, backward before forward; each replica's uplink
  sends one message at a time; a stage-0 replica keeps ``in_flight`` micro-batches
  outstanding and starts its next batch when the last one's backward is back). It gives
  the bubble fraction (share of stage-replica time not computing) and tokens/s.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from locomm.compression.boundary import BoundaryCoder
from locomm.compression.payload import PayloadCodec
from locomm.config import ConfigError, RunSpec
from locomm.data import BatchSampler, TokenSplits, eval_batches, load_corpus
from locomm.model.stages import Geometry, StageModule, build_stages
from locomm.protocol import build_outer
from locomm.protocol.routing import route
from locomm.train.stage import StageWorker


@dataclass(frozen=True)
class MicroTrace:
    """One micro-batch on the network: its route and the bytes of each boundary crossing."""

    origin: int
    route: tuple[int, ...]
    """The replica of each stage (route[0] == origin)."""
    fwd_bytes: tuple[int, ...]
    """Per boundary b (stage b -> b+1): token window plus coded activation."""
    bwd_bytes: tuple[int, ...]
    """Per boundary b (stage b+1 -> b): coded activation gradient."""


@dataclass
class PipelineResult:
    stages: int
    replicas: int
    steps: int
    tokens_per_step: int
    subspace: bool
    k: int
    tokens_per_micro: int
    eval_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    traces: list[list[MicroTrace]] = field(default_factory=list)
    """Per step, its micro-batches in the order they entered."""
    sync_bytes: list[dict[int, float]] = field(default_factory=list)
    """Per outer round, the bytes one replica of each stage sent to each partner."""
    sync_steps: list[int] = field(default_factory=list)
    fwd_s: list[float] = field(default_factory=list)
    """Measured seconds of one micro-batch's forward at each stage (this machine)."""
    bwd_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1]

    def bytes_per_token_per_boundary(self) -> dict[str, float]:
        """Forward, backward and their sum, per token per boundary crossing, after all coding."""
        fwd = bwd = tokens = 0
        for step in self.traces:
            for mb in step:
                fwd += sum(mb.fwd_bytes)
                bwd += sum(mb.bwd_bytes)
                tokens += self.tokens_per_micro * len(mb.fwd_bytes)
        tokens = max(1, tokens)
        return {"forward": fwd / tokens, "backward": bwd / tokens, "total": (fwd + bwd) / tokens}


class PipelineSim:
    """S stages x R replicas of one run spec, trained in one process."""

    def __init__(
        self,
        spec: RunSpec,
        replicas: int,
        *,
        splits: TokenSplits | None = None,
        subspace: bool | None = None,
        eval_every: int = 0,
    ) -> None:
        if spec.pipeline.stages < 2:
            raise ConfigError("pipeline.stages: the pipeline simulator needs at least 2 stages")
        if not 1 <= replicas <= 16:
            raise ConfigError(f"replicas: must be in [1, 16], got {replicas}")
        self.spec = spec
        self.S, self.R = spec.pipeline.stages, replicas
        self.geo = Geometry.of(spec, subspace=subspace)
        self.coder = BoundaryCoder(spec, self.geo)
        self.splits = splits if splits is not None else load_corpus(spec.data)
        self.eval_every = eval_every
        # Every replica starts from the same weights: each builds the same unsplit model and slices it.
        self.workers = [[None] * self.S for _ in range(self.R)]  # type: list[list[Any]]
        for r in range(self.R):
            for s, mod in enumerate(build_stages(spec, self.geo)):
                self.workers[r][s] = StageWorker(spec, s, geo=self.geo, module=mod)
        self.samplers = [
            BatchSampler(self.splits.train, spec.data, seed=spec.train.seed, worker_id=r, num_workers=self.R)
            for r in range(self.R)
        ]
        self._val = eval_batches(self.splits.val, spec.data, spec.train.eval_batches)
        self.M = spec.data.batch_size // spec.pipeline.micro_batch_size
        self.mb_size = spec.pipeline.micro_batch_size
        self.algos: list[list[Any]] = []
        self.coders: list[PayloadCodec] = []
        if self.R > 1 and spec.outer.algo not in ("none", "ddp"):
            for s in range(self.S):
                self.algos.append([build_outer(spec.outer, self.workers[r][s].params(), r) for r in range(self.R)])
                a0 = self.algos[s][0]
                shapes = {k: tuple(p.shape) for k, p in self.workers[0][s].params().items()}
                self.coders.append(PayloadCodec(shapes, a0.payload_roles, spec.compression, encoded=a0.payload_encoded))
        self._mb_id = 0
        self._t = defaultdict(float)
        self._n = defaultdict(int)

    # -- one micro-batch -----------------------------------------------------------------

    def _timed(self, key: tuple[str, int], fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        self._t[key] += time.perf_counter() - t0
        self._n[key] += 1
        return out

    def micro_batch(self, origin: int, window: torch.Tensor) -> tuple[float, MicroTrace]:
        """Forward through a routed path of replicas, backward along the same path; returns the loss."""
        mb = self._mb_id
        self._mb_id += 1
        x, y = window[:, :-1], window[:, 1:]
        path = [origin] + [int(route(self.spec.train.seed, origin, mb, s, range(self.R))) for s in range(1, self.S)]
        fwd_b, bwd_b = [], []
        h: torch.Tensor | None = None
        for s in range(self.S - 1):
            w = self.workers[path[s]][s]
            h = self._timed(("f", s), w.forward, mb, x, h)
            data = self.coder.encode_activation(h, x)
            fwd_b.append(len(data) + len(self.coder.encode_window(window)))
            h = self.coder.decode_activation(data, x)
        last = self.workers[path[-1]][self.S - 1]
        loss, g = self._timed(("fb", self.S - 1), last.forward_backward, x, y, h)
        for s in range(self.S - 2, -1, -1):
            data = self.coder.encode_gradient(g, x)
            bwd_b.append(len(data))
            g = self._timed(("b", s), self.workers[path[s]][s].backward, mb, self.coder.decode_gradient(data, x))
        for s in range(self.S):
            self.workers[path[s]][s].maybe_step()
        return loss, MicroTrace(origin, tuple(path), tuple(fwd_b), tuple(reversed(bwd_b)))

    # -- outer rounds ----------------------------------------------------------------------

    def _sync(self, round_idx: int) -> dict[int, float]:
        """Every stage's replicas run the outer algorithm on that stage's parameters."""
        sent: dict[int, float] = {}
        members = list(range(self.R))
        for s in range(self.S):
            params = [self.workers[r][s].params() for r in range(self.R)]
            plans = [self.algos[s][r].plan(round_idx, members, params[r]) for r in range(self.R)]
            wire, size = [], 0.0
            for plan in plans:
                received, nbytes = self.coders[s].transmit(plan.payload)
                wire.append(received)
                size = max(size, nbytes)
            for r, plan in enumerate(plans):
                got = {r: plan.payload, **{j: wire[j] for j in plan.peers}}
                self.algos[s][r].apply(round_idx, params[r], got)
                self.workers[r][s].module.project_()
            sent[s] = size
        return sent

    # -- the run ---------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean over replica chains (replica r of every stage) of the validation loss, through the wire's coding."""
        total = []
        for r in range(self.R):
            mods = [self.workers[r][s].module for s in range(self.S)]
            for m in mods:
                m.eval()
            acc = 0.0
            for x, y in self._val:
                h = None
                for m in mods:
                    if h is not None:
                        h = self.coder.decode_activation(self.coder.encode_activation(h, x), x)
                    h = m(x, h)
                acc += float(StageModule.loss(h, y))
            total.append(acc / len(self._val))
        return sum(total) / len(total)

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
        )
        t0 = time.perf_counter()
        res.eval_steps.append(0)
        res.val_loss.append(self.evaluate())
        H = self.spec.outer.inner_steps
        for step in range(steps):
            batches = [self.samplers[r].next() for r in range(self.R)]
            windows = [torch.cat([x, y[:, -1:]], dim=1) for x, y in batches]
            traces, losses = [], []
            for m in range(self.M):  # stage-0 replicas feed the pipeline in turn
                for r in range(self.R):
                    loss, tr = self.micro_batch(r, windows[r][m * self.mb_size : (m + 1) * self.mb_size])
                    losses.append(loss)
                    traces.append(tr)
            res.traces.append(traces)
            res.train_loss.append(sum(losses) / len(losses))
            if not math.isfinite(res.train_loss[-1]):
                raise FloatingPointError(f"training loss became {res.train_loss[-1]} at step {step}")
            if self.algos and (step + 1) % H == 0:
                res.sync_bytes.append(self._sync((step + 1) // H - 1))
                res.sync_steps.append(step + 1)
            if self.eval_every and (step + 1) % self.eval_every == 0 and step + 1 < steps:
                res.eval_steps.append(step + 1)
                res.val_loss.append(self.evaluate())
            if on_step:
                on_step(step, res)
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


# ------------------------------------------------------------------------------ the cost model


def flops_stage_s(params: int, layers: int, tokens: int, seq: int, d: int, tflops: float) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch at one stage: 2 FLOPs per parameter per token forward,
    plus causal attention (2 T d per token per layer), and twice that backward."""
    if tflops <= 0 or math.isnan(tflops):
        raise ValueError(f"tflops must be positive, got {tflops}")
    fwd = (2 * params + 2 * layers * seq * d) * tokens / (tflops * 1e12)
    return fwd, 2 * fwd


@dataclass
class Timeline:
    wall_s: float
    busy_s: dict[tuple[int, int], float]
    """Compute seconds of each (stage, replica)."""
    overlap_share: dict[int, float]
    """Per stage: the share of its computing time (any replica) during which another stage computed too."""

    def bubble_fraction(self) -> float:
        n = len(self.busy_s)
        return 1.0 - sum(self.busy_s.values()) / (n * self.wall_s) if self.wall_s > 0 and n else 0.0


def replay(
    res: PipelineResult,
    *,
    fwd_s: list[float],
    bwd_s: list[float],
    link_bps: float,
    latency_s: float,
    in_flight: int,
    sync_bps: float | None = None,
) -> Timeline:
    """The 1F1B timeline of a recorded run (see the module docstring)."""
    S, R = res.stages, res.replicas
    events: list[tuple[float, int, Callable[[float], None]]] = []
    seq = [0]

    def at(t: float, fn: Callable[[float], None]) -> None:
        seq[0] += 1
        heapq.heappush(events, (t, seq[0], fn))

    free_at: dict[Any, float] = defaultdict(float)
    queue: dict[tuple[int, int], list[tuple[int, float, int, float, Callable[[float], None]]]] = defaultdict(list)
    running: dict[tuple[int, int], bool] = defaultdict(bool)
    busy: dict[tuple[int, int], float] = {(s, r): 0.0 for s in range(S) for r in range(R)}
    intervals: list[tuple[float, float, int]] = []

    def compute(node: tuple[int, int], prio: int, dur: float, then: Callable[[float], None], t: float) -> None:
        seq[0] += 1
        heapq.heappush(queue[node], (prio, t, seq[0], dur, then))
        kick(node, t)

    def kick(node: tuple[int, int], t: float) -> None:
        if running[node] or not queue[node]:
            return
        _, _, _, dur, then = heapq.heappop(queue[node])
        running[node] = True
        busy[node] += dur
        intervals.append((t, t + dur, node[0]))

        def done(t_end: float) -> None:
            running[node] = False
            then(t_end)
            kick(node, t_end)

        at(t + dur, done)

    def send(src: tuple[int, int], nbytes: float, then: Callable[[float], None], t: float) -> None:
        start = max(t, free_at[("up", src)])
        end = start + nbytes * 8 / link_bps
        free_at[("up", src)] = end
        at(end + latency_s, then)

    def run_step(step: int, t_start: float) -> float:
        traces = res.traces[step]
        per_origin: dict[int, list[MicroTrace]] = defaultdict(list)
        for tr in traces:
            per_origin[tr.origin].append(tr)
        finished: dict[int, float] = {}
        outstanding = defaultdict(int)
        nxt = defaultdict(int)
        left = {o: len(v) for o, v in per_origin.items()}

        def issue(o: int, t: float) -> None:
            while outstanding[o] < in_flight and nxt[o] < len(per_origin[o]):
                tr = per_origin[o][nxt[o]]
                nxt[o] += 1
                outstanding[o] += 1
                forward(tr, 0, t)

        def forward(tr: MicroTrace, s: int, t: float) -> None:
            node = (s, tr.route[s])
            if s == S - 1:
                compute(node, 0, fwd_s[s] + bwd_s[s], lambda te: backward_send(tr, s, te), t)
            else:
                compute(
                    node, 1, fwd_s[s], lambda te: send(node, tr.fwd_bytes[s], lambda ta: forward(tr, s + 1, ta), te), t
                )

        def backward_send(tr: MicroTrace, s: int, t: float) -> None:
            # stage s finished its backward: send the gradient to stage s-1 (or finish at stage 0)
            if s == 0:
                outstanding[tr.origin] -= 1
                left[tr.origin] -= 1
                if left[tr.origin] == 0:
                    finished[tr.origin] = t
                issue(tr.origin, t)
                return
            src = (s, tr.route[s])
            send(
                src,
                tr.bwd_bytes[s - 1],
                lambda ta: compute(
                    (s - 1, tr.route[s - 1]), 0, bwd_s[s - 1], lambda te: backward_send(tr, s - 1, te), ta
                ),
                t,
            )

        for o in per_origin:
            issue(o, t_start)
        while events:
            t, _, fn = heapq.heappop(events)
            fn(t)
        return max(finished.values(), default=t_start)

    t = 0.0
    sync_at = dict(zip(res.sync_steps, res.sync_bytes))
    for step in range(len(res.traces)):
        t = run_step(step, t)
        if step + 1 in sync_at:  # an outer round: each replica sends its stage's payload to its partner(s)
            bps = sync_bps or link_bps
            t += latency_s + max(sync_at[step + 1].values(), default=0.0) * 8 / bps
    overlap = overlap_by_stage(intervals, S)
    return Timeline(wall_s=t, busy_s=busy, overlap_share=overlap)


def overlap_by_stage(intervals: list[tuple[float, float, int]], stages: int) -> dict[int, float]:
    """Per stage: the share of the time it computed (any replica) in which another stage computed too."""
    points = []
    for a, b, s in intervals:
        if b > a:
            points.append((a, 1, s))
            points.append((b, -1, s))
    points.sort(key=lambda p: (p[0], p[1]))
    active = [0] * stages
    both = {s: 0.0 for s in range(stages)}
    alone = {s: 0.0 for s in range(stages)}
    last = None
    for t, delta, s in points:
        if last is not None and t > last:
            busy = [i for i in range(stages) if active[i] > 0]
            for i in busy:
                (both if len(busy) >= 2 else alone)[i] += t - last
        active[s] += delta
        last = t
    return {s: both[s] / (both[s] + alone[s]) if both[s] + alone[s] > 0 else 0.0 for s in range(stages)}


def summarize(
    sim: PipelineSim, res: PipelineResult, *, link_bps: float, latency_s: float, tflops: float
) -> dict[str, Any]:
    """The --json summary: losses, bytes per token per boundary, and the timeline at the cost model's speeds."""
    spec = sim.spec
    tokens_mb = sim.mb_size * spec.data.seq_len
    params = sim.stage_parameters()
    flops = [
        flops_stage_s(params[s], len(sim.geo.ranges[s]), tokens_mb, spec.data.seq_len, sim.geo.d, tflops)
        for s in range(sim.S)
    ]
    in_flight = spec.pipeline.in_flight
    model_tl = replay(
        res,
        fwd_s=[f for f, _ in flops],
        bwd_s=[b for _, b in flops],
        link_bps=link_bps,
        latency_s=latency_s,
        in_flight=in_flight,
    )
    local_tl = replay(
        res, fwd_s=res.fwd_s, bwd_s=res.bwd_s, link_bps=link_bps, latency_s=latency_s, in_flight=in_flight
    )
    tokens = res.tokens_per_step * res.steps
    bpt = res.bytes_per_token_per_boundary()
    return {
        "stages": sim.S,
        "replicas": sim.R,
        "steps": res.steps,
        "subspace": res.subspace,
        "k": res.k,
        "d_model": sim.geo.d,
        "activation_codec": sim.coder.act_stack,
        "gradient_codec": sim.coder.grad_stack,
        "outer_algo": spec.outer.algo if sim.algos else "none",
        "inner_steps": spec.outer.inner_steps,
        "initial_val_loss": res.val_loss[0],
        "final_val_loss": res.final_val_loss,
        "final_train_loss": res.train_loss[-1],
        "bytes_per_token_per_boundary": bpt["total"],
        "bytes_per_token_per_boundary_fwd": bpt["forward"],
        "bytes_per_token_per_boundary_bwd": bpt["backward"],
        "uncompressed_bf16_bytes_per_token": 2 * sim.geo.d,
        "tokens_per_s": tokens / model_tl.wall_s if model_tl.wall_s > 0 else float("inf"),
        "bubble_fraction": model_tl.bubble_fraction(),
        "tokens_per_s_local_compute": tokens / local_tl.wall_s if local_tl.wall_s > 0 else float("inf"),
        "bubble_fraction_local_compute": local_tl.bubble_fraction(),
        "stage_overlap_share": {str(s): v for s, v in model_tl.overlap_share.items()},
        "stage_overlap_share_local_compute": {str(s): v for s, v in local_tl.overlap_share.items()},
        "link_bps": link_bps,
        "latency_s": latency_s,
        "tflops": tflops,
        "in_flight": in_flight,
        "micro_batch_size": sim.mb_size,
        "micro_batches_per_step": sim.M,
        "stage_fwd_s_local": res.fwd_s,
        "stage_bwd_s_local": res.bwd_s,
        "sync_bytes_per_round": [max(b.values(), default=0) for b in res.sync_bytes][:1],
        "real_wall_s": res.wall_s,
        "curve": {"steps": res.eval_steps, "val_loss": res.val_loss},
    }


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
