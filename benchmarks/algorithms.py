"""Compare DDP, DiLoCo, NoLoCo, GASLoC and SparseLoCo in the simulator on one token budget.

Each (algorithm, worker count) trains once on the nano model (real training on
this CPU); its recorded traffic is then replayed on several networks:

- 80 Mbit/s consumer links, heterogeneous (link and compute speeds spread over
  10x, i.e. heterogeneity 1.0), 30 ms latency;
- 10 Gbit/s homogeneous links, 1 ms latency.

Two timelines per network: at the nano model's real size, and scaled to a 125M
parameter model (bytes and FLOPs both x125M/nano; the same as dividing link speed
and compute speed by that factor; latency unchanged), since a run over consumer
links is only interesting for models of that size or larger.

Target loss for "time to target": DiLoCo's final validation loss + 2%, at each
worker count; an algorithm that never gets there shows "-".

    python benchmarks/algorithms.py                  # 8 and 16 workers, ~25 min on 2 cores
    python benchmarks/algorithms.py --workers 8 --rounds 5 --algos diloco noloco   # a quick look
"""

from __future__ import annotations

import math
import resource
import time

import torch

from locomm.config import RunSpec
from locomm.data import load_corpus
from locomm.sim import Simulator, network_for, time_to_target
from locomm.sim.network import flops_step_s

import _harness

ALGOS = ["ddp", "diloco", "noloco", "gasloc", "sparseloco"]
NETWORKS = {
    "80mbit_het": dict(link_bps=80e6, latency_s=0.030, heterogeneity=1.0),
    "10gbit": dict(link_bps=10e9, latency_s=0.001, heterogeneity=0.0),
}
SCALED_PARAMS = 125e6
TFLOPS = 10.0


def run_one(spec: RunSpec, algo: str, workers: int, rounds: int, splits, overlap: bool = True) -> dict:
    s = spec.replace("outer", algo=algo).replace("train", steps=rounds * spec.outer.inner_steps)
    sim = Simulator(s, workers, splits=splits, overlap=overlap)
    t0 = time.perf_counter()
    res = sim.run(rounds)
    params = sim.trainers[0].model.num_parameters()
    step_s = flops_step_s(params, sim.trainers[0].tokens_per_step, TFLOPS)
    out = {
        "algo": algo,
        "workers": workers,
        "final_val_loss": res.final_val_loss,
        "final_val_spread": res.val_spread[-1],
        "val_loss": res.val_loss,
        "steps": res.steps,
        "bytes_sent_per_worker": sum(res.bytes_sent) / workers,
        "max_weight_distance": sim.weight_distance(),
        "real_s": time.perf_counter() - t0,
        "timelines": {},
    }
    scale = SCALED_PARAMS / params
    for name, net in NETWORKS.items():
        for label, k in (("nano", 1.0), ("125M", scale)):
            run = network_for(res, **net, step_s=step_s, seed=0, scale=k)
            out["timelines"][f"{name}/{label}"] = {
                "wall_s": run.wall_s,
                "compute_utilisation_mean": run.utilisation_mean,
                "compute_utilisation_min": run.utilisation_min,
                "deadline_mismatches": run.mismatches,
                "curve_s": res.curve_times(run.round_done),
                "_done": run.round_done,
            }
    out["_res"] = res
    return out


def nano_spec(inner_steps: int) -> RunSpec:
    """The simulator comparisons' setup: nano, batch 8 x 128, 8 evaluation batches (poisoning.py uses it too)."""
    return (
        RunSpec.preset("nano")
        .replace("data", batch_size=8, seq_len=128)
        .replace("outer", inner_steps=inner_steps)
        .replace("train", eval_batches=8)
    )


def fmt_time(t: float) -> str:
    return "-" if math.isinf(t) else (f"{t:.1f}" if t < 1000 else f"{t:.0f}")


def main() -> None:
    ap = _harness.parser(__doc__, out="algorithms.json", summary=True)
    ap.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--algos", nargs="+", default=ALGOS, choices=ALGOS)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--inner-steps", type=int, default=20)
    ap.add_argument(
        "--no-overlap",
        action="store_true",
        help="Block on each exchange (default: the daemon's schedule, each exchange applied one round late)",
    )
    a = ap.parse_args()
    torch.set_num_threads(2)
    spec = nano_spec(a.inner_steps)
    splits = load_corpus(spec.data)
    tokens = a.rounds * a.inner_steps * spec.data.batch_size * spec.data.seq_len
    print(
        f"nano ({spec.model.d_model}d x {spec.model.n_layers}L), H={a.inner_steps}, {a.rounds} rounds, "
        f"{tokens:,} tokens per worker; timelines at {TFLOPS} TFLOP/s per worker"
    )
    results = []
    for w in a.workers:
        for algo in a.algos:
            r = run_one(spec, algo, w, a.rounds, splits, overlap=not a.no_overlap)
            print(f"  ran {algo:10s} x{w:<3d} val {r['final_val_loss']:.4f}  ({r['real_s']:.0f} s)", flush=True)
            results.append(r)
    keys = ("80mbit_het/nano", "80mbit_het/125M", "10gbit/125M")
    lines = [
        "| workers | algo | val loss | ppl/byte | vs DiLoCo | MB sent/worker | t->target 80M het (nano) | "
        "t->target 80M het (125M) | t->target 10G (125M) | compute util. 80M het (125M), mean / min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = []
    for w in a.workers:
        rows = [r for r in results if r["workers"] == w]
        ref = next((r for r in rows if r["algo"] == "diloco"), rows[0])
        target = 1.02 * ref["final_val_loss"]
        for r in rows:
            tt = {k: time_to_target(r["_res"], r["timelines"][k]["_done"], target) for k in keys}
            rel = 100 * (r["final_val_loss"] / ref["final_val_loss"] - 1)
            lines.append(
                f"| {w} | {r['algo']} | {r['final_val_loss']:.4f} | {math.exp(r['final_val_loss']):.3f} | "
                f"{rel:+.1f}% | {r['bytes_sent_per_worker'] / 1e6:.2f} | "
                + " | ".join(fmt_time(tt[k]) for k in keys)
                + f" | {100 * r['timelines']['80mbit_het/125M']['compute_utilisation_mean']:.0f}% / "
                f"{100 * r['timelines']['80mbit_het/125M']['compute_utilisation_min']:.0f}% |"
            )
            bad = [k for k in keys if r["timelines"][k]["deadline_mismatches"]]
            if bad:
                lines[-1] += f" (deadlines fire on {', '.join(bad)}: that replay's numerics differ)"
            for tl in r["timelines"].values():
                tl.pop("_done")
            summary.append(
                {k: v for k, v in r.items() if k != "_res"}
                | {"target": target, "time_to_target_s": {k: (None if math.isinf(v) else v) for k, v in tt.items()}}
            )
    print()
    print("\n".join(lines))
    print(
        f"\ntarget = DiLoCo's final val loss + 2%; "
        f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )
    _harness.write_json(a.out, summary)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
