"""Tune every outer algorithm with the same budget, then compare the best of each on other seeds.

Budget, the same for every algorithm of a family: 12 points over its outer hyperparameters (18 for
DiLoCo and NoLoCo, each schedule), each point one
simulated run of 8 workers on the nano model, batch 8 x 128 bytes, H = 20, 15 rounds (307k tokens
per worker, the budget of benchmarks/algorithms.py) or 45 rounds (the cosine schedule over the whole
longer run), on the tuning seed (data and init seed 1, grouping seed outer.seed 0), scored on the
final validation loss (mean over workers, 8 batches). The daemon's schedule: overlap on, each
exchange applied one round late. Grids:

    DiLoCo      lr {0.3, 0.5, 0.7, 1.0, 1.3, 1.6} x momentum {0, 0.5, 0.9}    (18 points: both winners of the
    NoLoCo      alpha {0.3, 0.5, 0.7, 1.0, 1.3, 1.6} x beta {0, 0.5, 0.9}      first 12-point grids, lr 0.3-1.0,
                                                                            sat on lr = 1.0; gamma = alpha)
    GASLoC      eta {0.5, 0.7, 1.0} x gamma {0, 0.3, 0.6, 0.9}         (a = 0.5, matching)
    SparseLoCo  lr {1, 3, 9} x density {0.02, 0.03, 0.05} x EF decay {0.8, 0.9, 0.95}   (paper's aggregation)

Variants, each tuned on its base algorithm's grid with the same budget:

    diloco_blocking     DiLoCo as its paper runs it: each round's average applied before the next round starts
    noloco_blocking     NoLoCo blocking the same way (NoLoCo's paper overlaps, as the daemon does)
    gasloc_y            GASLoC with its momentum on the unmixed y (the published formula)
    sparseloco_senders  SparseLoCo with the public code's rule: per-index mean over the senders, each
                        sender's update clipped to the median norm of the round's senders
    sparseloco_tiles    SparseLoCo (the paper's mean) with the codec of the paper and its public code: top-k per
                        64x64 tile, values in bins of standard deviations (locomm/compression/topk_tiles.py)

Setups (``--setup``): the data sharding and the length of the run.

    iid_15r         every worker samples the whole training split (data.sharding = iid), 15 rounds
    iid_45r         the same, 45 rounds
    contiguous_15r  each worker its slice of the sorted stream (strongly non-IID), 15 rounds

The best point of each algorithm then runs on seeds 2, 3 and 4, each seed varying everything random:
data order and model init (train.seed) and the grouping (outer.seed) together. The tables report the
mean and spread of those three, the tuning seed not among them. GASLoC is reported twice: its best
gamma > 0 (the method) and its best gamma = 0 (plain gossip with local steps).

Every run is one JSON file, written atomically: benchmarks/results/tune/<setup>/<algo>/<point>.json for
the sweep, .../seeds/seed<S>_<point>.json for the seeds. Whatever is on disk is skipped, so a sweep
resumes where it stopped; several processes may share one sweep (each run is claimed first). Points run
interleaved across algorithms (each algorithm's documented default first, the rest in a fixed shuffled
order), so a partial sweep has sampled every algorithm equally.

    nice -n 19 python benchmarks/tune.py run --setup iid_15r     # sweep, then seeds of what is complete
    python benchmarks/tune.py table --setup iid_15r               # the README table from what is on disk
    nice -n 19 python benchmarks/tune.py aggregation              # SparseLoCo: both rules, 8 and 16 workers
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

ROOT = _harness.results_path("tune")
WORKERS = 8
ROUNDS = 15
H = 20
TUNE_SEED = 1
CONFIRM_SEEDS = (2, 3, 4)
SETUPS = {"iid_15r": ("iid", 15), "iid_45r": ("iid", 45), "contiguous_15r": ("contiguous", 15)}
DEFAULT_SETUP = "iid_15r"
NETWORKS = {
    "80mbit_het": dict(link_bps=80e6, latency_s=0.030, heterogeneity=1.0),
    "10gbit": dict(link_bps=10e9, latency_s=0.001, heterogeneity=0.0),
}
TFLOPS = 10.0
VARIANTS = {  # name -> (outer algorithm, fixed changes, overlap); tuned on the algorithm's grid
    "gasloc_y": ("gasloc", {"gasloc_momentum_on": "unmixed"}, True),
    "sparseloco_senders": ("sparseloco", {"sparseloco_aggregation": "senders", "sparseloco_clip": "median"}, True),
    "diloco_blocking": ("diloco", {}, False),
    "noloco_blocking": ("noloco", {}, False),
    "sparseloco_tiles": ("sparseloco", {}, True),
}
SPARSE_CODECS = {"sparseloco_tiles": "topktiles"}
"""Variants that swap SparseLoCo's codec for one the run spec does not offer (``Simulator(sparse_codec=)``)."""


