"""SCAPE's per-step sync on N virtual workers of one island, against its baselines (docs/results/scape.md).

Every worker is a real ``Trainer`` with its own replica and its own AdamS, drawing its own IID batch
(the ``BatchSampler`` of the DDP path: ``worker_id=w, num_workers=N``). Each step it computes its
gradient (``Trainer.compute_gradients``), the workers' messages go through ``protocol/scape.py``
(``ScapeSync.plan``, ``reduce``, ``ScapeSync.apply``), every worker writes the same synchronized
``ghat`` into ``.grad`` and steps (``Trainer.apply_gradients``: clip, scheduled LR, AdamS). Nothing
keeps the replicas together but the sync itself, so the run checks after every step that every
member's weights and first moment are bit-identical to worker 0's.

The methods, at the same tokens (N workers x one batch each per step) and the same schedule:

- ``scape``: SCAPE at ``outer.scape_sparsity`` (masks from AdamS's first moment, one step late);
- ``adams_ddp``: the same code at sparsity 0, dense AdamS data parallelism (the baseline the sparsity
  is measured against);
- ``adamw_ddp``: the simulator's DDP path (``sim/simulator.py``, one shared replica, inner AdamW);
- ``topk_raw``: each worker's own top-(1 - sparsity) of its raw gradient (plus its residual: error
  feedback as ``outer.scape_error_feedback`` says), the mean of the N sparse vectors scattered, AdamS.

Bytes are one worker's message per step: fp32 values, plus its indices as LEB128 gaps (SCAPE: its
slice of the next mask; top-k: all of its own indices), against the dense fp32 gradient. The cost
model (``sim/network.py``, every worker on the same link) times a step as:

- dense: compute + a ring all-reduce of the gradient (blocking);
- SCAPE: max(compute, the ring all-gather of the mask slices) + a ring all-reduce of the values: the
  next mask comes from the moment held before this step, so its gather overlaps this step's compute,
  and every worker sends values on the same indices, so they can be summed on the way;
- top-k raw: compute + a ring all-gather of every worker's values and indices (the indices differ,
  so nothing can be summed on the way).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from locomm.config import RunSpec
from locomm.data import TokenSplits, load_corpus
from locomm.optim.adams import by_param
from locomm.protocol.scape import ScapeSync, encode_indices, reduce
from locomm.sim.network import NetworkModel, flops_step_s
from locomm.sim.simulator import Simulator
from locomm.train import Trainer

METHODS = ("scape", "adams_ddp", "adamw_ddp", "topk_raw")


@dataclass
class MethodResult:
    """One method's run."""

    method: str
    optimizer: str
    sparsity: float
    workers: int
    error_feedback: bool
    steps: list[int] = field(default_factory=list)
    """Inner steps done at each evaluation."""
    val_loss: list[float] = field(default_factory=list)
    """Validation loss (nats/byte) of worker 0 (all members are the same model) at each evaluation."""
    train_loss: list[float] = field(default_factory=list)
    """Mean over workers of each step's training loss."""
    values_bytes: float = 0.0
    """Per worker per step, mean over the run: fp32 values sent."""
    mask_bytes: float = 0.0
    """Per worker per step, mean over the run: indices sent (LEB128 gaps)."""
    dense_bytes: float = 0.0
    """The dense fp32 gradient of one worker."""
    wire_bytes: float = 0.0
    """Per worker per step, mean over the run: what the collective puts on a worker's uplink."""
    sim_time_s: float = 0.0
    """The cost model's time for the whole run."""
    identical: bool | None = None
    """Every member's weights and first moment bit-identical to worker 0's after every step (None: one
    shared replica, nothing to compare)."""
    real_s: float = 0.0

    @property
    def final_val_loss(self) -> float:
        return self.val_loss[-1]

    @property
    def bytes_per_step(self) -> float:
        return self.values_bytes + self.mask_bytes

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["final_val_loss"] = self.final_val_loss
        d["bytes_per_step"] = self.bytes_per_step
        d["bytes_vs_dense"] = self.bytes_per_step / self.dense_bytes if self.dense_bytes else None
        return d


