"""SCAPE in the simulator: one island of N workers syncing every step, against its baselines (issue 21).

For each preset, worker count and seed, at the same tokens (N workers x one batch per step, the
preset's batch, IID shards) and the preset's inner LR for every method (nothing tuned):

- ``adams_ddp``: dense AdamS DDP (SCAPE's code at sparsity 0), the reference;
- ``scape@0.9``, ``scape@0.99``: SCAPE (masks from AdamS's first moment, one step late, error feedback);
- ``adamw_ddp``: dense AdamW DDP (the simulator's DDP path);
- ``topk_raw@0.99``: each worker's own top-1% of its raw gradient (with error feedback), mean scattered, AdamS.

``--seed`` S sets train.seed and outer.seed together (model init, data order), as ``simulate --seed``.
Each run is one entry of ``benchmarks/results/scape-sim-<preset>.json`` (or ``--out``: processes run side by
side each write their own; rewritten atomically after each entry; ``--resume`` skips those on disk).
``--report`` prints the markdown table from every ``scape-sim-<preset>*.json``.

    nice -n 10 python benchmarks/scape_sim.py --preset nano --workers 4 8 --seeds 0 1 2 --resume
    nice -n 10 python benchmarks/scape_sim.py --preset tiny --workers 4 --seeds 0 --steps 500 --resume
    python benchmarks/scape_sim.py --preset nano --report
"""

from __future__ import annotations

import statistics
import time

import torch

from locomm.config import RunSpec
from locomm.data import load_corpus
from locomm.sim.network import parse_link
from locomm.sim.scape import Cost, run_method

import _harness

METHODS = ["adams_ddp@0", "scape@0.9", "scape@0.99", "adamw_ddp@0", "topk_raw@0.99"]
STEPS = {"nano": 300, "tiny": 500}
"""Steps per worker: nano's issue minimum, tiny's preset run length (docs/run-spec.md, Presets)."""


def entry_name(preset: str, workers: int, seed: int, method: str) -> str:
    return f"{preset}/w{workers}/seed{seed}/{method}"


def run_entry(preset: str, workers: int, seed: int, method: str, steps: int, cost: Cost, splits) -> dict:
    name, sparsity = method.split("@")
    spec = (
        RunSpec.preset(preset).replace("train", seed=seed).replace("outer", seed=seed, scape_sparsity=float(sparsity))
    )
    r = run_method(spec, workers, steps, name, splits=splits, eval_every=max(1, steps // 10), cost=cost)
    out = r.as_json()
    out.update(preset=preset, seed=seed, steps_per_worker=steps, key=method, inner_lr=spec.inner.lr)
    return out


def spread(xs: list[float]) -> str:
    """Mean ± sample std [min, max] over seeds (one seed: its value)."""
    if len(xs) == 1:
        return f"{xs[0]:.4f}"
    return f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f} [{min(xs):.4f}, {max(xs):.4f}]"


def report(preset: str, entries: dict) -> str:
    """Markdown: per worker count and method, mean ± std over seeds; the gaps pair per seed (shared seeds)."""
    lines = [
        "| workers | method | seeds | final val loss | vs dense AdamS: mean (per seed) | bytes/step/worker | vs dense "
        "| wire bytes/step | sim time s | members identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [e for e in entries.values() if e["preset"] == preset]
    for workers in sorted({e["workers"] for e in rows}):
        for method in METHODS:
            es = sorted((e for e in rows if e["workers"] == workers and e["key"] == method), key=lambda e: e["seed"])
            if not es:
                continue
            gaps = []
            for e in es:
                ref = entries.get(entry_name(preset, workers, e["seed"], "adams_ddp@0"))
                if ref:
                    gaps.append(100 * (e["final_val_loss"] / ref["final_val_loss"] - 1))
            gap = "-" if not gaps else f"{statistics.fmean(gaps):+.2f}% ({', '.join(f'{g:+.2f}' for g in gaps)})"
            same = {True: "yes", False: "NO", None: "-"}
            ident = ",".join(sorted({same[e["identical"]] for e in es}))
            b = statistics.fmean(e["bytes_per_step"] for e in es)
            lines.append(
                f"| {workers} | {method} | {len(es)} | {spread([e['final_val_loss'] for e in es])} | {gap} "
                f"| {b:,.0f} | {b / es[0]['dense_bytes']:.4f} | {statistics.fmean(e['wire_bytes'] for e in es):,.0f} "
                f"| {statistics.fmean(e['sim_time_s'] for e in es):.2f} | {ident} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = _harness.parser(__doc__, out=None, resume=True, summary=True)
    ap.add_argument("--preset", choices=sorted(STEPS), default="nano")
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--steps", type=int, help="Steps per worker (default: nano 300, tiny 500)")
    ap.add_argument("--link", default="1gbit", help="The island's link, for the cost model (default 1gbit)")
    ap.add_argument("--latency-ms", type=float, default=0.5)
    ap.add_argument("--tflops", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--report", action="store_true", help="Print the tables from the results file and exit")
    args = ap.parse_args()
    out = args.out or _harness.results_path(f"scape-sim-{args.preset}.json")
    if args.report:  # every results file of the preset (processes that ran side by side wrote their own)
        merged: dict = {}
        for path in sorted(_harness.RESULTS.glob(f"scape-sim-{args.preset}*.json")):
            merged.update(_harness.Entries(path, resume=True).entries)
        print(report(args.preset, merged))
        return
    done = _harness.Entries(out, resume=args.resume)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or STEPS[args.preset]
    cost = Cost(link_bps=parse_link(args.link), latency_s=args.latency_ms / 1000, tflops=args.tflops)
    splits = load_corpus(RunSpec.preset(args.preset).data)
    for seed in args.seeds:
        for workers in args.workers:
            for method in args.methods:
                name = entry_name(args.preset, workers, seed, method)
                if name in done:
                    continue
                t0 = time.perf_counter()
                e = run_entry(args.preset, workers, seed, method, steps, cost, splits)
                e["link"], e["latency_ms"], e["tflops"] = args.link, args.latency_ms, args.tflops
                done.add(name, e)
                print(f"{name}: val {e['final_val_loss']:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(report(args.preset, done.entries))


if __name__ == "__main__":
    main()
