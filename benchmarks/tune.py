"""Tune every outer algorithm with the same budget, then compare the best of each on other seeds.

Budget, the same for every algorithm: 12 points over its outer hyperparameters, each point one
simulated run of 8 workers on the nano model, batch 8 x 128 bytes, H = 20, 15 rounds (307k tokens
per worker, the budget of benchmarks/algorithms.py), on the tuning seed (train.seed = 1), scored on
the final validation loss (mean over workers, 8 batches). The daemon's schedule: overlap on, each
exchange applied one round late. Grids:

    DiLoCo      lr {0.3, 0.5, 0.7, 1.0} x momentum {0, 0.5, 0.9}
    NoLoCo      alpha {0.3, 0.5, 0.7, 1.0} x beta {0, 0.5, 0.9}        (gamma = alpha)
    GASLoC      eta {0.5, 0.7, 1.0} x gamma {0, 0.3, 0.6, 0.9}         (a = 0.5, matching)
    SparseLoCo  lr {1, 3, 9} x density {0.02, 0.03} x EF decay {0.9, 0.95}   (paper's aggregation)

(SparseLoCo has no momentum; its lr reaches 9 because DiLoCo's steady-state step eta / (1 - mu)
reaches 10 on its grid, and the paper's mean over all R workers applies 1/5 to 1/8 of what the
sender-mean applied at R = 8 (`tune.py norms`), which ran well at lr 1. A point that diverges is
recorded as such and ranks last.)

The best point of each algorithm then runs on seeds 2 and 3 (mean and spread over the three seeds,
the tuning seed's run included as one of them only where stated). GASLoC is reported twice: its best
gamma > 0 (the method) and its best gamma = 0 (plain gossip with local steps).

Every run is one JSON file, written atomically: benchmarks/results/tune/<algo>/<point>.json for the
sweep, .../confirm/seed<S>_<point>.json for the seeds. Whatever is on disk is skipped, so a sweep
resumes where it stopped. Points run interleaved across algorithms (each algorithm's documented
default first, the rest in a fixed shuffled order), so a partial sweep has sampled every algorithm
equally.

    nice -n 19 python benchmarks/tune.py run              # sweep, then confirm what is complete
    python benchmarks/tune.py table                        # the README table from what is on disk
    nice -n 19 python benchmarks/tune.py aggregation       # SparseLoCo: 'all' vs 'senders', 8 and 16 workers
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import _harness

OUT = _harness.results_path("tune")
WORKERS = 8
ROUNDS = 15
H = 20
TUNE_SEED = 1
CONFIRM_SEEDS = (2, 3)
NETWORKS = {
    "80mbit_het": dict(link_bps=80e6, latency_s=0.030, heterogeneity=1.0),
    "10gbit": dict(link_bps=10e9, latency_s=0.001, heterogeneity=0.0),
}
TFLOPS = 10.0


def grid(algo: str) -> list[dict[str, float]]:
    """The algorithm's 12 points, its documented default first, the rest in a fixed shuffled order."""
    if algo == "diloco":
        pts, default = (
            [dict(lr=a, momentum=m) for a, m in itertools.product((0.3, 0.5, 0.7, 1.0), (0.0, 0.5, 0.9))],
            dict(lr=0.7, momentum=0.9),
        )
    elif algo == "noloco":
        pts, default = (
            [dict(lr=a, noloco_beta=b) for a, b in itertools.product((0.3, 0.5, 0.7, 1.0), (0.0, 0.5, 0.9))],
            dict(lr=0.7, noloco_beta=0.5),
        )
    elif algo == "gasloc":
        pts, default = (
            [dict(lr=e, gasloc_gamma=g) for e, g in itertools.product((0.5, 0.7, 1.0), (0.0, 0.3, 0.6, 0.9))],
            dict(lr=0.7, gasloc_gamma=0.0),
        )
    elif algo == "sparseloco":
        pts = [
            dict(sparse_lr=a, sparse_density=d, sparse_ef_beta=b)
            for a, d, b in itertools.product((1.0, 3.0, 9.0), (0.02, 0.03), (0.9, 0.95))
        ]
        default = dict(sparse_lr=1.0, sparse_density=0.02, sparse_ef_beta=0.95)
    else:
        raise ValueError(algo)
    assert len(pts) == 12 and default in pts
    rest = [p for p in pts if p != default]
    random.Random(f"tune-{algo}").shuffle(rest)
    return [default, *rest]


ALGOS = ("diloco", "noloco", "gasloc", "sparseloco")


