"""Each method at its paper's protocol: NoLoCo against DiLoCo as NoLoCo's public configs run them.

NoLoCo's public configs (jkolehm/noloco, configs/no_reduce_exp/C4/c4_noloco_mean_100m_8.yaml and
c4_diloco_100m_8.yaml; docs/algorithms.md §2): NoLoCo with H = 50, outer lr alpha = gamma = 0.7,
momentum beta = 0.5, groups of 2; DiLoCo with H = 100, outer lr 0.7, heavy-ball (not Nesterov)
momentum 0.3; both with plain Adam inside (no weight decay) and data sharded by file (IID). Here:

- 8 workers, the nano model, batch 8 x 128, IID shards (data.sharding = iid), inner Adam at our
  nano learning rate (3e-3; the configs' 6e-4 is for 100M parameters), cosine over the run;
- the token budget of benchmarks/tune.py's 45-round setup: 900 inner steps per worker
  (NoLoCo 18 rounds of 50, DiLoCo 9 rounds of 100), far below the configs' ~25k steps;
- blocking (``--no-overlap``: each exchange applied before the next round) and with the daemon's
  overlap (applied one round late), both;
- seeds 2, 3 and 4, each varying data order, init and grouping together (train.seed = outer.seed).

Beside them, ``tuned``: each algorithm's best point of benchmarks/tune.py's iid_15r sweep (H = 20,
AdamW), run over the same 900 steps with overlap (the setting our defaults come from).

One JSON per run in benchmarks/results/protocols/, skipped when on disk (several processes may share
the work; each run is claimed first). Runs go seed by seed, so a partial set compares like with like.

    nice -n 19 python benchmarks/protocols.py run            # hours on 2 shared cores
    python benchmarks/protocols.py table
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import tune  # benchmarks/tune.py: the budget, the run, the sweep's results

import _harness

OUT = _harness.results_path("protocols")
STEPS = 45 * tune.H  # the 45-round budget
SEEDS = (2, 3, 4)
PAPER = {  # name -> (algo, outer changes)
    "noloco_paper": ("noloco", dict(inner_steps=50, lr=0.7, noloco_gamma=0.7, noloco_beta=0.5, group_size=2)),
    "diloco_paper": ("diloco", dict(inner_steps=100, lr=0.7, momentum=0.3, nesterov=False)),
}


def spec_for(name: str, seed: int, splits: Any) -> tuple[str, Any, dict[str, Any]]:
    base = tune.base_spec(seed, "iid_15r").replace("train", steps=STEPS)
    if name in PAPER:
        algo, outer = PAPER[name]
        return algo, base.replace("outer", algo=algo, **outer).replace("inner", name="adam"), outer
    algo = name.removeprefix("tuned_")
    b = tune.best(algo, setup="iid_15r")
    if b is None or len(tune.sweep_results(algo, "iid_15r")) < 12:
        raise LookupError(f"{algo}: the iid_15r sweep is not complete")
    return algo, base.replace("outer", algo=algo, **b["params"]), b["params"]


def runs(which: list[str]) -> list[tuple[str, bool, int]]:
    out = []
    for seed in SEEDS:
        for name in which:
            for overlap in (False, True) if name in PAPER else (True,):
                out.append((name, overlap, seed))
    return out


def path_of(name: str, overlap: bool, seed: int) -> Any:
    return OUT / f"{name}_{'overlap' if overlap else 'blocking'}_seed{seed}.json"


def cmd_run(a: argparse.Namespace) -> None:
    import torch

    from locomm.data import load_corpus

    torch.set_num_threads(a.threads)
    splits = load_corpus(tune.base_spec(tune.TUNE_SEED, "iid_15r").data)
    for name, overlap, seed in runs(a.runs):
        path = path_of(name, overlap, seed)
        try:
            algo, spec, kw = spec_for(name, seed, splits)
        except LookupError as e:
            print(f"{name}: skipped ({e})")
            continue
        tune._run(
            path,
            lambda algo=algo, spec=spec, kw=kw, seed=seed, overlap=overlap: {
                **tune.run_point(algo, kw, seed, splits, setup="iid_15r", spec=spec, overlap=overlap, eval_every=1),
                "protocol": name,
                "inner": spec.inner.name,
            },
            f"{name} {'overlap' if overlap else 'blocking'} seed {seed}",
        )


def cmd_table(a: argparse.Namespace) -> None:
    rows: dict[tuple[str, bool], dict[int, float]] = {}
    extra: dict[tuple[str, bool], Any] = {}
    for name, overlap, seed in runs([*PAPER, "tuned_diloco", "tuned_noloco"]):
        r = tune.load(path_of(name, overlap, seed))
        if r is not None:
            rows.setdefault((name, overlap), {})[seed] = r["final_val_loss"]
            extra[name, overlap] = r
    print(f"8 workers, nano, IID, {STEPS} inner steps per worker, seeds {SEEDS}")
    print("| run | schedule | H | val: mean ± std (seeds) | vs DiLoCo (paper), same schedule [per seed] | MB/worker |")
    print("|---|---|---|---|---|---")
    table = []
    for (name, overlap), vals in rows.items():
        v = list(vals.values())
        ref = rows.get(("diloco_paper", overlap), {})
        per = [100 * (vals[s] / ref[s] - 1) for s in vals if s in ref]
        rel = "-"
        if per and name != "diloco_paper":
            gap = 100 * (statistics.fmean(v) / statistics.fmean(ref.values()) - 1)
            rel = f"{gap:+.2f}% [{min(per):+.2f}%, {max(per):+.2f}%]"
        sd = statistics.stdev(v) if len(v) > 1 else float("nan")
        r = extra[name, overlap]
        print(
            f"| {name} | {'overlap' if overlap else 'blocking'} | {r['inner_steps']} | "
            f"{statistics.fmean(v):.4f} ± {sd:.4f} ({len(v)}) | {rel} | {r['bytes_sent_per_worker'] / 1e6:.2f} |"
        )
        table.append({"run": name, "overlap": overlap, "val": vals, "vs_diloco_paper_pct": per})
    _harness.write_json(OUT / "table.json", table)


def main() -> None:
    ap = _harness.parser(__doc__, out=False, summary=True)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--runs", nargs="+", default=[*PAPER, "tuned_diloco", "tuned_noloco"])
    r.add_argument("--threads", type=int, default=1)
    sub.add_parser("table")
    a = ap.parse_args()
    {"run": cmd_run, "table": cmd_table}[a.cmd](a)


if __name__ == "__main__":
    main()
