"""NoLoCo against tuned DiLoCo past 16 workers: time to target over heterogeneous 80 Mbit/s links.

Two parts, both resumable (one JSON per run in benchmarks/results/scale/, skipped when on disk):

``run``: real nano numerics in the simulator at 16, 32 and 64 workers (the budget of
benchmarks/tune.py: batch 8 x 128, H = 20, 15 rounds for every method (equal schedules), evaluated every
round, on the data sharding of ``--setup``: iid_15r by default, contiguous_15r for the earlier runs), each
method's schedule (the daemon's overlap, or blocking as DiLoCo's paper runs it) and deadlines live on the
network, so a partner that misses its deadline is skipped and the numerics are that network's. ``--seeds``
(iid_15r: 2, 3, 4 by default) vary the data order, the init, the gossip draws and the network's draw of link
and compute speeds; the contiguous runs were seed 2 on network draw 0 only. Settings: each run's best point
of benchmarks/tune.py where its sweep is on disk, else its documented default (the JSON says which).
Network: per-worker links 80 Mbit/s x 10^(-u), u ~ U(0, 1) (heterogeneity 1.0, up = down), compute
speeds spread the same way, 30 ms latency, compute at 10 TFLOP/s for a speed-1 worker. Traffic and
compute are those of a 125M-parameter model (bytes and FLOPs x 125M / nano, done as link, floor rate
and compute speed / k; the fixed timeouts in seconds stay as they are). The reference is DiLoCo
with a 3600 s all-reduce timeout (``diloco_sized_timeout``: every butterfly completes, so DiLoCo is
not handicapped by a deadline); ``--runs diloco`` runs it with the daemon's own deadline, sized by bytes
(network.request_timeout_s + 2 S / floor rate, as peer/dataparallel/node.py sets it), which a butterfly paced by
a member under the floor rate misses.

``replay``: 256 and 1024 workers, timeline only. Assumptions (stated in the README): the loss after
round r is the one measured at 64 workers after round r (the curves of ``run``), for every N; NoLoCo
pairs come from the protocol's own seeded groups, DiLoCo is the butterfly cost model; same network
draw rule, same 125M scaling; no deadlines fire (checked: the replay counts them).

    nice -n 19 python benchmarks/scale.py run            # 16/32/64 workers; hours on 2 shared cores
    python benchmarks/scale.py replay                     # 256/1024 workers from the 64-worker curves
    python benchmarks/scale.py table
"""

from __future__ import annotations

import argparse
import math
import resource
import time
from typing import Any

import tune  # benchmarks/tune.py: the budget and the sweep's results

import _harness

SETUP = tune.DEFAULT_SETUP
"""The tune.py setup whose sharding and tuned points are used (``--setup``); main() sets it and OUT."""
OUT = _harness.results_path("scale") / SETUP
SCALED_PARAMS = 125e6
NET = dict(link_bps=80e6, latency_s=0.030, heterogeneity=1.0)
SEED = 2
RUNS = {  # name -> (benchmarks/tune.py algorithm or variant, whose tuned point and schedule it runs; spec changes)
    "noloco": ("noloco", {}),
    "diloco": ("diloco", {}),
    "diloco_sized_timeout": ("diloco", {"request_timeout_s": 3600.0}),
    "diloco_blocking": ("diloco_blocking", {"request_timeout_s": 3600.0}),  # as DiLoCo's paper runs it
    "noloco_blocking": ("noloco_blocking", {}),
}
REFERENCE = {"iid_15r": "diloco_blocking", "contiguous_15r": "diloco_sized_timeout"}
"""The run the table compares against: DiLoCo as its paper runs it (the contiguous runs predate blocking)."""


def setting(algo: str) -> tuple[dict[str, float], str]:
    b, n, points = tune.best(algo, setup=SETUP), len(tune.sweep_results(algo, SETUP)), len(tune.grid(algo))
    if b is not None and n >= points:
        return b["params"], f"tuned (benchmarks/tune.py {SETUP}, complete sweep of {n} points)"
    if b is not None:
        return b["params"], f"best of {n}/{points} {SETUP} sweep points so far"
    return tune.grid(algo)[0], "documented default (no sweep on disk)"