@dataclass(frozen=True)
class Cost:
    """The cost model of one run: every worker on one link (``NetworkModel``, no heterogeneity)."""

    link_bps: float = 1e9
    latency_s: float = 0.0005
    tflops: float = 10.0

    def network(self, workers: int, step_s: float) -> NetworkModel:
        return NetworkModel.build(
            workers, link_bps=self.link_bps, latency_s=self.latency_s, heterogeneity=0.0, step_s=step_s
        )


def _first_moments(t: Trainer) -> dict[str, torch.Tensor] | None:
    """AdamS's ``exp_avg`` per parameter name (None before its first step)."""
    out = {}
    for k, p in t.model.named_parameters():
        st = t.optimizer.state.get(p)
        if not st:
            return None
        out[k] = st["exp_avg"]
    return out


def _set_grads(t: Trainer, grads: dict[str, torch.Tensor]) -> None:
    for k, p in t.model.named_parameters():
        p.grad = grads[k].to(device=p.device, dtype=p.dtype).reshape(p.shape).clone()


def _same(a: Trainer, b: Trainer) -> bool:
    for (_, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        if not torch.equal(p, q):
            return False
        sp, sq = a.optimizer.state.get(p), b.optimizer.state.get(q)
        if bool(sp) != bool(sq) or (sp and not torch.equal(sp["exp_avg"], sq["exp_avg"])):
            return False
    return True


class TopkRaw:
    """The paper's unstable baseline: each worker's own top-k of ``g + r`` (r: its residual, or none)."""

    def __init__(self, numel: int, sparsity: float, error_feedback: bool) -> None:
        self.keep = min(numel, max(1, math.ceil((1.0 - sparsity) * numel)))
        self.error_feedback = error_feedback
        self.residual = torch.zeros(numel, dtype=torch.float32)

    def plan(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sorted indices and their values of this step's message."""
        u = self.residual.add_(g) if self.error_feedback else g
        idx = u.abs().topk(self.keep, sorted=False).indices.sort().values
        values = u[idx].clone()
        if self.error_feedback:
            u[idx] = 0.0
        return idx, values


def _evaluate(res: MethodResult, t: Trainer, step: int) -> None:
    loss = t.evaluate()
    if not math.isfinite(loss):
        raise FloatingPointError(f"{res.method}: validation loss diverged at step {step}")
    res.steps.append(step)
    res.val_loss.append(loss)


def run_island(
    spec: RunSpec,
    workers: int,
    steps: int,
    *,
    method: str = "scape",
    splits: TokenSplits | None = None,
    eval_every: int = 50,
    cost: Cost | None = None,
    check_identical: bool = True,
    on_step: Callable[[int, MethodResult], None] | None = None,
) -> MethodResult:
    """SCAPE (at ``spec.outer.scape_sparsity``; 0 is ``adams_ddp``) or ``topk_raw`` on per-worker AdamS replicas."""
    if method not in ("scape", "adams_ddp", "topk_raw"):
        raise ValueError(f"run_island runs scape, adams_ddp or topk_raw, not {method!r}")
    if not 2 <= workers <= 64 or steps < 1:
        raise ValueError(f"need 2-64 workers and >= 1 step, got {workers} and {steps}")
    sparsity = 0.0 if method == "adams_ddp" else spec.outer.scape_sparsity
    if method == "topk_raw" and sparsity == 0:
        raise ValueError("topk_raw needs a sparsity above 0")
    ef = spec.outer.scape_error_feedback
    spec = spec.replace("inner", name="adams").replace("train", steps=steps)
    splits = splits if splits is not None else load_corpus(spec.data)
    cost = cost or Cost()
    t0 = time.perf_counter()
    trainers = [Trainer(spec, splits=splits, worker_id=w, num_workers=workers) for w in range(workers)]
    shapes = {k: tuple(p.shape) for k, p in trainers[0].model.named_parameters()}
    outer = spec.outer if method == "scape" else spec.replace("outer", scape_sparsity=sparsity).outer
    syncs = [ScapeSync.of_spec(shapes, outer, rank=w, workers=workers) for w in range(workers)]
    topk = [TopkRaw(syncs[0].numel, sparsity, ef) for _ in range(workers)] if method == "topk_raw" else []
    numel = syncs[0].numel
    step_s = flops_step_s(trainers[0].model.num_parameters(), trainers[0].tokens_per_step, cost.tflops)
    net = cost.network(workers, step_s)
    members = list(range(workers))
    res = MethodResult(method, "adams", sparsity, workers, ef, dense_bytes=4.0 * numel, identical=True)
    res.identical = True if check_identical else None
    _evaluate(res, trainers[0], 0)
    vb = mb = wire = 0.0
    for step in range(steps):
        res.train_loss.append(sum(t.compute_gradients() for t in trainers) / workers)
        if topk:
            sent = [
                tk.plan(syncs[0].flatten({k: p.grad for k, p in t.model.named_parameters()}))
                for tk, t in zip(topk, trainers, strict=True)
            ]
            ghat_flat = torch.zeros(numel, dtype=torch.float32)
            for idx, values in sent:  # rank order, divided once
                ghat_flat.index_add_(0, idx, values)
            ghat = syncs[0].unflatten(ghat_flat.div_(workers))
            sizes = {w: 4.0 * v.numel() + len(encode_indices(i)) for w, (i, v) in enumerate(sent)}
            vb += sum(4.0 * v.numel() for _, v in sent) / workers
            mb += sum(len(encode_indices(i)) for i, _ in sent) / workers
            total = sum(sizes.values())
            wire += sum(total - s for s in sizes.values()) / workers
            res.sim_time_s += step_s + net.ring_allgather_s(members, sizes)
            for t in trainers:
                _set_grads(t, ghat)
        else:
            msgs, mask_b = [], {}
            for w, t in enumerate(trainers):
                size = syncs[w].bytes_per_step()
                msgs.append(syncs[w].plan({k: p.grad for k, p in t.model.named_parameters()}, _first_moments(t)))
                shard = msgs[-1].mask_shard
                lo = syncs[w].bounds[w][0]
                mask_b[w] = float(len(encode_indices(shard - lo))) if shard is not None else 0.0
                vb += size["values"] / workers
            mb += sum(mask_b.values()) / workers
            values_b = 4.0 * msgs[0].values.numel()
            wire += 2 * (workers - 1) / workers * values_b + sum(mask_b.values()) * (workers - 1) / workers
            gather = net.ring_allgather_s(members, mask_b) if any(mask_b.values()) else 0.0
            res.sim_time_s += max(step_s, gather) + net.ring_allreduce_s(members, values_b)
            synced = reduce(msgs)
            for w, t in enumerate(trainers):
                _set_grads(t, syncs[w].apply(synced))
                if spec.outer.scape_hold:
                    t.optimizer.hold_off(by_param(t.model.named_parameters(), syncs[w].held()))
        for t in trainers:
            t.apply_gradients()
        if check_identical and res.identical:
            res.identical = all(_same(trainers[0], t) for t in trainers[1:])
        if (step + 1) % eval_every == 0 or step == steps - 1:
            _evaluate(res, trainers[0], step + 1)
        if on_step:
            on_step(step, res)
    res.values_bytes, res.mask_bytes, res.wire_bytes = vb / steps, mb / steps, wire / steps
    res.real_s = time.perf_counter() - t0
    return res


def run_adamw_ddp(
    spec: RunSpec,
    workers: int,
    steps: int,
    *,
    splits: TokenSplits | None = None,
    eval_every: int = 50,
    cost: Cost | None = None,
    on_step: Callable[[int, MethodResult], None] | None = None,
) -> MethodResult:
    """Dense AdamW DDP: the simulator's DDP path (raw fp32 gradients, ring all-reduce every step)."""
    spec = spec.replace("inner", name="adamw").replace("outer", algo="ddp", inner_steps=1).replace("train", steps=steps)
    cost = cost or Cost()
    t0 = time.perf_counter()
    sim = Simulator(spec, workers, splits=splits, codec="none", eval_every=eval_every)
    numel = sum(p.numel() for p in sim.trainers[0].model.parameters())
    step_s = flops_step_s(sim.trainers[0].model.num_parameters(), sim.trainers[0].tokens_per_step, cost.tflops)
    net = cost.network(workers, step_s)
    res = MethodResult("adamw_ddp", "adamw", 0.0, workers, False, dense_bytes=4.0 * numel, identical=None)

    def on_round(r: int, sr: Any) -> None:
        if on_step:
            on_step(r, res)

    sr = sim.run(steps, on_round=on_round)
    res.steps, res.val_loss, res.train_loss = list(sr.steps), list(sr.val_loss), list(sr.train_loss)
    sizes = [max(rec.bytes_sent.values()) for rec in sr.records]
    res.values_bytes = sum(sizes) / len(sizes)
    res.wire_bytes = 2 * (workers - 1) / workers * res.values_bytes
    res.sim_time_s = sum(step_s + net.ring_allreduce_s(list(range(workers)), s) for s in sizes)
    res.real_s = time.perf_counter() - t0
    return res


def run_method(spec: RunSpec, workers: int, steps: int, method: str, **kw: Any) -> MethodResult:
    """One of :data:`METHODS` (``scape`` and ``topk_raw`` at ``spec.outer.scape_sparsity``)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if method == "adamw_ddp":
        kw.pop("check_identical", None)
        return run_adamw_ddp(spec, workers, steps, **kw)
    return run_island(spec, workers, steps, method=method, **kw)


def comparison(results: list[MethodResult], reference: str = "adams_ddp") -> list[dict[str, Any]]:
    """Table rows: each result's final loss, its gap to ``reference``'s, bytes against dense and time."""
    ref = next((r for r in results if r.method == reference), None)
    rows = []
    for r in results:
        rows.append(
            {
                "method": r.method,
                "optimizer": r.optimizer,
                "sparsity": r.sparsity,
                "error_feedback": r.error_feedback,
                "final_val_loss": r.final_val_loss,
                "vs_dense_adams": (r.final_val_loss / ref.final_val_loss - 1) if ref else None,
                "bytes_per_step": r.bytes_per_step,
                "values_bytes": r.values_bytes,
                "mask_bytes": r.mask_bytes,
                "bytes_vs_dense": r.bytes_per_step / r.dense_bytes,
                "wire_bytes_per_step": r.wire_bytes,
                "sim_time_s": r.sim_time_s,
                "identical": r.identical,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a plain-text table."""
    head = f"{'method':<12}{'sparsity':>9}{'val loss':>10}{'vs AdamS':>10}{'B/step':>12}{'vs dense':>10}"
    head += f"{'sim time s':>12}  identical"
    lines = [head]
    for r in rows:
        gap = "-" if r["vs_dense_adams"] is None else f"{100 * r['vs_dense_adams']:+.2f}%"
        same = {True: "yes", False: "NO", None: "-"}[r["identical"]]
        lines.append(
            f"{r['method']:<12}{r['sparsity']:>9.2f}{r['final_val_loss']:>10.4f}{gap:>10}"
            f"{r['bytes_per_step']:>12.0f}{r['bytes_vs_dense']:>10.4f}{r['sim_time_s']:>12.2f}  {same}"
        )
    return "\n".join(lines)


def methods_for(sparsity: float, baselines: bool = True) -> list[str]:
    """What ``simulate --algo scape`` runs: SCAPE and, with ``baselines``, the dense ones and top-k raw."""
    if sparsity == 0:  # SCAPE at sparsity 0 is dense AdamS DDP
        return ["adams_ddp", "adamw_ddp"] if baselines else ["adams_ddp"]
    return ["scape", "adams_ddp", "adamw_ddp", "topk_raw"] if baselines else ["scape"]


def summary(spec: RunSpec, results: list[MethodResult], cost: Cost) -> dict[str, Any]:
    """The JSON summary of a comparison: the table's rows, each run's curve, and the setup."""
    return {
        "algo": "scape",
        "workers": results[0].workers,
        "steps": results[0].steps[-1],
        "preset": spec.model.preset,
        "sparsity": spec.outer.scape_sparsity,
        "error_feedback": spec.outer.scape_error_feedback,
        "seed": spec.train.seed,
        "outer_seed": spec.outer.seed,
        "sharding": spec.data.sharding,
        "tokens_per_worker_step": spec.data.batch_size * spec.data.seq_len,
        "link_bps": cost.link_bps,
        "latency_s": cost.latency_s,
        "tflops": cost.tflops,
        "inner_optimizer": "adams for scape, adams_ddp and topk_raw (whatever inner.name says); adamw for adamw_ddp",
        "table": comparison(results),
        "runs": {r.method: r.as_json() for r in results},
    }
