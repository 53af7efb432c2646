"""The island-on-shaped-links comparison (docs/results/island-links.md): loss against wall-clock, bytes.

Reads ``benchmarks/links.py`` results: run A (``--island 2 --island-rate 1gbit``), run B (plain NoLoCo) and,
optionally runs C (``--island-rate 80mbit``) and D (A with ``outer.scape_sparsity = 0``: a dense island), one
file per seed; writes a summary JSON and the figure (left: A, B, C against wall-clock; right: A, B, D per eval).

    python benchmarks/island_links_plot.py --runs A=benchmarks/results/island-links-A-s*.json \
        --runs B=benchmarks/results/island-links-B-s*.json --runs C=benchmarks/results/island-links-C-s*.json \
        --runs D=benchmarks/results/island-links-D-s*.json \
        --out benchmarks/results/island-links-summary.json --figure docs/figures/island-links.png

Time zero of a run: the first ``eval`` event of round 0 over its peers (every peer evaluates once, then trains).
A point of the validation curve: one round's ``eval`` events, mean time and mean loss over the peers that wrote
one (the island's members write the same loss); the last point is each peer's final eval, after its last
exchange landed. Bytes inside the island: the ``island_step`` events, a step counted as sparse when its
``values`` is below the model's size (the first steps, before a mask exists, are dense); the per-step means skip
the first ``SKIP`` sparse steps, whose counts still hold the representative's dense answers to the steps before
(it counts an answer where its transfer ends, a step later), and ``*_per_step_all`` is every step's bytes over
every step.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from pathlib import Path
from typing import Any

import _harness

SKIP = 2


def mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.fmean(xs) if xs else None


def events(peer: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in peer.get("events", []) + peer.get("other_events", []) if e.get("event") == name]


def curve(result: dict[str, Any]) -> dict[str, Any]:
    """Validation and training loss against seconds since the run's first round-0 eval."""
    peers = result["per_peer"]
    evals = [sorted(events(p, "eval"), key=lambda e: e["time"]) for p in peers]
    t0 = min(e["time"] for ev in evals for e in ev if e.get("round") == 0)
    by_round: dict[int, list[tuple[float, float]]] = {}
    for ev in evals:
        for k, e in enumerate(ev):
            r = e["round"] if k < len(ev) - 1 or e["round"] == 0 else -1  # -1: the final eval
            by_round.setdefault(r, []).append((e["time"] - t0, e["val_loss"]))
    order = sorted(k for k in by_round if k >= 0) + ([-1] if -1 in by_round else [])
    val = [(mean([t for t, _ in by_round[r]]), mean([v for _, v in by_round[r]])) for r in order]
    train = []
    for p in peers:
        for e in events(p, "round"):
            train.append((e["time"] - t0, e["loss"], e["round"]))
    train_by_round: dict[int, list[tuple[float, float]]] = {}
    for t, loss, r in train:
        train_by_round.setdefault(r, []).append((t, loss))
    train_curve = [(mean([t for t, _ in v]), mean([x for _, x in v])) for _, v in sorted(train_by_round.items())]
    finals = [ev[-1] for ev in evals if ev]
    return {
        "t0": t0,
        "val": val,
        "train": train_curve,
        "final_val": mean([e["val_loss"] for e in finals]),
        "final_val_per_peer": [e["val_loss"] for e in finals],
        "train_wall_s": max(e["time"] for e in finals) - t0,
    }