def scaled_network(workers: int, k: float, step_s: float, seed: int = 0) -> Any:
    from locomm.sim import NetworkModel

    return NetworkModel.build(
        workers,
        link_bps=NET["link_bps"] / k,
        latency_s=NET["latency_s"],
        heterogeneity=NET["heterogeneity"],
        step_s=step_s * k,
        seed=seed,
    )


def run_path(workers: int, name: str, seed: int, rounds: int) -> Any:
    """Where a run's JSON goes: the contiguous runs (seed 2 only) keep their names; the others name the seed."""
    tail = "" if rounds == tune.ROUNDS else f"_r{rounds}"
    return OUT / (
        f"w{workers}_{name}{tail}.json" if SETUP == "contiguous_15r" else f"w{workers}_{name}_s{seed}{tail}.json"
    )


def run_one(name: str, workers: int, splits: Any, rounds: int, seed: int = SEED) -> dict[str, Any]:
    from locomm.model import build_model
    from locomm.sim import Simulator
    from locomm.sim.network import flops_step_s

    algo, net_changes = RUNS[name]
    kw, why = setting(algo)
    outer_algo, fixed, overlap = tune.VARIANTS.get(algo, (algo, {}, True))
    spec = tune.base_spec(seed, SETUP).replace("outer", algo=outer_algo, **fixed, **kw)
    spec = spec.replace("train", steps=rounds * tune.H)
    params = build_model(spec.model).num_parameters()
    k = SCALED_PARAMS / params
    # Bytes x k is link / k; so the floor rate too. Timeouts in seconds stay.
    spec = spec.replace("network", min_rate_mbit=spec.network.min_rate_mbit / k, **net_changes)
    step_s = flops_step_s(params, spec.data.batch_size * spec.data.seq_len, tune.TFLOPS)
    net = scaled_network(workers, k, step_s, seed=0 if SETUP == "contiguous_15r" else seed)
    t0 = time.perf_counter()
    sim = Simulator(spec, workers, splits=splits, network=net, overlap=overlap)
    res = sim.run(rounds)
    tl = res.timeline
    util = tl.compute_utilisation()
    return {
        "name": name,
        "algo": algo,
        "params": kw,
        "setting": why,
        "workers": workers,
        "rounds": rounds,
        "seed": seed,
        "overlap": overlap,
        "scaled_params": SCALED_PARAMS,
        "network": NET,
        "network_changes": net_changes,
        "final_val_loss": res.final_val_loss,
        "steps": res.steps,
        "val_loss": res.val_loss,
        "curve_s": res.curve_times(res.round_done),
        "round_done": res.round_done,
        "wall_s": tl.wall(),
        "compute_utilisation_mean": sum(util) / len(util),
        "compute_utilisation_min": min(util),
        "partners_skipped": tl.skipped,
        "transfers_cut": tl.cut,
        "bytes_sent_per_worker_nano": sum(res.bytes_sent) / workers,
        "real_s": time.perf_counter() - t0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def cmd_run(a: argparse.Namespace) -> None:
    import torch

    from locomm.data import load_corpus

    torch.set_num_threads(a.threads)
    seeds = a.seeds or ([SEED] if SETUP == "contiguous_15r" else list(tune.CONFIRM_SEEDS))
    for seed in seeds:
        splits = load_corpus(tune.base_spec(seed, SETUP).data)
        for workers in a.workers:
            for name in a.runs:
                path = run_path(workers, name, seed, a.rounds)
                if _harness.done(path):
                    continue
                r = run_one(name, workers, splits, a.rounds, seed)
                _harness.write_json(path, r)
                print(
                    f"{name:22s} x{workers:<3d} seed {seed} val {r['final_val_loss']:.4f} wall {r['wall_s']:.0f} s "
                    f"util {100 * r['compute_utilisation_mean']:.0f}% skipped {r['partners_skipped']} "
                    f"({r['real_s']:.0f} s real, {r['peak_rss_mb']:.0f} MB)",
                    flush=True,
                )


def replay_one(
    algo: str,
    workers: int,
    rounds: int,
    nano_bytes: float,
    raw: float,
    step_s: float,
    k: float,
    sized_timeout: bool = True,
) -> dict[str, Any]:
    from locomm.protocol.schedule import group_of, noloco_groups
    from locomm.protocol.timing import Limits
    from locomm.sim.network import RoundRecord, round_done
    from locomm.sim.timeline import replay_schedule

    members = list(range(workers))
    recs = []
    for r in range(rounds):
        if algo == "noloco":
            groups = noloco_groups(r, members, 2, 0)
            peers = {w: [g for g in group_of(w, groups) if g != w] for w in members}
            recs.append(
                RoundRecord(
                    steps=tune.H,
                    bytes_sent={w: nano_bytes for w in members},
                    kind="direct",
                    peers=peers,
                    members=members,
                    raw_bytes={w: raw for w in members},
                )
            )
        else:
            recs.append(
                RoundRecord(
                    steps=tune.H,
                    bytes_sent={w: nano_bytes for w in members},
                    kind="butterfly",
                    peers={},
                    members=members,
                )
            )
    net = scaled_network(workers, k, step_s)
    from locomm.config import NetworkConfig

    cfg = NetworkConfig()
    dl = Limits.from_network(cfg)
    dl = Limits(
        stall_timeout_s=dl.stall_timeout_s,
        min_rate_Bps=dl.min_rate_Bps / k,
        rate_window_s=dl.rate_window_s,
        max_wait_s=dl.max_wait_s,
        request_timeout_s=3600.0 if algo == "diloco" and sized_timeout else dl.request_timeout_s,
    )
    tl, mismatches = replay_schedule(recs, net, workers, overlap=True, deadlines=dl)
    util = tl.compute_utilisation()
    return {
        "round_done": round_done(tl, True),
        "wall_s": tl.wall(),
        "mismatches": mismatches,
        "partners_skipped": tl.skipped,
        "transfers_cut": tl.cut,
        "compute_utilisation_mean": sum(util) / len(util),
        "compute_utilisation_min": min(util),
    }


def cmd_replay(a: argparse.Namespace) -> None:
    from locomm.model import build_model
    from locomm.sim.network import flops_step_s

    base = {n: tune.load(OUT / f"w64_{n}.json") for n in ("noloco", "diloco_sized_timeout")}
    spec = tune.base_spec(SEED, SETUP)
    params = build_model(spec.model).num_parameters()
    k = SCALED_PARAMS / params
    step_s = flops_step_s(params, spec.data.batch_size * spec.data.seq_len, tune.TFLOPS)
    raw = 4.0 * params
    for workers in a.workers:
        for name, algo in (("noloco", "noloco"), ("diloco_sized_timeout", "diloco"), ("diloco", "diloco")):
            path = OUT / f"replay_w{workers}_{name}.json"
            if _harness.done(path):
                continue
            # Bytes per push as the 64-worker run measured them (NoLoCo: lossless theta; DiLoCo: raw fp32).
            b = base.get(name)
            nano_bytes = raw if algo == "diloco" else (b["bytes_sent_per_worker_nano"] / b["rounds"] if b else raw)
            r = replay_one(algo, workers, a.rounds, nano_bytes, raw, step_s, k, sized_timeout=name != "diloco")
            r.update(
                {
                    "name": name,
                    "workers": workers,
                    "rounds": a.rounds,
                    "bytes_per_push_nano": nano_bytes,
                    "loss_curve_from": "w64" if b else None,
                    "val_loss": b["val_loss"] if b else None,
                    "steps": b["steps"] if b else None,
                }
            )
            _harness.write_json(path, r)
            print(
                f"replay {name:22s} x{workers:<5d} wall {r['wall_s']:.0f} s util "
                f"{100 * r['compute_utilisation_mean']:.0f}% mismatches {r['mismatches']}",
                flush=True,
            )


def ttt(steps: list[int], val: list[float], round_done: list[float], target: float) -> float:
    for s, v in zip(steps, val):
        if v <= target:
            return 0.0 if s == 0 else round_done[s // tune.H - 1]
    return math.inf


def cmd_table(a: argparse.Namespace) -> None:
    if SETUP != "contiguous_15r":
        return seeds_table(a)
    print(
        "| workers | run | setting | val loss | vs DiLoCo | t->target (s) | speed-up vs DiLoCo | wall (s) | "
        "DiLoCo's time to this loss (s) | loss-matched speed-up | compute util. mean / min | partners skipped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for workers in (16, 32, 64, 256, 1024):
        rows = {n: tune.load(OUT / f"w{workers}_{n}.json") for n in RUNS}
        for n in ("noloco", "diloco_sized_timeout"):
            if rows.get(n) is None and (rp := tune.load(OUT / f"replay_w{workers}_{n}.json")) is not None:
                rows[n] = {
                    **rp,
                    "final_val_loss": rp["val_loss"][-1] if rp.get("val_loss") else math.nan,
                    "setting": "replay of the 64-worker curve",
                    "partners_skipped": rp["mismatches"],
                }
        ref = rows.get("diloco_sized_timeout")
        if ref is None or not ref.get("val_loss"):
            continue
        target = 1.02 * ref["final_val_loss"]
        t_ref = ttt(ref["steps"], ref["val_loss"], ref["round_done"], target)
        for n, r in rows.items():
            if r is None or not r.get("val_loss"):
                continue
            t = ttt(r["steps"], r["val_loss"], r["round_done"], target)
            rel = 100 * (r["final_val_loss"] / ref["final_val_loss"] - 1)
            sp = f"{t_ref / t:.2f}x" if math.isfinite(t) and t > 0 and math.isfinite(t_ref) else "-"
            # The other way round: how long DiLoCo took to reach this run's final loss, against this run's wall.
            t_match = ttt(ref["steps"], ref["val_loss"], ref["round_done"], r["final_val_loss"])
            mt = f"{t_match:.0f}" if math.isfinite(t_match) else "-"
            ms = f"{t_match / r['wall_s']:.2f}x" if math.isfinite(t_match) and r["wall_s"] > 0 else "-"
            print(
                f"| {workers} | {n} | {r.get('setting', '')} | {r['final_val_loss']:.4f} | {rel:+.1f}% | "
                f"{'-' if math.isinf(t) else f'{t:.0f}'} | {sp} | {r['wall_s']:.0f} | {mt} | {ms} | "
                f"{100 * r['compute_utilisation_mean']:.0f}% / {100 * r['compute_utilisation_min']:.0f}% | "
                f"{r.get('partners_skipped', '-')} |"
            )


def _spread(xs: list[float], fmt: str = ".4f") -> str:
    """mean [min, max] (or the one value)."""
    if len(xs) == 1:
        return format(xs[0], fmt)
    return f"{format(sum(xs) / len(xs), fmt)} [{format(min(xs), fmt)}, {format(max(xs), fmt)}]"


def seeds_table(a: argparse.Namespace) -> None:
    """Per worker count and run, over the seeds on disk: final loss, and time to a target every run of that seed
    reaches (the highest final loss among the runs of the seed: equal schedules, so each one's last round at the
    latest), against the reference (DiLoCo as its paper runs it) on the same seed and network draw."""
    ref_name = REFERENCE[SETUP]
    print(
        f"| workers | run | seeds | val loss: mean [min, max] | vs {ref_name} (mean of per-seed) | "
        f"time to target, s | speed-up vs {ref_name}: mean [per seed] | wall s | "
        f"{ref_name}'s time to this run's final loss / this run's wall: mean [per seed] | compute util. | "
        "partners skipped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows_json = []
    for workers in (16, 32, 64):
        per_seed: dict[int, dict[str, dict[str, Any]]] = {}
        for seed in range(10):
            runs = {n: r for n in RUNS if (r := tune.load(run_path(workers, n, seed, tune.ROUNDS))) is not None}
            if ref_name in runs and len(runs) > 1:
                per_seed[seed] = runs
        if not per_seed:
            continue
        for n in RUNS:
            seeds = [sd for sd, runs in per_seed.items() if n in runs]
            if not seeds:
                continue
            loss, rel, t_run, speed, wall, util, skipped, matched = [], [], [], [], [], [], [], []
            for sd in seeds:
                runs, r = per_seed[sd], per_seed[sd][n]
                ref = runs[ref_name]
                target = max(x["final_val_loss"] for x in runs.values())
                t = ttt(r["steps"], r["val_loss"], r["round_done"], target)
                t_ref = ttt(ref["steps"], ref["val_loss"], ref["round_done"], target)
                loss.append(r["final_val_loss"])
                rel.append(100 * (r["final_val_loss"] / ref["final_val_loss"] - 1))
                t_run.append(t)
                speed.append(t_ref / t if t > 0 and math.isfinite(t) and math.isfinite(t_ref) else math.nan)
                wall.append(r["wall_s"])
                # the other way round: how long the reference took to reach this run's final loss
                t_match = ttt(ref["steps"], ref["val_loss"], ref["round_done"], r["final_val_loss"])
                matched.append(t_match / r["wall_s"] if math.isfinite(t_match) and r["wall_s"] > 0 else math.nan)
                util.append(100 * r["compute_utilisation_mean"])
                skipped.append(r["partners_skipped"])
            sp = ", ".join(f"{x:.2f}x" for x in speed)
            print(
                f"| {workers} | {n} | {len(seeds)} | {_spread(loss)} | {sum(rel) / len(rel):+.1f}% | "
                f"{_spread(t_run, '.0f')} | {sum(speed) / len(speed):.2f}x [{sp}] | {_spread(wall, '.0f')} | "
                f"{sum(matched) / len(matched):.2f}x [{', '.join(f'{x:.2f}x' for x in matched)}] | "
                f"{_spread(util, '.1f')}% | {sum(skipped)} |"
            )
            rows_json.append(
                dict(
                    workers=workers,
                    run=n,
                    seeds=seeds,
                    loss=loss,
                    rel_pct=rel,
                    ttt_s=t_run,
                    speedup=speed,
                    loss_matched=matched,
                    wall_s=wall,
                    util_pct=util,
                    skipped=skipped,
                )
            )
    _harness.write_json(OUT / "table.json", {"reference": ref_name, "rows": rows_json})


def main() -> None:
    ap = _harness.parser(__doc__, out=False, summary=True)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--workers", type=int, nargs="+", default=[16, 32, 64])
    r.add_argument(
        "--runs",
        nargs="+",
        default=["noloco", "diloco_blocking"],
        choices=list(RUNS),
        help="diloco: DiLoCo under the daemon's byte-sized all-reduce deadline (not run by default); "
        "contiguous_15r's runs were noloco and diloco_sized_timeout",
    )
    r.add_argument("--rounds", type=int, default=tune.ROUNDS)
    r.add_argument("--seeds", type=int, nargs="+", help="iid_15r: 2 3 4 (the tuned points' confirmation seeds)")
    r.add_argument("--threads", type=int, default=1)
    p = sub.add_parser("replay")
    p.add_argument("--workers", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--rounds", type=int, default=tune.ROUNDS)
    t = sub.add_parser("table")
    for q in (r, p, t):
        q.add_argument("--setup", default=tune.DEFAULT_SETUP, choices=["iid_15r", "contiguous_15r"])
    a = ap.parse_args()
    global SETUP, OUT
    SETUP = a.setup
    # The contiguous runs came first and stay where they were written.
    OUT = _harness.results_path("scale") / (SETUP if SETUP != "contiguous_15r" else "")
    {"run": cmd_run, "replay": cmd_replay, "table": cmd_table}[a.cmd](a)


if __name__ == "__main__":
    main()
