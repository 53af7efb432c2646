"""The pipeline simulator's records and cost model: a 1F1B timeline of a recorded run, replica syncs on it.

The network is recorded, not lived (as in ``sim/simulator.py``): each micro-batch's route and
bytes are logged (:class:`MicroTrace`), and :func:`replay` turns the log into a timeline for
any link speed and compute speed: a discrete-event run of the 1F1B schedule (each stage replica
computes one task at a time, backward before forward; each replica's uplink sends one message at
a time; a stage-0 replica keeps ``in_flight`` micro-batches outstanding and starts its next batch
when the last one's backward is back). It gives the bubble fraction (share of stage-replica time
not computing) and tokens/s.

Replica syncs follow the daemon's round schedule (``protocol/rounds.py``): round r's exchange
starts when round r ends and runs through the shared flow model (``sim/flows.py``, under the
run's ``protocol.timing.Limits``), overlapped with round r + 1; it is applied at the end of round
r + 1, so the pipeline waits only for the part of the exchange longer than a round. Blocking
(``overlap=False``): the pipeline waits for the whole exchange at the end of round r.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from locomm.protocol.timing import Limits
from locomm.sim.flows import Flow, run_flows


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
    overlap: bool = True
    """Replica syncs applied one round late (the daemon's schedule); False: blocking."""
    eval_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    traces: list[list[MicroTrace]] = field(default_factory=list)
    """Per step, its micro-batches in the order they entered."""
    sync_bytes: list[dict[int, float]] = field(default_factory=list)
    """Per outer round, the bytes one replica of each stage sent to each partner."""
    sync_peers: list[dict[tuple[int, int], list[int]]] = field(default_factory=list)
    """Per outer round, the partners (replica indices) of each (stage, replica)."""
    sync_steps: list[int] = field(default_factory=list)
    """The stage-0 step at which each outer round ended."""
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


def flops_stage_s(params: int, layers: int, tokens: int, seq: int, d: int, tflops: float) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch at one stage: 2 FLOPs per parameter per token forward,
    plus causal attention (2 T d per token per layer), and twice that backward."""
    if tflops <= 0 or math.isnan(tflops):
        raise ValueError(f"tflops must be positive, got {tflops}")
    fwd = (2 * params + 2 * layers * seq * d) * tokens / (tflops * 1e12)
    return fwd, 2 * fwd


@dataclass
class Timeline:
    """The 1F1B timeline of a pipeline run."""

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
    limits: Limits | None = None,
) -> Timeline:
    """The 1F1B timeline of a recorded run, with its replica syncs (see the module docstring)."""
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
    rounds = {s: i for i, s in enumerate(res.sync_steps)}
    bps = sync_bps or link_bps
    exchange_end: float | None = None  # the pending exchange (applied at the end of the next round)
    for step in range(len(res.traces)):
        t = run_step(step, t)
        if step + 1 not in rounds:
            continue
        if exchange_end is not None:  # apply the previous round's exchange: wait for what is left of it
            t = max(t, exchange_end)
        i = rounds[step + 1]
        peers = res.sync_peers[i] if i < len(res.sync_peers) else {}
        exchange_end = t + _sync_s(res.sync_bytes[i], peers, R, bps, latency_s, limits)
        if not res.overlap:
            t, exchange_end = exchange_end, None
    if exchange_end is not None:  # the daemon settles its last exchange before the final evaluation
        t = max(t, exchange_end)
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


def _sync_s(
    nbytes: dict[int, float],
    peers: dict[tuple[int, int], list[int]],
    replicas: int,
    link_bps: float,
    latency_s: float,
    limits: Limits | None,
) -> float:
    """Seconds one replica-sync round takes: every replica pushes its stage's payload to each partner at once,
    on max-min fair shared links (``sim/flows.py``); without recorded partners, one payload per link."""
    if not peers:
        return latency_s + max(nbytes.values(), default=0.0) * 8 / link_bps
    flows = [
        Flow(s * replicas + r, s * replicas + p, nbytes.get(s, 0.0), 0.0) for (s, r), ps in peers.items() for p in ps
    ]
    if not flows:
        return 0.0
    n = 1 + max(max(f.src, f.dst) for f in flows)
    run_flows(flows, [link_bps / 8] * n, [link_bps / 8] * n, limits)
    return latency_s + max((f.done if math.isfinite(f.done) else f.cut) for f in flows)


def summarize(sim: Any, res: PipelineResult, *, link_bps: float, latency_s: float, tflops: float) -> dict[str, Any]:
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
        limits=sim.limits,
    )
    local_tl = replay(
        res,
        fwd_s=res.fwd_s,
        bwd_s=res.bwd_s,
        link_bps=link_bps,
        latency_s=latency_s,
        in_flight=in_flight,
        limits=sim.limits,
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
        "sync_overlap": res.overlap,
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