def point_name(kw: dict[str, Any]) -> str:
    return "_".join(f"{k}{v:g}" if isinstance(v, (int, float)) else f"{k}-{v}" for k, v in kw.items())


def base_spec(seed: int) -> Any:
    from locomm.config import RunSpec

    return (
        RunSpec.preset("nano")
        .replace("data", batch_size=8, seq_len=128)
        .replace("outer", inner_steps=H)
        .replace("train", steps=ROUNDS * H, seed=seed, eval_batches=8)
    )


def run_point(
    algo: str, kw: dict[str, Any], seed: int, splits: Any, *, workers: int = WORKERS, eval_every: int = ROUNDS
) -> dict[str, Any]:
    from locomm.sim import Simulator, network_for
    from locomm.sim.network import flops_step_s

    spec = base_spec(seed).replace("outer", algo=algo, **kw)
    t0 = time.perf_counter()
    sim = Simulator(spec, workers, splits=splits, eval_every=eval_every)
    try:
        res = sim.run(ROUNDS)
    except FloatingPointError as e:  # a diverged point is a result: the worst score
        return {
            "algo": algo,
            "params": kw,
            "seed": seed,
            "workers": workers,
            "rounds": ROUNDS,
            "inner_steps": H,
            "diverged": str(e),
            "final_val_loss": math.inf,
            "bytes_sent_per_worker": math.nan,
            "real_s": time.perf_counter() - t0,
            "timelines": {},
        }
    params = sim.trainers[0].model.num_parameters()
    step_s = flops_step_s(params, sim.trainers[0].tokens_per_step, TFLOPS)
    out: dict[str, Any] = {
        "algo": algo,
        "params": kw,
        "seed": seed,
        "workers": workers,
        "rounds": ROUNDS,
        "inner_steps": H,
        "tokens_per_worker": ROUNDS * H * spec.data.batch_size * spec.data.seq_len,
        "overlap": res.overlap,
        "final_val_loss": res.final_val_loss,
        "final_val_spread": res.val_spread[-1],
        "steps": res.steps,
        "val_loss": res.val_loss,
        "bytes_sent_per_worker": sum(res.bytes_sent) / workers,
        "max_weight_distance": sim.weight_distance(),
        "real_s": time.perf_counter() - t0,
        "timelines": {},
    }
    for name, net in NETWORKS.items():
        run = network_for(res, step_s=step_s, seed=0, **net)
        out["timelines"][f"{name}/nano"] = {
            "wall_s": run.wall_s,
            "round_done": run.round_done,
            "compute_utilisation_mean": run.utilisation_mean,
            "compute_utilisation_min": run.utilisation_min,
            "deadline_mismatches": run.mismatches,
        }
    return out


def sweep_path(algo: str, kw: dict[str, float]) -> Path:
    return OUT / algo / f"{point_name(kw)}.json"


def confirm_path(algo: str, kw: dict[str, float], seed: int) -> Path:
    return OUT / algo / "confirm" / f"seed{seed}_{point_name(kw)}.json"


def load(path: Path) -> dict[str, Any] | None:
    try:
        return _harness.read_json(path)
    except (OSError, ValueError):
        return None


def sweep_results(algo: str) -> list[dict[str, Any]]:
    rows = [r for kw in grid(algo) if (r := load(sweep_path(algo, kw))) is not None]
    for r in rows:  # points run by `aggregation` name the default rule ('all') explicitly
        r["params"] = {k: v for k, v in r["params"].items() if k != "sparseloco_aggregation"}
    return rows


def best(algo: str, where: Any = None) -> dict[str, Any] | None:
    rows = [r for r in sweep_results(algo) if where is None or where(r["params"])]
    return min(rows, key=lambda r: r["final_val_loss"]) if rows else None


ENTRIES = {  # row of the table -> (algorithm, which of its sweep points may be picked)
    "DiLoCo": ("diloco", None),
    "NoLoCo": ("noloco", None),
    "GASLoC (gamma > 0)": ("gasloc", lambda p: p["gasloc_gamma"] > 0),
    "plain gossip (GASLoC gamma = 0)": ("gasloc", lambda p: p["gasloc_gamma"] == 0),
    "SparseLoCo": ("sparseloco", None),
}


