"""Tune GASLoC's eta (outer lr), a (gossip step) and gamma (momentum) on a small simulated run.

docs/algorithms.md §3 leaves GASLoC's coefficients open ("tune on a small run and record
the chosen defaults with their evidence"). This sweeps them on 4 workers, nano,
H=20, 10 rounds, data/init seed 1 (a different seed and size from
benchmarks/algorithms.py, so the benchmark is not the tuning set), beside DiLoCo
at its documented defaults, and prints the final validation losses.

    python benchmarks/tune_gasloc.py        # about 6 minutes on 2 cores

Superseded by benchmarks/tune.py, which gives every algorithm (DiLoCo's momentum included) the same
12-point budget at 8 workers; this 4-worker sweep tuned GASLoC alone against an untuned DiLoCo.
"""

from __future__ import annotations

import itertools
import json

from locomm.config import RunSpec
from locomm.data import load_corpus
from locomm.sim import Simulator

import _harness


def main() -> None:
    args = _harness.parser(__doc__, out="tune_gasloc.json", summary=True).parse_args()
    spec = (
        RunSpec.preset("nano")
        .replace("data", batch_size=8, seq_len=128)
        .replace("outer", inner_steps=20)
        .replace("train", steps=200, seed=1, eval_batches=8)
    )
    splits = load_corpus(spec.data)
    rows = []
    runs = [("diloco", {})] + [
        ("gasloc", dict(lr=eta, gasloc_mix=a, gasloc_gamma=g))
        for eta, a, g in itertools.product((0.7, 1.0), (0.5,), (0.0, 0.5, 0.9))
    ]
    for algo, kw in runs:
        sim = Simulator(spec.replace("outer", algo=algo, **kw), 4, splits=splits)
        res = sim.run(10)
        rows.append({"algo": algo, **kw, "final_val_loss": res.final_val_loss})
        print(f"{algo:7s} {json.dumps(kw):55s} val {res.final_val_loss:.4f}", flush=True)
    _harness.write_json(args.out, rows)


if __name__ == "__main__":
    main()