LRS = (0.3, 0.5, 0.7, 1.0, 1.3, 1.6)


EXTENSIONS = {
    "sparseloco": [
        *(dict(sparse_lr=a, sparse_density=d, sparse_ef_beta=0.7) for a in (1.0, 3.0) for d in (0.02, 0.03, 0.05)),
        *(dict(sparse_lr=3.0, sparse_density=d, sparse_ef_beta=b) for b in (0.6, 0.5) for d in (0.02, 0.03, 0.05)),
    ],
}
"""Points past an algorithm's grid, run after it (and by its variants). SparseLoCo's best, with either codec, sat
on the grid's edge (error feedback 0.8, the lowest), so its grid grows there: 0.7 at lr 1 and 3 (lr 9 diverged at
every point with the tiles codec), then 0.6 and 0.5 at lr 3 (lr 1 was 0.23-0.63 worse at 0.7)."""


def grid(algo: str) -> list[dict[str, float]]:
    """The algorithm's points, its documented default first, the rest in a fixed shuffled order, then its
    ``EXTENSIONS``."""
    if algo in VARIANTS:
        return grid(VARIANTS[algo][0])
    if algo == "diloco":
        pts, default = (
            [dict(lr=a, momentum=m) for a, m in itertools.product(LRS, (0.0, 0.5, 0.9))],
            dict(lr=0.7, momentum=0.9),
        )
    elif algo == "noloco":
        pts, default = (
            [dict(lr=a, noloco_beta=b) for a, b in itertools.product(LRS, (0.0, 0.5, 0.9))],
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
            for a, d, b in itertools.product((1.0, 3.0, 9.0), (0.02, 0.03, 0.05), (0.8, 0.9, 0.95))
        ]
        default = dict(sparse_lr=1.0, sparse_density=0.02, sparse_ef_beta=0.95)
    else:
        raise ValueError(algo)
    assert default in pts
    rest = [p for p in pts if p != default]
    random.Random(f"tune-{algo}").shuffle(rest)
    return [default, *rest, *EXTENSIONS.get(algo, [])]


ALGOS = ("diloco", "noloco", "gasloc", "sparseloco")
ALL = (*ALGOS, *VARIANTS)


def point_name(kw: dict[str, Any]) -> str:
    return "_".join(f"{k}{v:g}" if isinstance(v, (int, float)) else f"{k}-{v}" for k, v in kw.items())


def base_spec(seed: int, setup: str = DEFAULT_SETUP, rounds: int | None = None) -> Any:
    """The budget's spec at ``seed``: the tuning seed keeps grouping seed 0, every other seed varies it too."""
    from locomm.config import RunSpec

    sharding, setup_rounds = SETUPS[setup]
    rounds = setup_rounds if rounds is None else rounds
    return (
        RunSpec.preset("nano")
        .replace("data", batch_size=8, seq_len=128, sharding=sharding)
        .replace("outer", inner_steps=H, seed=0 if seed == TUNE_SEED else seed)
        .replace("train", steps=rounds * H, seed=seed, eval_batches=8)
    )