def island_bytes(result: dict[str, Any]) -> dict[str, Any] | None:
    members = [p for p in result["per_peer"] if events(p, "island_step")]
    if not members:
        return None
    rows = []
    for p in members:
        steps = events(p, "island_step")
        dense = steps[0]["dense"]
        size = max(e["values"] for e in steps)
        sparse = [e for e in steps if e["values"] < size]
        steady = sparse[SKIP:]  # the dense answers of the mask-less steps land (and are counted) in the next ones
        rows.append(
            {
                "peer": p["index"],
                "leading": (p["summary"] and (p.get("extra_summary_keys", {}).get("island") or {}).get("leading")),
                "steps": len(steps),
                "dense_steps": len(steps) - len(sparse),
                "sparse_steps": len(sparse),
                "values_per_sparse_step": mean([e["values"] for e in sparse]),
                "model_values": size,
                "sent_per_sparse_step": mean([e["sent"] for e in steady]),
                "received_per_sparse_step": mean([e["received"] for e in steady]),
                "sent_per_step_all": sum(e["sent"] for e in steps) / len(steps),
                "received_per_step_all": sum(e["received"] for e in steps) / len(steps),
                "dense_bytes": dense,
                "island": p.get("extra_summary_keys", {}).get("island"),
            }
        )
    return {
        "members": rows,
        "sent_per_sparse_step": mean([r["sent_per_sparse_step"] for r in rows]),
        "received_per_sparse_step": mean([r["received_per_sparse_step"] for r in rows]),
        "sent_per_step_all": mean([r["sent_per_step_all"] for r in rows]),
        "received_per_step_all": mean([r["received_per_step_all"] for r in rows]),
        "dense_bytes": rows[0]["dense_bytes"],
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    c = curve(result)
    peers = result["per_peer"]
    rounds = result["rounds"]
    sent = [p["summary"].get("bytes_sent") or 0 for p in peers]
    isl = island_bytes(result)
    outer_isl = 0
    if isl:  # the followers' fetches of the settled outer state, on the island's own link
        outer_isl = sum((r["island"] or {}).get("outer_bytes", 0) for r in isl["members"] if not r["leading"])
    island_ix = {r["peer"] for r in isl["members"]} if isl else set()
    step_s = {}  # per peer: the median over its rounds of compute_s / H (an island member's includes its syncs)
    for p in peers:
        xs = [e["compute_s"] / result["inner_steps"] for e in events(p, "round") if e.get("compute_s")]
        step_s[p["index"]] = statistics.median(xs) if xs else None
    inside = [step_s[i] for i in island_ix if step_s.get(i)]
    outside = [v for i, v in step_s.items() if i not in island_ix and v]
    return {
        "step_s": step_s,
        "step_s_island": mean(inside),
        "step_s_single": mean(outside),
        "config": result["config"],
        "island": result.get("island"),
        "rounds": rounds,
        "inner_steps": result["inner_steps"],
        "params": result["params"],
        "wall_s": result["totals"].get("wall_s"),
        "train_wall_s": c["train_wall_s"],
        "final_val": c["final_val"],
        "final_val_per_peer": c["final_val_per_peer"],
        "val_curve": c["val"],
        "train_curve": c["train"],
        "swarm_bytes_sent_per_round": sum(sent) / rounds,
        "per_peer_bytes_sent": sent,
        "island_outer_fetch_bytes_per_round": outer_isl / rounds if isl else None,
        "exchanges_ok": result["totals"].get("exchanges_ok"),
        "exchanges_failed": result["totals"].get("exchanges_failed"),
        "wait_s": [p["summary"].get("wait_s") for p in peers],
        "island_bytes": isl,
        "measured_links": result.get("measured_links"),
        "measured_island": result.get("measured_island"),
        "error": result.get("error"),
        "timed_out": result.get("timed_out"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", action="append", required=True, help="LABEL=GLOB of links.py result files")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--figure", type=Path)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    for spec in args.runs:
        label, pattern = spec.split("=", 1)
        files = sorted(glob.glob(pattern))
        runs = [dict(summarize(json.loads(Path(f).read_text())), file=f) for f in files]
        out[label] = {
            "runs": runs,
            "final_val_mean": mean([r["final_val"] for r in runs]),
            "train_wall_s_mean": mean([r["train_wall_s"] for r in runs]),
            "swarm_bytes_sent_per_round_mean": mean([r["swarm_bytes_sent_per_round"] for r in runs]),
        }
        for r in runs:
            isl = r["island_bytes"]
            print(
                f"{label} {r['file']}: final val {r['final_val']:.4f}, train wall {r['train_wall_s']:.1f} s, "
                f"swarm {r['swarm_bytes_sent_per_round'] / 1e6:.1f} MB/round, step s island {r['step_s_island']} "
                f"single {r['step_s_single']:.3f}"
                + (
                    f", island {isl['sent_per_sparse_step'] / 1e3:.0f} kB sent / "
                    f"{isl['received_per_sparse_step'] / 1e3:.0f} kB received per sparse step "
                    f"(dense {isl['dense_bytes'] / 1e3:.0f} kB)"
                    if isl and isl["sent_per_sparse_step"] is not None
                    else ""
                )
                + (
                    f", island every step: {isl['sent_per_step_all'] / 1e3:.0f} kB sent / "
                    f"{isl['received_per_step_all'] / 1e3:.0f} kB received"
                    if isl
                    else ""
                )
            )
    if args.out:
        _harness.write_json(args.out, out, sort_keys=True)
    if args.figure:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
        colors = {"A": "tab:blue", "B": "tab:orange", "C": "tab:green", "D": "tab:purple"}
        names = {
            "A": "A: island of 2 (1 Gbit/s) + 2 singles, 80 Mbit/s",
            "B": "B: 4 singles (plain NoLoCo), 80 Mbit/s",
            "C": "C: as A, the island's own link 80 Mbit/s too",
            "D": "D: as A, a dense island (scape_sparsity 0)",
        }
        lo, hi = [], []
        for label, d in out.items():
            for k, r in enumerate(d["runs"]):
                t, v = zip(*r["val_curve"])
                kw = {"color": colors.get(label), "alpha": 0.85, "ms": 3, "ls": {"C": "--", "D": ":"}.get(label, "-")}
                name = names.get(label) if k == 0 else None
                if label != "D":  # left: A, B and C
                    ax.plot(t, v, marker="o", label=name, **kw)
                if label != "C":  # right: A, B and D (C's losses per token are A's: only its island link differs)
                    bx.plot(range(len(v)), v, marker="o", label=name if label == "D" else None, **kw)
                lo.append(min(v))
                hi.append(v[1] if len(v) > 1 else v[0])
        if lo:
            for a in (ax, bx):
                a.set_ylim(min(lo) - 0.05, max(hi) + 0.1)  # round 0 (about 5.2 for every run) is off the top
                a.grid(alpha=0.3)
        ax.set_xlabel("wall-clock since the first eval (s)")
        ax.set_ylabel("validation loss (mean over peers)")
        ax.set_title("loss against wall-clock (one line per seed)")
        ax.legend(fontsize=8)
        bx.set_xlabel("eval (round; the last one after the final exchange)")
        bx.set_title("loss against tokens (the same in every run)")
        if "D" in out:
            bx.legend(fontsize=8)
        fig.tight_layout()
        args.figure.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.figure, dpi=120)
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
