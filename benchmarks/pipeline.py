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

The k sweep (issue 19 item 5; ``sweep`` and ``table`` subcommands): 2 stages x 1 replica on the stage
workers (``locomm.train.stage.StageWorker``: per-stage clipping, the inner schedule) and the wire's codecs
(``subspace+bf16+lossless``, the subspace stage built with the run's E_f std), one micro-batch in flight, against
the plain pipeline (``plain``: bf16 h) and the unsplit model (``unsplit``: ``locomm.train``) on the same tokens.
One JSON per run under ``benchmarks/results/pipeline_k/``, skipped when on disk, written atomically. A form
names the run fully, from the old defaults (E_f std 0.02, no branch norm): ``project`` / ``reparam``
(``pipeline.subspace_form``), ``_std<x>`` (``pipeline.fixed_embed_std``), ``_bn`` (``pipeline.branch_norm``),
``init`` (the diagnosis: E_f and an init in span(U), then unconstrained with h whole on the wire), ``plain_bn``.
Sized for this 2-core CPU: 2 layers (one per stage), 200 steps of 8 x 128 tokens, about 35 s a run at d=256.
What was run (the rest of the cross product was not; docs/results/pipeline.md lists it):

    python benchmarks/pipeline.py sweep --k 128 --seeds 0 --forms plain unsplit project reparam init \
        project_std1 project_bn reparam_std1_bn init_std0.002 reparam_std0.005 reparam_std0.002
    python benchmarks/pipeline.py sweep --k 128 --seeds 1 --forms plain unsplit project reparam init reparam_std0.005
    python benchmarks/pipeline.py sweep --k 8 16 32 64 128 --seeds 0 1 \
        --forms plain_bn reparam_std1_bn project project_std1_bn
    python benchmarks/pipeline.py sweep --k 8 128 --seeds 0 --forms init_std1_bn
    python benchmarks/pipeline.py sweep --k 8 --seeds 1 --forms init_std1_bn
    python benchmarks/pipeline.py sweep --d 512 --k 16 64 --seeds 0 --forms plain unsplit reparam_std1_bn project
    python benchmarks/pipeline.py sweep --d 512 --k 16 --seeds 0 --forms init_std1_bn
    python benchmarks/pipeline.py sweep --d 512 --k 16 64 --seeds 0 --forms project_std1_bn
    python benchmarks/pipeline.py table
"""

from __future__ import annotations

import json
import math
import sys
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


# ------------------------------------------------------------------ the k sweep (issue 19, item 5)

K_DIR = _harness.results_path("pipeline_k")
FORM_HELP = (
    "plain or plain_bn (no subspace), unsplit (locomm.train; unsplit_untied with the stages' untied head), "
    "or project / reparam (pipeline.subspace_form) / "
    "init (E_f and an init in span(U), then unconstrained with h whole on the wire: the diagnosis), each optionally "
    "followed by "
    "_std<x> (pipeline.fixed_embed_std) and _bn (pipeline.branch_norm), e.g. reparam_std0.005_bn"
)


def parse_form(form: str) -> tuple[bool, dict[str, Any]]:
    """(subspace, pipeline options) of a form name (``FORM_HELP``)."""
    base, *mods = form.split("_")
    if base == "unsplit" and mods in ([], ["untied"]):  # untied: the stages' own head on the unsplit model
        return False, {}
    if base == "plain":  # the uncompressed pipeline, in the same block form when _bn
        if mods not in ([], ["bn"]):
            raise ValueError(f"unknown form {form!r}: {FORM_HELP}")
        return False, {"branch_norm": True} if mods else {}
    if base not in ("project", "reparam", "init"):
        raise ValueError(f"unknown form {form!r}: {FORM_HELP}")
    # Named from the old defaults (E_f std 0.02, no branch norm), so a name means the same run whatever the defaults.
    opts: dict[str, Any] = {
        "subspace_form": "project" if base == "init" else base,
        "fixed_embed_std": 0.02,
        "branch_norm": False,
    }
    for m in mods:
        if m == "bn":
            opts["branch_norm"] = True
        elif m.startswith("std"):
            opts["fixed_embed_std"] = float(m[3:])
        else:
            raise ValueError(f"unknown form {form!r}: {FORM_HELP}")
    return True, opts


def k_spec(d: int, k: int, form: str, seed: int, steps: int, layers: int, seq: int) -> RunSpec:
    spec = RunSpec.preset("tiny")
    if d != 256:
        spec = spec.replace("model", d_model=d, n_heads=d // 64, d_ff=int(d * 2.75) // 64 * 64)
    spec = spec.replace("model", n_layers=layers, max_seq_len=max(seq, 256))
    spec = spec.replace("data", seq_len=seq, batch_size=8)
    spec = spec.replace("train", steps=steps, eval_batches=8, eval_interval=0, seed=seed)
    spec = spec.replace("compression", activation=CODEC, act_gradient=CODEC, subspace_rate=max(1, d // max(k, 1)))
    if form == "unsplit_untied":
        spec = spec.replace("model", tie_embeddings=False)
    subspace, opts = parse_form(form)
    return spec.replace("pipeline", stages=2, micro_batch_size=4, in_flight=1, subspace=subspace, **opts)


def boundary_codecs(spec: RunSpec, geo: Any) -> tuple[Any, Any]:
    """The activation and gradient stacks of the boundary (the subspace stage takes the geometry's E_f std)."""
    from locomm.compression.choice import TensorRole, codec_choice  # noqa: PLC0415

    act, grad = (
        codec_choice(r, spec.compression, boundary=geo).build()
        for r in (TensorRole.ACTIVATION, TensorRole.ACT_GRADIENT)
    )
    return act, grad


def train_k(spec: RunSpec, form: str) -> dict[str, Any]:
    """Two stages x one replica on the stage workers and the wire's codecs (one micro-batch in flight)."""
    import dataclasses  # noqa: PLC0415

    from locomm.data import BatchSampler, eval_batches, load_corpus  # noqa: PLC0415
    from locomm.model.stages import Geometry, StageModule, build_stages  # noqa: PLC0415
    from locomm.train.stage import StageWorker  # noqa: PLC0415

    geo = Geometry.of(spec)
    mods = build_stages(spec, geo)
    wire = geo
    if form.startswith("init"):  # in E_f + span(U) at init, then unconstrained, with the whole h on the wire
        for m in mods:
            m.project_ = lambda: []  # type: ignore[method-assign]
        wire = dataclasses.replace(geo, subspace=False)
    act, grad = boundary_codecs(spec, wire)
    w = [StageWorker(spec, s, geo=geo, module=m) for s, m in enumerate(mods)]
    splits = load_corpus(spec.data)
    sampler = BatchSampler(splits, spec.data, seed=spec.train.seed)
    val = eval_batches(splits.val, spec.data, spec.train.eval_batches)
    mbs, nbytes, ntok, off = spec.pipeline.micro_batch_size, [0, 0], 0, 0.0

    def cross(h: torch.Tensor, x: torch.Tensor, codec: Any, i: int) -> torch.Tensor:
        data = codec.encode(h.detach().float().contiguous(), tokens=x)
        nbytes[i] += len(data) + (2 * (x.numel() + x.shape[0]) if i == 0 else 0)  # + the uint16 token window
        return codec.decode(data, tokens=x, max_numel=x.numel() * geo.d)

    curve = []
    for step in range(spec.train.steps):
        xb, yb = sampler.next()
        losses = []
        for m in range(0, xb.shape[0], mbs):
            x, y = xb[m : m + mbs], yb[m : m + mbs]
            h = w[0].forward(m, x)
            if geo.subspace and not form.startswith("init"):
                off = max(off, mods[0].residual_norm(h, x))
            loss, g = w[1].forward_backward(x, y, cross(h, x, act, 0))
            w[0].backward(m, cross(g, x, grad, 1))
            ntok += x.numel()
            losses.append(loss)
        for wk in w:
            wk.maybe_step()
        curve.append(sum(losses) / len(losses))
        if not math.isfinite(curve[-1]):
            raise FloatingPointError(f"loss {curve[-1]} at step {step}")
    train_bytes = list(nbytes)  # evaluation crosses the wire too; only training is counted
    with torch.no_grad():
        for m in mods:
            m.eval()
        vl = [float(StageModule.loss(mods[1](x, cross(mods[0](x), x, act, 0)), y)) for x, y in val]
    return {
        "final_val_loss": sum(vl) / len(vl),
        "final_train_loss": sum(curve[-10:]) / len(curve[-10:]),
        "train_curve": curve[:: max(1, len(curve) // 50)],
        "bytes_per_token_per_boundary_fwd": train_bytes[0] / ntok,
        "bytes_per_token_per_boundary_bwd": train_bytes[1] / ntok,
        "bytes_per_token_per_boundary": sum(train_bytes) / ntok,
        "max_off_span": off,
    }


def k_run(d: int, k: int, form: str, seed: int, steps: int, layers: int, seq: int) -> Path:
    """One run of the sweep, written atomically to ``pipeline_k/``; skipped when its file exists."""
    name = f"d{d}_L{layers}_s{steps}_T{seq}_seed{seed}_{form}" + (f"_k{k}" if parse_form(form)[0] else "")
    path = K_DIR / f"{name}.json"
    if _harness.done(path):
        return path
    spec = k_spec(d, k, form, seed, steps, layers, seq)
    t0 = time.perf_counter()
    if form.startswith("unsplit"):
        from locomm.train import train  # noqa: PLC0415

        r = train(spec)
        out: dict[str, Any] = {"final_val_loss": r.val_loss, "final_train_loss": r.train_loss}
    else:
        out = train_k(spec, form)
    out.update(
        run=name,
        form=form,
        d_model=d,
        k=k if parse_form(form)[0] else None,
        seed=seed,
        steps=steps,
        layers=layers,
        seq_len=seq,
        tokens=steps * spec.data.batch_size * seq,
        wall_s=time.perf_counter() - t0,
    )
    _harness.write_json(path, out)
    print(json.dumps({k_: v for k_, v in out.items() if k_ != "train_curve"}), flush=True)
    return path


def k_table(rows: list[dict[str, Any]], within: float = 0.03) -> str:
    """Markdown per setting: mean val loss over seeds by form and k, against the plain pipeline, the smallest k
    within ``within`` of it and that k's wire bytes."""
    groups: dict[tuple[Any, ...], dict[Any, list[dict[str, Any]]]] = {}
    for r in rows:
        key = (r["d_model"], r["layers"], r["steps"], r["seq_len"], r["form"])
        groups.setdefault(key, {}).setdefault(r["k"], []).append(r)
    base_forms = ("plain", "plain_bn", "unsplit", "unsplit_untied")
    out = []
    for setting in sorted({g[:4] for g in groups}):

        def cell(form: str, k: Any = None, field: str = "final_val_loss", s: tuple = setting) -> tuple[float, int]:
            rs = groups.get((*s, form), {}).get(k, [])
            return (sum(r[field] for r in rs) / len(rs) if rs else math.nan), len(rs)

        d, layers, steps, seq = setting
        out.append(f"\nd = {d}, {layers} layers (2 stages), {steps} steps of 8 x {seq} tokens\n")
        for f in base_forms:
            v, n = cell(f)
            extra = ""
            if not f.startswith("unsplit") and n:
                extra = f", {cell(f, None, 'bytes_per_token_per_boundary')[0]:.1f} B/token/boundary fwd + bwd"
            out.append(f"- {f}: {v:.4f} (seeds: {n}){extra}" if n else f"- {f}: not run")
        ks = sorted({k for g, by in groups.items() if g[:4] == setting for k in by if k is not None})
        forms = sorted({g[4] for g in groups if g[:4] == setting and g[4] not in base_forms})
        out.append("\n| form | vs | " + " | ".join(f"k={k}" for k in ks) + " | smallest k within 3% | its B/tok/bdry |")
        out.append("|---|---|" + "---|" * (len(ks) + 2))
        for f in forms:
            ref_form = "plain"
            ref, _ = cell(ref_form)
            cells, best = [], None
            for k in ks:
                v, n = cell(f, k)
                if not n:
                    cells.append("-")
                    continue
                rel = f" ({100 * (v / ref - 1):+.1f}%)" if math.isfinite(ref) else ""
                cells.append(f"{v:.4f}{rel}" + (f" n={n}" if n > 1 else ""))
                if math.isfinite(ref) and best is None and v <= ref * (1 + within):
                    best = k
            bpt = cell(f, best, "bytes_per_token_per_boundary")[0] if best is not None else math.nan
            out.append(
                f"| {f} | {ref_form} | " + " | ".join(cells) + f" | {best if best is not None else 'none'} | "
                f"{f'{bpt:.1f}' if math.isfinite(bpt) else '-'}{' (h whole)' if f.startswith('init') else ''} |"
            )
    return "\n".join(out)


def control_table(rows: list[dict[str, Any]], form: str = "project_std1_bn", control: str = "init_std1_bn") -> str:
    """Markdown per setting and k where both ran: ``form`` against the same form unconstrained (``control``, h
    whole on the wire), paired by seed, beside the plain pipeline and the untied unsplit model."""
    by: dict[tuple[Any, ...], dict[int, float]] = {}
    for r in rows:
        key = (r["d_model"], r["layers"], r["steps"], r["seq_len"], r["form"], r["k"])
        by.setdefault(key, {})[r["seed"]] = r["final_val_loss"]

    def mean(xs: list[float]) -> str:
        m = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else math.nan
        return f"{m:.4f}" + (f" +- {sd:.4f}" if math.isfinite(sd) else "")

    out = ["| setting | k | n | subspace | same form, unconstrained | per seed | plain | unsplit (untied) |"]
    out.append("|---|---|---|---|---|---|---|---|")
    for key in sorted(k for k in by if k[4] == form):
        ctl = by.get((*key[:4], control, key[5]), {})
        seeds = sorted(set(by[key]) & set(ctl))
        if not seeds:
            continue
        per = ", ".join(f"{100 * (by[key][s] / ctl[s] - 1):+.1f}%" for s in seeds)
        base = [by.get((*key[:4], f, None), {}) for f in ("plain", "unsplit_untied")]
        cells = [mean([b[s] for s in seeds if s in b]) if any(s in b for s in seeds) else "-" for b in base]
        d, layers, steps, seq = key[:4]
        out.append(
            f"| d {d}, {layers} layers, {steps} x 8 x {seq} | {key[5]} | {len(seeds)} | "
            f"{mean([by[key][s] for s in seeds])} | {mean([ctl[s] for s in seeds])} | {per} | {cells[0]} | {cells[1]} |"
        )
    return "\n".join(out)


def k_main(argv: list[str]) -> None:
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(description="The k sweep: one JSON per run under benchmarks/results/pipeline_k/")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep", help="run what is not on disk yet, in order")
    sw.add_argument("--d", type=int, nargs="+", default=[256])
    sw.add_argument("--k", type=int, nargs="+", default=[8, 16, 32, 64])
    sw.add_argument("--forms", nargs="+", default=["project", "reparam"], help=FORM_HELP)
    sw.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    sw.add_argument("--steps", type=int, default=200)
    sw.add_argument("--layers", type=int, default=2)
    sw.add_argument("--seq", type=int, default=128)
    sw.add_argument("--threads", type=int, default=1)
    sub.add_parser("table", help="print the markdown table of what is on disk")
    args = ap.parse_args(argv)
    if args.cmd == "table":
        rows = [_harness.read_json(p) for p in sorted(K_DIR.glob("*.json"))]
        print(k_table(rows))
        print("\nThe subspace against the same form unconstrained (seeds where both ran):\n")
        print(control_table(rows))
        return
    torch.set_num_threads(args.threads)
    for seed in args.seeds:
        for d in args.d:
            for form in args.forms:
                for k in args.k if parse_form(form)[0] else [None]:
                    k_run(d, k or 0, form, seed, args.steps, args.layers, args.seq)


def main() -> None:
    if sys.argv[1:2] in (["sweep"], ["table"]):
        k_main(sys.argv[1:])
        return
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
