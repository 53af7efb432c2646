"""A shaped links.py run against its floor, from the JSON of the same setup shaped and unshaped.

    python benchmarks/links_floor.py --shaped benchmarks/results/links-56m-short-80mbit-r1.json \
        --unshaped benchmarks/results/links-56m-short-none-r1.json [--out result.json]

The floor of a shaped run (docs/results/links.md): the unshaped run's wall-clock; plus, for every round but
the last, what of one exchange at the link's rate the next round's unshaped time cannot hide (the overlap hides
an exchange behind the next round's compute); plus the last exchange, which overlaps nothing. One exchange is
the shaped run's own measured payload (``bytes_per_ok_exchange``) to each partner, upload and download in
parallel, at the tbf rate: ``partners * payload * 8 / rate``. A round's unshaped time is the slowest peer's
(the round events' ``wall_s`` differences). Also: each peer's finish (its last round event) against the
fastest one's, the longest compute wait on the network in one round, and what the exchanges did (pulls, cuts,
give-ups). Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def rounds_of(run: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Each peer's round events, in order."""
    return [
        sorted((e for e in p["events"] if e.get("event") == "round"), key=lambda e: e["round"]) for p in run["per_peer"]
    ]


def round_times(run: dict[str, Any]) -> list[float]:
    """The slowest peer's time for each round (round 1 from its training start)."""
    per_peer = rounds_of(run)
    n = min(len(r) for r in per_peer)
    out = []
    for k in range(n):
        out.append(max(r[k]["wall_s"] - (r[k - 1]["wall_s"] if k else 0.0) for r in per_peer))
    return out


def push_spans(run: dict[str, Any]) -> list[float] | None:
    """Per round, the peers' mean time from their first push's start to their last push's answer (the ``push``
    events; None for runs from before they were logged)."""
    spans: dict[int, list[float]] = {}
    for p in run["per_peer"]:
        by_round: dict[int, list[dict[str, Any]]] = {}
        for e in p.get("other_events", []):
            if e.get("event") == "push":
                by_round.setdefault(e["round"], []).append(e)
        for r, es in by_round.items():
            spans.setdefault(r, []).append(max(e["time"] for e in es) - min(e["started_at"] for e in es))
    return [sum(v) / len(v) for _, v in sorted(spans.items())] or None


def startup_s(run: dict[str, Any]) -> float:
    """From the benchmark's start to the last peer's first evaluation, the moment training starts (spawning the
    peers, building the model, joining: the same work shaped or not, and on 2 cores its noisiest part)."""
    evals = [
        min((e["time"] for e in p.get("other_events", []) + p["events"] if e.get("event") == "eval"), default=None)
        for p in run["per_peer"]
    ]
    return max(t for t in evals if t is not None) - run["started_at"]


def floor(shaped: dict[str, Any], unshaped: dict[str, Any]) -> dict[str, Any]:
    tot = shaped["totals"]
    rate = float(shaped["per_peer"][0]["rate_bps"])
    partners = max(len(e.get("partners") or []) for r in rounds_of(shaped) for e in r)
    exchange_s = partners * tot["bytes_per_ok_exchange"] * 8 / rate
    u = round_times(unshaped)
    hidden_short = [max(0.0, exchange_s - u[k + 1]) for k in range(len(u) - 1)]
    f = unshaped["totals"]["wall_s"] + sum(hidden_short) + exchange_s
    ends = [r[-1]["time"] for r in rounds_of(shaped)]
    # wait_s in a round event is the peer's total so far: a round's own wait is the difference
    waits = [b.get("wait_s", 0.0) - a.get("wait_s", 0.0) for r in rounds_of(shaped) for a, b in zip([{}, *r], r)]
    sums = tot.get("other_sums", {})
    return {
        "shaped": shaped.get("_path"),
        "unshaped": unshaped.get("_path"),
        "exchange_s": exchange_s,
        "unshaped_round_s": u,
        "unhidden_s": hidden_short,
        "unshaped_wall_s": unshaped["totals"]["wall_s"],
        "floor_s": f,
        "shaped_wall_s": tot["wall_s"],
        "ratio": tot["wall_s"] / f,
        "training_ratio": (tot["wall_s"] - startup_s(shaped)) / (f - startup_s(unshaped)),
        "shaped_round_s": round_times(shaped),
        "shaped_push_s": push_spans(shaped),
        "unshaped_push_s": push_spans(unshaped),
        "shaped_startup_s": startup_s(shaped),
        "unshaped_startup_s": startup_s(unshaped),
        "finish_spread_s": max(ends) - min(ends),
        "finish_within_one_exchange": max(ends) - min(ends) <= exchange_s,
        "longest_round_wait_s": max(waits, default=0.0),
        "exchanges_ok": tot["exchanges_ok"],
        "exchanges_failed": tot["exchanges_failed"],
        "pulls": sums.get("pulls"),
        "transfers_cut": sums.get("transfers_cut"),
        "gave_up": sums.get("gave_up"),
        "pushes_failed": sums.get("pushes_failed"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shaped", type=Path, required=True)
    ap.add_argument("--unshaped", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    runs = []
    for p in (args.shaped, args.unshaped):
        run = json.loads(p.read_text())
        run["_path"] = str(p)
        runs.append(run)
    res = floor(*runs)
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