def cmd_run(a: argparse.Namespace) -> None:
    import torch

    from locomm.data import load_corpus

    torch.set_num_threads(a.threads)
    splits = load_corpus(base_spec(TUNE_SEED).data)
    todo = [(algo, kw) for i in range(12) for algo in a.algos for kw in [grid(algo)[i]]]
    for algo, kw in todo:
        path = sweep_path(algo, kw)
        if _harness.done(path):
            continue
        r = run_point(algo, kw, TUNE_SEED, splits)
        _harness.write_json(path, r)
        print(f"sweep {algo:10s} {point_name(kw):45s} val {r['final_val_loss']:.4f} ({r['real_s']:.0f} s)", flush=True)
    for entry, (algo, where) in ENTRIES.items():
        if algo not in a.algos:
            continue
        b = best(algo, where)
        if b is None or len(sweep_results(algo)) < 12:
            continue
        for seed in CONFIRM_SEEDS:
            path = confirm_path(algo, b["params"], seed)
            if _harness.done(path):
                continue
            r = run_point(algo, b["params"], seed, splits, eval_every=5)
            _harness.write_json(path, r)
            print(
                f"confirm {entry:32s} seed {seed} {point_name(b['params'])} val {r['final_val_loss']:.4f} "
                f"({r['real_s']:.0f} s)",
                flush=True,
            )


def table_rows() -> list[dict[str, Any]]:
    rows = []
    for entry, (algo, where) in ENTRIES.items():
        swept = sweep_results(algo)
        b = best(algo, where)
        if b is None:
            rows.append({"entry": entry, "algo": algo, "points_run": len(swept)})
            continue
        seeds = [load(confirm_path(algo, b["params"], s)) for s in CONFIRM_SEEDS]
        seeds = [s for s in seeds if s is not None]
        others = [s["final_val_loss"] for s in seeds]
        rows.append(
            {
                "entry": entry,
                "algo": algo,
                "points_run": len(swept),
                "best": b["params"],
                "tune_val_loss": b["final_val_loss"],
                "confirm_seeds": [s["seed"] for s in seeds],
                "confirm_val_loss": others,
                "confirm_mean": statistics.fmean(others) if others else None,
                "confirm_spread": (max(others) - min(others)) if len(others) > 1 else None,
                "bytes_sent_per_worker": b["bytes_sent_per_worker"],
                "util_80mbit_het": b["timelines"]["80mbit_het/nano"]["compute_utilisation_mean"],
                "default_val_loss": next((r["final_val_loss"] for r in swept if r["params"] == grid(algo)[0]), None),
            }
        )
    return rows


def cmd_table(a: argparse.Namespace) -> None:
    rows = table_rows()
    ref = next((r for r in rows if r["entry"] == "DiLoCo" and "best" in r), None)
    print(
        "| algorithm | points run | best setting (seed 1) | val, seed 1 | val, seeds 2-3 (mean ± half-range) | "
        "vs DiLoCo (seeds 2-3) | at the default | MB sent/worker | compute util. 80M het |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "best" not in r:
            print(f"| {r['entry']} | {r['points_run']}/12 | - | - | - | - | - | - | - |")
            continue
        conf = (
            f"{r['confirm_mean']:.4f} ± {r['confirm_spread'] / 2:.4f}"
            if r["confirm_spread"] is not None
            else (f"{r['confirm_val_loss'][0]:.4f} (1 seed)" if r["confirm_val_loss"] else "not run")
        )
        rel = "-"
        if ref is not None and r["confirm_mean"] is not None and ref.get("confirm_mean"):
            rel = f"{100 * (r['confirm_mean'] / ref['confirm_mean'] - 1):+.1f}%"
        elif ref is not None:
            rel = f"{100 * (r['tune_val_loss'] / ref['tune_val_loss'] - 1):+.1f}% (seed 1)"
        setting = ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in r["best"].items())
        dflt = f"{r['default_val_loss']:.4f}" if r["default_val_loss"] is not None else "-"
        print(
            f"| {r['entry']} | {r['points_run']}/12 | {setting} | {r['tune_val_loss']:.4f} | {conf} | {rel} | "
            f"{dflt} | {r['bytes_sent_per_worker'] / 1e6:.2f} | {100 * r['util_80mbit_het']:.0f}% |"
        )
    if a.json:
        _harness.write_json(OUT / "table.json", rows)


def aggregation_path(workers: int, algo: str, kw: dict[str, Any]) -> Path:
    """The 8-worker runs of the tuning seed are sweep points already; others live in aggregation/."""
    if workers == WORKERS and kw.get("sparseloco_aggregation", "all") == "all":
        return sweep_path(algo, {k: v for k, v in kw.items() if k != "sparseloco_aggregation"})
    return OUT / "aggregation" / f"w{workers}_{algo}_{point_name(kw)}.json"