def run_point(
    algo: str,
    kw: dict[str, Any],
    seed: int,
    splits: Any,
    *,
    setup: str = DEFAULT_SETUP,
    workers: int = WORKERS,
    eval_every: int | None = None,
    spec: Any = None,
    overlap: bool = True,
) -> dict[str, Any]:
    from locomm.sim import Simulator, network_for
    from locomm.sim.network import flops_step_s

    outer_algo, fixed, variant_overlap = VARIANTS.get(algo, (algo, {}, True))
    overlap = overlap and variant_overlap
    if spec is None:
        spec = base_spec(seed, setup).replace("outer", algo=outer_algo, **fixed, **kw)
    rounds = spec.train.steps // spec.outer.inner_steps
    t0 = time.perf_counter()
    sim = Simulator(
        spec,
        workers,
        splits=splits,
        eval_every=eval_every or rounds,
        overlap=overlap,
        sparse_codec=SPARSE_CODECS.get(algo),
    )
    common = {
        "algo": algo,
        "params": kw,
        "fixed": fixed,
        "setup": setup,
        "sharding": spec.data.sharding,
        "seed": seed,
        "outer_seed": spec.outer.seed,
        "workers": workers,
        "rounds": rounds,
        "inner_steps": spec.outer.inner_steps,
    }
    try:
        res = sim.run(rounds)
    except FloatingPointError as e:  # a diverged point is a result: the worst score
        return {
            **common,
            "diverged": str(e),
            "final_val_loss": math.inf,
            "bytes_sent_per_worker": math.nan,
            "bytes_coded_per_worker": math.nan,
            "real_s": time.perf_counter() - t0,
            "timelines": {},
        }
    params = sim.trainers[0].model.num_parameters()
    step_s = flops_step_s(params, sim.trainers[0].tokens_per_step, TFLOPS)
    out: dict[str, Any] = {
        **common,
        "tokens_per_worker": spec.train.steps * spec.data.batch_size * spec.data.seq_len,
        "overlap": res.overlap,
        "final_val_loss": res.final_val_loss,
        "final_val_spread": res.val_spread[-1],
        "steps": res.steps,
        "val_loss": res.val_loss,
        "bytes_sent_per_worker": sum(res.bytes_sent) / workers,
        "bytes_coded_per_worker": sum(res.bytes_coded) / workers,
        "max_weight_distance": sim.weight_distance(),
        "real_s": time.perf_counter() - t0,
        "timelines": {},
    }
    for (name, net), (label, k) in itertools.product(NETWORKS.items(), (("nano", 1.0), ("125M", 125e6 / params))):
        run = network_for(res, step_s=step_s, seed=0, scale=k, **net)
        out["timelines"][f"{name}/{label}"] = {
            "wall_s": run.wall_s,
            "round_done": run.round_done,
            "compute_utilisation_mean": run.utilisation_mean,
            "compute_utilisation_min": run.utilisation_min,
            "deadline_mismatches": run.mismatches,
        }
    return out


def sweep_path(algo: str, kw: dict[str, float], setup: str = DEFAULT_SETUP) -> Path:
    return ROOT / setup / algo / f"{point_name(kw)}.json"


def confirm_path(algo: str, kw: dict[str, float], seed: int, setup: str = DEFAULT_SETUP) -> Path:
    return ROOT / setup / algo / "seeds" / f"seed{seed}_{point_name(kw)}.json"


def load(path: Path) -> dict[str, Any] | None:
    try:
        return _harness.read_json(path)
    except (OSError, ValueError):
        return None


def sweep_results(algo: str, setup: str = DEFAULT_SETUP) -> list[dict[str, Any]]:
    rows = [r for kw in grid(algo) if (r := load(sweep_path(algo, kw, setup))) is not None]
    for r in rows:  # points run by `aggregation` name the default rule ('all') explicitly
        r["params"] = {k: v for k, v in r["params"].items() if k != "sparseloco_aggregation"}
    return rows


def best(algo: str, where: Any = None, setup: str = DEFAULT_SETUP) -> dict[str, Any] | None:
    rows = [r for r in sweep_results(algo, setup) if where is None or where(r["params"])]
    return min(rows, key=lambda r: r["final_val_loss"]) if rows else None


ENTRIES = {  # row of the table -> (algorithm, which of its sweep points may be picked)
    "DiLoCo, blocking (its paper's schedule)": ("diloco_blocking", None),
    "DiLoCo": ("diloco", None),
    "NoLoCo, blocking": ("noloco_blocking", None),
    "NoLoCo": ("noloco", None),
    "GASLoC (gamma > 0)": ("gasloc", lambda p: p["gasloc_gamma"] > 0),
    "plain gossip (GASLoC gamma = 0)": ("gasloc", lambda p: p["gasloc_gamma"] == 0),
    "GASLoC, momentum on y (gamma > 0)": ("gasloc_y", lambda p: p["gasloc_gamma"] > 0),
    "SparseLoCo (paper's rule)": ("sparseloco", None),
    "SparseLoCo (public code's rule)": ("sparseloco_senders", None),
    "SparseLoCo, 64x64 tiles and sigma bins (the paper's rule)": ("sparseloco_tiles", None),
}


