"""Ending cleanly over consumer links: the 3-peer, 56.8M-parameter NoLoCo run of benchmarks/links.py, shaped
(80 Mbit/s tbf each way) and unshaped, and what the end of the run costs.

    sudo python benchmarks/leaving.py                 # both runs (~10 minutes on 2 cores), then the figures
    sudo python benchmarks/leaving.py --rounds 3 --out benchmarks/results/leaving.json

Each run is one `benchmarks/links.py --config benchmarks/configs/links-56m.toml --rounds R --rate RATE`, its
JSON kept beside the result (``links_56m_<rate>_<R>r_leaving.json``; a run whose JSON exists is not run
again: delete it to measure anew). Figures, per run:

- ``wall_s``: the swarm's wall-clock (links.py: first peer started to last peer exited);
- ``finish_spread_s``: the slowest peer's ``finished`` event minus the fastest's;
- ``exchange_s``: one exchange's time on the shaped link: the bytes a peer sends per round (its pushes to
  every partner; its summary's bytes_sent over its rounds) over the link's rate (upload and download run in
  parallel);
- ``wait_s`` per peer (compute waiting on the network), ``handover_s`` of each peer's ``left`` event (serving
  its last payload to partners that had not had it), ``gave_up`` and ``gone_skipped`` (partner-rounds given up
  at a deadline, or skipped because the partner had left).

The ratio ``wall_s`` shaped / unshaped is the must-show (target 1.25x, aim 1.1x). Its floor: the last round's
exchange cannot overlap any compute, so the shaped run is at least one exchange longer than the unshaped one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import _harness

REPO = _harness.REPO
RESULTS = REPO / "benchmarks" / "results"
CONFIG = REPO / "benchmarks" / "configs" / "links-56m.toml"


def run_links(rate: str, rounds: int, timeout: float) -> dict[str, Any]:
    name = "unshaped" if rate == "none" else rate
    out = RESULTS / f"links_56m_{name}_{rounds}r_leaving.json"
    if not out.exists():
        cmd = [sys.executable, str(REPO / "benchmarks" / "links.py"), "--config", str(CONFIG), "--rounds", str(rounds)]
        cmd += ["--rate", rate, "--timeout", str(timeout), "--out", str(out)]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=False)
    return json.loads(out.read_text())


def figures(run: dict[str, Any], rate_bps: float | None) -> dict[str, Any]:
    peers = run.get("per_peer", [])
    finished = [e["time"] for p in peers for e in p.get("other_events", []) if e.get("event") == "finished"]
    left = [e for p in peers for e in p.get("other_events", []) if e.get("event") == "left"]
    # The "finished" event is the whole summary (links.py's per-peer summary keeps only some keys).
    summaries = [next((e for e in p.get("other_events", []) if e.get("event") == "finished"), {}) for p in peers]
    totals = run.get("totals") or {}
    per_exchange = [s["bytes_sent"] / s["rounds_completed"] for s in summaries if s.get("rounds_completed")]
    sent = max(per_exchange) if per_exchange else None
    return {
        "wall_s": totals.get("wall_s"),
        "finish_spread_s": max(finished) - min(finished) if len(finished) == len(peers) and peers else None,
        "exchange_s": sent * 8 / rate_bps if sent and rate_bps else None,
        "bytes_sent_per_exchange": sent,
        "wait_s": [s.get("wait_s") for s in summaries],
        "handover_s": [e.get("handover_s") for e in left],
        "undelivered_at_leave": [e.get("undelivered") for e in left],
        "gave_up": [s.get("gave_up") for s in summaries],
        "gone_skipped": [s.get("gone_skipped") for s in summaries],
        "exchanges_ok": totals.get("exchanges_ok"),
        "exchanges_failed": totals.get("exchanges_failed"),
        "rounds_completed_min": totals.get("rounds_completed_min"),
        "error": run.get("error"),
        "timed_out": run.get("timed_out"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", default="80mbit")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "leaving.json")
    args = ap.parse_args(argv)
    rate_bps = float(args.rate.removesuffix("mbit")) * 1e6 if args.rate.endswith("mbit") else None
    shaped = figures(run_links(args.rate, args.rounds, args.timeout), rate_bps)
    unshaped = figures(run_links("none", args.rounds, args.timeout), None)
    ratio = shaped["wall_s"] / unshaped["wall_s"] if shaped["wall_s"] and unshaped["wall_s"] else None
    ex = shaped["exchange_s"]
    result = {
        "bench": "leaving",
        "config": str(CONFIG.relative_to(REPO)),
        "rounds": args.rounds,
        "rate": args.rate,
        "shaped": shaped,
        "unshaped": unshaped,
        "wall_ratio": ratio,
        "spread_within_one_exchange": shaped["finish_spread_s"] <= ex if ex and shaped["finish_spread_s"] else None,
        "floor_ratio": (unshaped["wall_s"] + ex) / unshaped["wall_s"] if ex and unshaped["wall_s"] else None,
    }
    _harness.write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
