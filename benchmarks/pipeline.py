"""Pipeline mode: loss under subspace compression, and bytes on the wire per token per boundary.

One configuration per run, each trained for real on this CPU (``locomm/sim/pipeline.py``,
the stage server's compute and codecs, in one process):

- ``tiny32``: the tiny preset (d=256, 8 layers), k = 8 (32x), S stages x 1 replica;
- ``tiny32_plain``: the same pipeline without the subspace (h in bf16 + lossless);
- ``tiny32_free``: tiny32 with the whole last stage unconstrained (``pipeline.free_tail_layers = -1``, the
  default; only blocks before the last boundary must write into span(U)); tiny32 keeps node0's 2 free;
- ``tiny_unsplit``: the ordinary single-process model (``locomm.train.train``);
- ``wide100`` / ``wide100_plain`` / ``wide_unsplit``: d=512 (``--wide-layers``, default 4; 8 heads, d_ff 1408),
  k = 5 (~100x).

Same token budget for all: ``--steps`` (default 311, the README's tiny budget) of 8 x 256
tokens. Both boundary codecs are ``subspace+bf16+lossless`` (bf16 z: 2k bytes per token,
then the lossless coder) and the plain runs ``bf16+lossless`` (2 d bytes per token before
lossless coding); the token window (uint16, 2 bytes per token) is counted forward.

    python benchmarks/pipeline.py --runs tiny32 tiny32_plain tiny_unsplit     # one run per process:
    python benchmarks/pipeline.py --runs tiny32 --out benchmarks/results/pipeline_tiny32.json
    python benchmarks/pipeline.py --merge benchmarks/results/pipeline_*.json   # table + pipeline.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from locomm.config import RunSpec

import _harness

CODEC = "subspace+bf16+lossless"


def spec_for(name: str, steps: int, stages: int, wide_layers: int = 4) -> RunSpec:
    spec = RunSpec.preset("tiny")
    if name.startswith("wide"):
        spec = spec.replace("model", d_model=512, n_layers=wide_layers, n_heads=8, d_ff=1408)
        rate = 100
    else:
        rate = 32
    spec = spec.replace("train", steps=steps, eval_batches=16)
    spec = spec.replace("compression", activation=CODEC, act_gradient=CODEC, subspace_rate=rate)
    free = -1 if name.endswith("_free") else 2  # tiny32 is node0's rule (2 free), tiny32_free the default
    return spec.replace(
        "pipeline",
        stages=stages,
        micro_batch_size=4,
        in_flight=2,
        subspace=not name.endswith("_plain"),
        free_tail_layers=free,
    )


def run_one(name: str, steps: int, stages: int, wide_layers: int = 4) -> dict[str, Any]:
    spec = spec_for(name, steps, stages, wide_layers)
    t0 = time.perf_counter()
    if name.endswith("_unsplit"):
        from locomm.train import train  # noqa: PLC0415

        r = train(spec)
        return {
            "run": name,
            "kind": "unsplit",
            "d_model": spec.model.d_model,
            "steps": r.steps,
            "final_val_loss": r.val_loss,
            "final_train_loss": r.train_loss,
            "tokens": r.steps * spec.data.batch_size * spec.data.seq_len,
            "uncompressed_bf16_bytes_per_token": 2 * spec.model.d_model,
            "wall_s": time.perf_counter() - t0,
        }
    from locomm.sim.pipeline import PipelineSim, summarize  # noqa: PLC0415

    sim = PipelineSim(spec, 1)
    res = sim.run(steps)
    out = summarize(sim, res, link_bps=80e6, latency_s=0.03, tflops=10.0)
    out.update(
        free_tail_layers=spec.pipeline.free_tail_layers,
        run=name,
        kind="pipeline",
        tokens=steps * res.tokens_per_step,
        wall_s=time.perf_counter() - t0,
    )
    return out


def table(results: list[dict[str, Any]]) -> str:
    by = {r["run"]: r for r in results}
    lines = [
        f"{'run':<14} {'d':>4} {'k':>3} {'steps':>5} {'val loss':>9} {'vs plain':>9} {'vs unsplit':>10} "
        f"{'B/tok/bdry':>11} {'fwd':>7} {'bwd':>7} {'2d bf16':>7}"
    ]
    for r in results:
        fam = r["run"].split("_")[0].rstrip("0123456789")
        plain = (
            by.get(f"{r['run'].removesuffix('_free')}_plain") if not r["run"].endswith(("_plain", "_unsplit")) else None
        )
        unsplit = by.get(f"{fam}_unsplit")

        def rel(o: dict[str, Any] | None) -> str:
            return f"{100 * (r['final_val_loss'] / o['final_val_loss'] - 1):+.2f}%" if o else "-"

        bpt = r.get("bytes_per_token_per_boundary")
        lines.append(
            f"{r['run']:<14} {r['d_model']:>4} {r.get('k', '-') if r.get('subspace', False) else '-':>3} "
            f"{r['steps']:>5} {r['final_val_loss']:>9.4f} {rel(plain):>9} "
            f"{rel(unsplit) if r['kind'] == 'pipeline' else '-':>10} "
            f"{bpt if bpt is None else round(bpt, 2)!s:>11} "
            f"{round(r.get('bytes_per_token_per_boundary_fwd', 0), 2)!s:>7} "
            f"{round(r.get('bytes_per_token_per_boundary_bwd', 0), 2)!s:>7} "
            f"{r['uncompressed_bf16_bytes_per_token']:>7}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = _harness.parser(__doc__, out="pipeline.json")
    ap.add_argument("--runs", nargs="*", default=["tiny32", "tiny32_plain", "tiny_unsplit"])
    ap.add_argument("--steps", type=int, default=311)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--wide-layers", type=int, default=4, help="layers of the d=512 model")
    ap.add_argument("--merge", nargs="*", type=Path, help="Merge per-run JSON files into one table")
    args = ap.parse_args()
    if args.merge:
        results = [r for p in args.merge for r in _harness.read_json(p)["results"]]
        train_json = _harness.results_path("train.json")
        if not any(r["run"] == "tiny_unsplit" for r in results) and train_json.exists():
            # The single-node figure of benchmarks/train.py: `locomm-peer train --preset tiny --steps 311`,
            # the same spec, steps, batches and validation windows as tiny_unsplit here.
            t = _harness.read_json(train_json).get("tiny", {})
            if t.get("steps") == args.steps:
                results.append(
                    {
                        "run": "tiny_unsplit",
                        "kind": "unsplit",
                        "d_model": 256,
                        "steps": t["steps"],
                        "final_val_loss": t["val_loss"],
                        "final_train_loss": t["train_loss"],
                        "uncompressed_bf16_bytes_per_token": 512,
                        "source": "benchmarks/results/train.json",
                    }
                )
        order = ["tiny32", "tiny32_free", "tiny32_plain", "tiny_unsplit", "wide100", "wide100_plain", "wide_unsplit"]
        results.sort(key=lambda r: order.index(r["run"]) if r["run"] in order else 99)
        print(table(results))
        _harness.write_json(args.out, {"results": results, "table": table(results)})
        return
    torch.set_num_threads(args.threads)
    results = []
    for name in args.runs:
        r = run_one(name, args.steps, args.stages, args.wide_layers)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
    print(table(results))
    _harness.write_json(args.out, {"steps": args.steps, "stages": args.stages, "results": results})


if __name__ == "__main__":
    main()