def _run(path: Path, fn: Any, label: str) -> None:
    """Run ``fn`` into ``path`` unless it is on disk or another process holds it."""
    if not _harness.claim(path):
        return
    try:
        r = fn()
        _harness.write_json(path, r)
    finally:
        _harness.release(path)
    print(f"{label} val {r['final_val_loss']:.4f} ({r['real_s']:.0f} s)", flush=True)


def cmd_run(a: argparse.Namespace) -> None:
    import torch

    from locomm.data import load_corpus

    torch.set_num_threads(a.threads)
    splits = load_corpus(base_spec(TUNE_SEED, a.setup).data)
    longest = max(len(grid(algo)) for algo in a.algos)
    todo = [(algo, grid(algo)[i]) for i in range(longest) for algo in a.algos if i < len(grid(algo))]
    for algo, kw in todo:
        _run(
            sweep_path(algo, kw, a.setup),
            lambda algo=algo, kw=kw: run_point(algo, kw, TUNE_SEED, splits, setup=a.setup),
            f"{a.setup} sweep {algo:18s} {point_name(kw):45s}",
        )
    if a.no_seeds:
        return
    for entry, (algo, where) in ENTRIES.items():
        b = best(algo, where, a.setup)
        if algo not in a.algos or b is None or len(sweep_results(algo, a.setup)) < len(grid(algo)):
            continue
        for seed in CONFIRM_SEEDS:
            _run(
                confirm_path(algo, b["params"], seed, a.setup),
                lambda algo=algo, b=b, seed=seed: run_point(
                    algo, b["params"], seed, splits, setup=a.setup, eval_every=1
                ),
                f"{a.setup} seed {seed} {entry:34s} {point_name(b['params'])}",
            )


NATURAL_BOUNDS = {"momentum": 0.0, "noloco_beta": 0.0, "gasloc_gamma": 0.0}
"""A winner at these values sits on a bound of the method (no negative momentum), not on a grid's edge."""


def edges(algo: str, params: dict[str, Any]) -> list[str]:
    """The winner's settings that sit on an edge of the grid (the optimum may lie past them)."""
    out = []
    for k, v in params.items():
        values = sorted({p[k] for p in grid(algo)})
        if len(values) > 1 and v in (values[0], values[-1]) and NATURAL_BOUNDS.get(k) != v:
            out.append(f"{k}={v:g}")
    return out


def time_to_target(run: dict[str, Any], target: float, network: str = "80mbit_het/125M") -> float | None:
    """Modelled seconds until the mean validation loss first reached ``target`` (at an evaluation), or None."""
    done = run["timelines"][network]["round_done"]
    for step, val in zip(run["steps"], run["val_loss"]):
        r = step // run["inner_steps"]
        if val <= target and 1 <= r <= len(done):
            return done[r - 1]
    return None


def table_rows(setup: str = DEFAULT_SETUP) -> list[dict[str, Any]]:
    rows = []
    for entry, (algo, where) in ENTRIES.items():
        swept = sweep_results(algo, setup)
        b = best(algo, where, setup)
        if b is None:
            rows.append({"entry": entry, "algo": algo, "points_run": len(swept), "points": len(grid(algo))})
            continue
        seeds = [load(confirm_path(algo, b["params"], s, setup)) for s in CONFIRM_SEEDS]
        seeds = [s for s in seeds if s is not None]
        others = [s["final_val_loss"] for s in seeds]
        rows.append(
            {
                "entry": entry,
                "algo": algo,
                "overlap": VARIANTS.get(algo, (algo, {}, True))[2],
                "points_run": len(swept),
                "points": len(grid(algo)),
                "best": b["params"],
                "best_on_edge": edges(algo, b["params"]),
                "tune_val_loss": b["final_val_loss"],
                "confirm_seeds": [s["seed"] for s in seeds],
                "confirm_val_loss": others,
                "confirm_mean": statistics.fmean(others) if others else None,
                "confirm_std": statistics.stdev(others) if len(others) > 1 else None,
                "confirm_spread": (max(others) - min(others)) if len(others) > 1 else None,
                "confirm_runs": seeds,
                "bytes_sent_per_worker": b["bytes_sent_per_worker"],
                "bytes_coded_per_worker": b.get("bytes_coded_per_worker"),
                "util_80mbit_het": b["timelines"]["80mbit_het/nano"]["compute_utilisation_mean"],
                "default_val_loss": next((r["final_val_loss"] for r in swept if r["params"] == grid(algo)[0]), None),
            }
        )
    return rows