def cmd_aggregation(a: argparse.Namespace) -> None:
    """SparseLoCo under both aggregation rules at 8 and 16 workers (its default point, the tuning seed),
    beside DiLoCo's documented default on the same runs; then, once both sweeps are complete, the tuned
    best of DiLoCo and of SparseLoCo (paper's rule) at each worker count."""
    import torch

    from locomm.data import load_corpus

    torch.set_num_threads(a.threads)
    splits = load_corpus(base_spec(TUNE_SEED).data)
    runs = []
    for workers in a.workers:
        for rule in ("all", "senders"):
            runs.append((workers, "sparseloco", dict(grid("sparseloco")[0], sparseloco_aggregation=rule)))
        runs.append((workers, "diloco", grid("diloco")[0]))
        # The paper's rule at a step near the sender rule's at R = 8 (norms: 5-8x the all-mean's).
        runs.append((workers, "sparseloco", dict(grid("sparseloco")[0], sparse_lr=9.0, sparseloco_aggregation="all")))
        # Best against best: each algorithm's tuned point (complete 8-worker sweep) at this worker count.
        for algo in ("diloco", "sparseloco"):
            b = best(algo)
            if b is not None and len(sweep_results(algo)) == 12:
                kw = dict(b["params"], **({"sparseloco_aggregation": "all"} if algo == "sparseloco" else {}))
                runs.append((workers, algo, kw))
    for workers, algo, kw in runs:
        path = aggregation_path(workers, algo, kw)
        if not _harness.done(path):
            _harness.write_json(path, run_point(algo, kw, TUNE_SEED, splits, workers=workers))
        r = load(path)
        print(
            f"{algo:10s} {point_name(kw):70s} x{workers:<3d} val {r['final_val_loss']:.4f}  "
            f"{r['bytes_sent_per_worker'] / 1e6:.3f} MB/worker",
            flush=True,
        )


def cmd_norms(a: argparse.Namespace) -> None:
    """Norm of one round's SparseLoCo update under each rule, relative to the dense mean of the same deltas.

    Deltas: d_r = c * s + n_r, a shared direction s plus worker noise n_r (unit Gaussians, 2^16 elements),
    with c setting how much the workers agree (c = 0: independent, as early in training at small batch)."""
    import torch

    from locomm.compression import get_codec

    rows = []
    for c in (0.0, 0.5, 1.0):
        for R in (2, 4, 8, 16, 32):
            g = torch.Generator().manual_seed(R)
            s = torch.randn(1 << 16, generator=g)
            d = [c * s + torch.randn(1 << 16, generator=g) for _ in range(R)]
            dense = torch.stack(d).mean(0)
            q = [get_codec("topk2bit", density=0.02, beta=0.95) for _ in range(R)]
            sent = [qq.decode(qq.encode(x)).float() for qq, x in zip(q, d)]
            total = torch.stack(sent).sum(0)
            count = torch.stack([(x != 0).float() for x in sent]).sum(0)
            senders = total / count.clamp(min=1)
            every = total / R
            rows.append(
                {
                    "agreement": c,
                    "R": R,
                    "senders_over_dense": float(senders.norm() / dense.norm()),
                    "all_over_dense": float(every.norm() / dense.norm()),
                    "senders_over_all": float(senders.norm() / every.norm()),
                    "indices_sent_by_one": float((count == 1).sum() / (count > 0).sum()),
                }
            )
            r = rows[-1]
            print(
                f"agreement {c:.1f} R {R:2d}: |senders| / |dense| {r['senders_over_dense']:.3f}, "
                f"|all| / |dense| {r['all_over_dense']:.3f}, senders / all {r['senders_over_all']:.2f}, "
                f"indices sent by one worker {100 * r['indices_sent_by_one']:.0f}%"
            )
    _harness.write_json(OUT / "aggregation" / "norms.json", rows)


def main() -> None:
    ap = _harness.parser(__doc__, out=False, summary=True)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--algos", nargs="+", default=list(ALGOS), choices=ALGOS)
    r.add_argument("--threads", type=int, default=1)
    t = sub.add_parser("table")
    t.add_argument("--json", action="store_true", help="Also write benchmarks/results/tune/table.json")
    g = sub.add_parser("aggregation")
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    sub.add_parser("norms")
    a = ap.parse_args()
    {"run": cmd_run, "table": cmd_table, "aggregation": cmd_aggregation, "norms": cmd_norms}[a.cmd](a)


if __name__ == "__main__":
    main()
