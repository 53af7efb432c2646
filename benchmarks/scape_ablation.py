"""SCAPE, each fix of issue 33 on its own, against dense AdamS tuned by an lr sweep (the simulator; 1 core each).

Every run is one island of N workers syncing every step (``locomm.sim.scape.run_island``), at the preset's
tokens and schedule, one seed (``train.seed`` and ``outer.seed`` together). The variants, cumulative:

- ``v0``: the build before issue 33: off-mask coordinates step on a zero gradient, masks from |m| alone, a
  residual never decayed, steps 0 and 1 dense;
- ``hold``: AdamS holds off-mask weights, moments and decay (``outer.scape_hold``);
- ``hold+refresh``: + the owner ranks its slice by |m + w*r| (``outer.scape_residual_weight`` 0.1);
- ``hold+refresh+decay``: + the residual decays by 0.9 a step (``outer.scape_residual_decay``);
- ``hold+refresh+decay+warmup``: + a dense warm-up of 20 steps (the spec's defaults while this ran first: the
  entries keyed ``default`` before the defaults were set by these results are these options, as each entry's
  ``outer`` field records);
- ``default``: the spec's defaults now (``hold``'s options, the best measured at 90%);
- ``hold+refresh1+decay``, ``refresh1+decay``: a residual weight of 1, with and without hold.

``--no-bias-correction`` runs AdamS (dense and under SCAPE) without its bias correction (``inner.bias_correction``:
the paper's equations as quoted; the method keys end in ``:nobc``).

Dense AdamS (``adams_ddp``) and dense AdamW (``adamw_ddp``, the simulator's DDP path: the paper's other
reference) run at each ``--lrs`` value; every SCAPE variant runs at ``--scape-lr`` (the dense
sweep's best, once known) so the two compare at one tuned lr. Each entry is written atomically to
``benchmarks/results/scape-ablation-<preset>.json`` (``--out``: one file per process), ``--resume`` skips those
done; ``--report`` prints the table from every ``scape-ablation-<preset>*.json``.

    nice python benchmarks/scape_ablation.py --methods adams_ddp --lrs 0.003 0.005 0.01 0.02 --seeds 0 --resume
    nice python benchmarks/scape_ablation.py --sparsities 0.9 0.99 --scape-lr 0.01 --seeds 0 --resume
    nice python benchmarks/scape_ablation.py --methods adamw_ddp --lrs 0.003 0.005 0.01 0.02 --seeds 0 1 2 --resume
    python benchmarks/scape_ablation.py --report
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from locomm.config import RunSpec
from locomm.data import load_corpus
from locomm.sim.scape import Cost, run_adamw_ddp, run_island

import _harness

V0 = dict(scape_hold=False, scape_residual_decay=1.0, scape_residual_weight=0.0, scape_dense_steps=2)
VARIANTS: dict[str, dict[str, Any]] = {
    "v0": V0,
    "hold": {**V0, "scape_hold": True},
    "hold+refresh": {**V0, "scape_hold": True, "scape_residual_weight": 0.1},
    "hold+refresh+decay": {**V0, "scape_hold": True, "scape_residual_weight": 0.1, "scape_residual_decay": 0.9},
    "hold+refresh+decay+warmup": {
        "scape_hold": True,
        "scape_residual_weight": 0.1,
        "scape_residual_decay": 0.9,
        "scape_dense_steps": 20,
    },
    "default": {},
    # past the cumulative list: a residual weight that brings a coordinate back within a few steps (at 0.1 an
    # off-mask coordinate needs ~100 steps of noise-sized residual to outrank the mask), with and without hold
    "hold+refresh1+decay": {**V0, "scape_hold": True, "scape_residual_weight": 1.0, "scape_residual_decay": 0.9},
    "refresh1+decay": {**V0, "scape_residual_weight": 1.0, "scape_residual_decay": 0.9},
}
STEPS = {"nano": 300, "tiny": 500}
NOBC = ":nobc"


def key(preset: str, workers: int, seed: int, method: str, lr: float) -> str:
    return f"{preset}/w{workers}/seed{seed}/{method}/lr={lr:g}"


def run(preset: str, workers: int, seed: int, method: str, lr: float, steps: int, splits: Any) -> dict:
    spec = RunSpec.preset(preset).replace("train", seed=seed).replace("inner", lr=lr)
    full, (method, nobc) = method, (method.removesuffix(NOBC), method.endswith(NOBC))
    if nobc:
        spec = spec.replace("inner", name="adams", bias_correction=False)  # what run_island sets
    if method == "adams_ddp":
        spec = spec.replace("outer", seed=seed)
        r = run_island(spec, workers, steps, method="adams_ddp", splits=splits, eval_every=max(1, steps // 10))
    elif method == "adamw_ddp":  # the paper's other reference: dense AdamW, tuned on the same lr grid
        spec = spec.replace("outer", seed=seed)
        r = run_adamw_ddp(spec, workers, steps, splits=splits, eval_every=max(1, steps // 10))
    else:
        name, sparsity = method.split("@")
        sparsity, variant = sparsity.split(":")
        spec = spec.replace("outer", seed=seed, scape_sparsity=float(sparsity), **VARIANTS[variant])
        r = run_island(spec, workers, steps, method=name, splits=splits, eval_every=max(1, steps // 10), cost=Cost())
    out = r.as_json()
    out.update(
        preset=preset,
        seed=seed,
        lr=lr,
        method_key=full,
        bias_correction=spec.inner.bias_correction,
        outer={k: v for k, v in vars(spec.outer).items() if k.startswith("scape_")},
    )
    return out


def report(preset: str, entries: dict) -> str:
    """Per workers, method and lr: final val loss over seeds, and the gap to the best dense AdamS per seed."""
    rows = [e for e in entries.values() if e["preset"] == preset]
    lines = [
        "| workers | method | lr | seeds | final val loss | vs best dense AdamS of its form (per seed) "
        "| values/step vs dense |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in sorted({e["workers"] for e in rows}):
        best = {}  # per seed and AdamS form (with or without its bias correction): the best over the lr sweep
        for e in rows:
            if e["workers"] == w and e["method_key"] in ("adams_ddp", "adams_ddp" + NOBC) and "diverged" not in e:
                at = (e["seed"], e["method_key"].endswith(NOBC))
                best[at] = min(best.get(at, float("inf")), e["final_val_loss"])
        groups: dict[tuple[str, float], list[dict]] = {}
        for e in rows:
            if e["workers"] == w:
                groups.setdefault((e["method_key"], e["lr"]), []).append(e)
        for (method, lr), all_es in sorted(groups.items()):
            es = [e for e in all_es if "diverged" not in e]
            if not es:
                lines.append(f"| {w} | {method} | {lr:g} | {len(all_es)} | diverged | - | - |")
                continue
            losses = [e["final_val_loss"] for e in es]
            ats = [(e["seed"], method.endswith(NOBC)) for e in es]  # each run against the best dense of its form
            gaps = [100 * (e["final_val_loss"] / best[at] - 1) for e, at in zip(es, ats, strict=True) if at in best]
            loss = f"{statistics.fmean(losses):.4f}" + (f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else "")
            gap = "-" if not gaps else f"{statistics.fmean(gaps):+.2f}% ({', '.join(f'{g:+.2f}' for g in gaps)})"
            frac = statistics.fmean(e["bytes_per_step"] / e["dense_bytes"] for e in es)
            lines.append(f"| {w} | {method} | {lr:g} | {len(es)} | {loss} | {gap} | {frac:.4f} |")
    return "\n".join(lines)


def main() -> None:
    ap = _harness.parser(__doc__, out=None, resume=True, summary=True)
    ap.add_argument("--preset", choices=sorted(STEPS), default="nano")
    ap.add_argument("--workers", type=int, nargs="+", default=[4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--methods", nargs="+", default=["scape"], choices=["scape", "adams_ddp", "adamw_ddp"])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-2], help="The dense baselines' lr sweep")
    ap.add_argument("--scape-lr", type=float, default=1e-2, help="Every SCAPE variant's lr")
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.9, 0.99])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, help="Steps per worker (default: nano 300, tiny 500)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-bias-correction", action="store_true", help="AdamS without its bias correction")
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args()
    if args.report:
        merged: dict = {}
        for path in sorted(_harness.RESULTS.glob(f"scape-ablation-{args.preset}*.json")):
            merged.update(_harness.Entries(path, resume=True).entries)
        print(report(args.preset, merged))
        return
    torch.set_num_threads(args.threads)
    out = args.out or _harness.results_path(f"scape-ablation-{args.preset}.json")
    done = _harness.Entries(out, resume=args.resume)
    steps = args.steps or STEPS[args.preset]
    splits = load_corpus(RunSpec.preset(args.preset).data)
    todo = []
    for seed in args.seeds:
        for workers in args.workers:
            for dense in ("adams_ddp", "adamw_ddp"):
                if dense in args.methods:
                    todo += [(seed, workers, dense, lr) for lr in args.lrs]
            if "scape" in args.methods:
                todo += [
                    (seed, workers, f"scape@{s:g}:{v}", args.scape_lr) for s in args.sparsities for v in args.variants
                ]
    if args.no_bias_correction:
        if "adamw_ddp" in args.methods:
            ap.error("--no-bias-correction is AdamS's: AdamW has no such choice")
        todo = [(seed, workers, method + NOBC, lr) for seed, workers, method, lr in todo]
    for seed, workers, method, lr in todo:
        name = key(args.preset, workers, seed, method, lr)
        if name in done:
            continue
        t0 = time.perf_counter()
        try:
            e = run(args.preset, workers, seed, method, lr, steps, splits)
        except FloatingPointError as err:  # a diverged run is a result: the sweep's edge
            e = dict(preset=args.preset, seed=seed, lr=lr, method_key=method, workers=workers, diverged=str(err))
        done.add(name, e)
        print(f"{name}: val {e.get('final_val_loss', 'diverged')} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(report(args.preset, done.entries))


if __name__ == "__main__":
    main()