def _pct(x: float, ref: float) -> str:
    return f"{100 * (x / ref - 1):+.1f}%"


REFERENCE = "DiLoCo, blocking (its paper's schedule)"


def cmd_table(a: argparse.Namespace) -> None:
    rows = table_rows(a.setup)
    ref = next((r for r in rows if r["entry"] == REFERENCE and "best" in r), None)
    done = [r for r in rows if r.get("confirm_mean") is not None and len(r["confirm_val_loss"]) == len(CONFIRM_SEEDS)]
    # The target: the highest final loss of any seed of the DiLoCo and NoLoCo rows, so that every one reaches it.
    family = [v for r in done if r["algo"].split("_")[0] in ("diloco", "noloco") for v in r["confirm_val_loss"]]
    target = max(family) if family else None
    print(f"setup {a.setup}: sharding {SETUPS[a.setup][0]}, {SETUPS[a.setup][1]} rounds of H = {H}, {WORKERS} workers")
    print(
        "| algorithm | schedule | points run | best setting (seed 1) | on the grid's edge | val, seed 1 | "
        "val, seeds 2-4: mean ± std [min, max] | vs blocking DiLoCo: means [per-seed range] | "
        "time to target, 80 Mbit/s het., as 125M (modelled s, seeds 2-4) | at the default | MB sent/worker | "
        "MB/worker, every payload through the codec | compute util. 80M het |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "best" not in r:
            print(f"| {r['entry']} | - | {r['points_run']}/{r['points']} | - | - | - | - | - | - | - | - | - | - |")
            continue
        v = r["confirm_val_loss"]
        if len(v) > 1:
            conf = f"{r['confirm_mean']:.4f} ± {r['confirm_std']:.4f} [{min(v):.4f}, {max(v):.4f}] ({len(v)} seeds)"
        else:
            conf = f"{v[0]:.4f} (1 seed)" if v else "not run"
        rel = "-"
        if ref is not None and r["confirm_mean"] is not None and ref.get("confirm_mean"):
            paired = [
                100 * (x / y - 1)
                for s, x in zip(r["confirm_seeds"], v)
                for t, y in zip(ref["confirm_seeds"], ref["confirm_val_loss"])
                if s == t
            ]
            rel = _pct(r["confirm_mean"], ref["confirm_mean"])
            if paired and r is not ref:
                rel += f" [{min(paired):+.1f}%, {max(paired):+.1f}%]"
        elif ref is not None:
            rel = f"{_pct(r['tune_val_loss'], ref['tune_val_loss'])} (seed 1)"
        ttt = "-"
        if (
            target is not None
            and r["confirm_runs"]
            and all("80mbit_het/125M" in c["timelines"] for c in r["confirm_runs"])
        ):
            times = [time_to_target(run, target) for run in r["confirm_runs"]]
            reached = [t for t in times if t is not None]
            r["time_to_target_s"] = times
            ttt = f"{statistics.fmean(reached):.0f}" if reached else "never"
            if len(reached) < len(times):
                ttt += f" ({len(reached)} of {len(times)} seeds reached it)"
            elif len(reached) > 1:
                ttt += f" [{min(reached):.0f}, {max(reached):.0f}]"
        setting = ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in r["best"].items())
        dflt = f"{r['default_val_loss']:.4f}" if r["default_val_loss"] is not None else "-"
        coded = r["bytes_coded_per_worker"]
        if coded is None and r["algo"].split("_")[0] != "diloco":  # every other method sends coded payloads
            coded = r["bytes_sent_per_worker"]
        print(
            f"| {r['entry']} | {'overlap' if r['overlap'] else 'blocking'} | {r['points_run']}/{r['points']} | "
            f"{setting} | {', '.join(r['best_on_edge']) or 'inside'} | {r['tune_val_loss']:.4f} | {conf} | {rel} | "
            f"{ttt} | {dflt} | {r['bytes_sent_per_worker'] / 1e6:.2f} | "
            f"{'-' if coded is None else f'{coded / 1e6:.2f}'} | {100 * r['util_80mbit_het']:.0f}% |"
        )
    if target is not None:
        print(f"target: {target:.4f}, the highest final loss of any seed (2-4) of the DiLoCo and NoLoCo rows")
    if a.points:  # every sweep point, best first
        for algo in ALL:
            pts = sorted(sweep_results(algo, a.setup), key=lambda r: r["final_val_loss"])
            if pts:
                print(f"- {algo}: " + ", ".join(f"{point_name(r['params'])} {r['final_val_loss']:.4f}" for r in pts))
    if a.json:
        for r in rows:
            r.pop("confirm_runs", None)
        _harness.write_json(ROOT / a.setup / "table.json", rows)


AGGREGATION = ("diloco", "sparseloco", "sparseloco_senders")


def cmd_aggregation(a: argparse.Namespace) -> None:
    """Best against best past 8 workers: the tuned point of DiLoCo and of SparseLoCo under each rule (complete
    8-worker sweeps of the setup) at each worker count, on seeds 2-4 (8 workers: the sweep's own seed runs)."""
    import torch

    from locomm.data import load_corpus

    torch.set_num_threads(a.threads)
    splits = load_corpus(base_spec(TUNE_SEED, a.setup).data)
    table = []
    for workers in a.workers:
        for algo in AGGREGATION:
            b = best(algo, setup=a.setup)
            if b is None or len(sweep_results(algo, a.setup)) < len(grid(algo)):
                print(f"{algo}: sweep of {a.setup} incomplete, skipped")
                continue
            vals, mb = [], math.nan
            for seed in CONFIRM_SEEDS:
                path = confirm_path(algo, b["params"], seed, a.setup)
                if workers != WORKERS:
                    name = f"w{workers}_{algo}_seed{seed}_{point_name(b['params'])}.json"
                    path = ROOT / a.setup / "aggregation" / name
                _run(
                    path,
                    lambda algo=algo, b=b, seed=seed, w=workers: run_point(
                        algo, b["params"], seed, splits, setup=a.setup, workers=w
                    ),
                    f"{a.setup} x{workers} seed {seed} {algo} {point_name(b['params'])}",
                )
                if (r := load(path)) is not None:
                    vals.append(r["final_val_loss"])
                    mb = r["bytes_sent_per_worker"] / 1e6
            table.append({"workers": workers, "algo": algo, "params": b["params"], "val": vals, "mb_per_worker": mb})
    ref = {t["workers"]: t for t in table if t["algo"] == "diloco"}
    print("| workers | algorithm | tuned point | val, seeds 2-4 mean ± std | vs DiLoCo | MB sent/worker | fewer bytes")
    print("|---|---|---|---|---|---|---")
    for t in table:
        v, d = t["val"], ref.get(t["workers"])
        if not v:
            continue
        m = statistics.fmean(v)
        sd = statistics.stdev(v) if len(v) > 1 else math.nan
        rel = _pct(m, statistics.fmean(d["val"])) if d and d["val"] else "-"
        fewer = f"{d['mb_per_worker'] / t['mb_per_worker']:.0f}x" if d and t["mb_per_worker"] > 0 else "-"
        print(
            f"| {t['workers']} | {t['algo']} | {point_name(t['params'])} | {m:.4f} ± {sd:.4f} ({len(v)}) | {rel} | "
            f"{t['mb_per_worker']:.3f} | {fewer} |"
        )
    _harness.write_json(ROOT / a.setup / "aggregation" / "table.json", table)


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
    _harness.write_json(ROOT / "norms.json", rows)


def main() -> None:
    ap = _harness.parser(__doc__, out=False, summary=True)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--algos", nargs="+", default=list(ALL), choices=ALL)
    r.add_argument("--no-seeds", action="store_true", help="Only the sweep, not the seeds 2-4 of its best points")
    t = sub.add_parser("table")
    t.add_argument("--json", action="store_true", help="Also write benchmarks/results/tune/<setup>/table.json")
    t.add_argument("--points", action="store_true", help="Also list every sweep point, best first")
    g = sub.add_parser("aggregation")
    g.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    for p in (r, t, g):
        p.add_argument("--setup", default=DEFAULT_SETUP, choices=list(SETUPS))
    for p in (r, g):
        p.add_argument("--threads", type=int, default=1)
    sub.add_parser("norms")
    a = ap.parse_args()
    {"run": cmd_run, "table": cmd_table, "aggregation": cmd_aggregation, "norms": cmd_norms}[a.cmd](a)


if __name__ == "__main__":
    main()
