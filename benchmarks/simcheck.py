"""Check the simulator's timeline against a real `benchmarks/links.py` run: same peers, links, model, rounds.

The simulator's schedule (``sim/timeline.py``: overlap, apply one round late, the daemon's deadlines)
and network model (``sim/flows.py``: max-min fair sharing of each peer's shaped uplink and downlink)
are given what the real run had: its peers, its per-peer link rates, its partners per round, the
bytes of one push as measured, and each peer's measured compute time per round (``compute_s`` of its
"round" events: the compute is not what is being checked, the network and the schedule are). It then
predicts each peer's round times (the wall-clock between two "round" events, i.e. between two plan
times) and how long each peer waited on the network, and compares them with the real ones.

    python benchmarks/simcheck.py benchmarks/results/links_56m_80mbit_6r.json
    python benchmarks/simcheck.py benchmarks/results/links_56m_*.json --out benchmarks/results/simcheck.json

``--goodput`` scales the link rates by a protocol-efficiency factor (1.0: the shaped rate; the
README's measured TCP goodput through an 80 Mbit/s tbf is 77.5 Mbit/s, 0.969).
``--overhead-from RUN``: charge the daemon's per-round work besides compute and waiting (apply, weight
snapshot, DHT reads), measured on another run as the mean of (round wall - compute_s - wait) over its
rounds 2+, e.g. the unshaped run, where the network plays no part.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from locomm.config import RunSpec
from locomm.protocol.timing import Limits
from locomm.sim.network import NetworkModel, RoundRecord
from locomm.sim.timeline import Schedule

import _harness

LATENCY_S = 0.0005
"""One-way latency on the lab's bridge (veth pairs, no delay configured)."""


def measured_overhead(path: Path) -> float:
    """Mean per-round wall-clock not spent in compute or waiting on the network, rounds 2+ (seconds)."""
    run = json.loads(path.read_text())
    gaps = []
    for p in run["per_peer"]:
        ev = [e for e in p["events"] if e["event"] == "round"]
        for a, b in zip(ev, ev[1:]):
            gaps.append((b["wall_s"] - a["wall_s"]) - b["compute_s"] - (b["wait_s"] - a["wait_s"]))
    return statistics.fmean(gaps)


def check(path: Path, goodput: float, overhead_s: float = 0.0) -> dict[str, Any]:
    run = json.loads(path.read_text())
    peers = run["per_peer"]
    ids = [p["peer_id"] for p in peers]
    n = len(peers)
    rounds = min(len([e for e in p["events"] if e["event"] == "round"]) for p in peers)
    ev = [[e for e in p["events"] if e["event"] == "round"][:rounds] for p in peers]
    unshaped = run["rate"] in (None, "none")
    rate = [float(p.get("up_bps") or 10e9) for p in peers]
    up = tuple(r * goodput for r in rate) if not unshaped else (10e9,) * n
    down = tuple(float(p.get("down_bps") or 10e9) * goodput for p in peers) if not unshaped else (10e9,) * n
    net = NetworkModel(up_bps=up, down_bps=down, speed=(1.0,) * n, latency_s=LATENCY_S, step_s=1.0)
    compute = [[ev[w][r]["compute_s"] for w in range(n)] for r in range(rounds)]
    push = run["totals"]["bytes_per_ok_exchange"]
    raw = 4.0 * run["params"]  # theta in fp32, the codec's raw_bytes (the ETA's size)
    spec = RunSpec.load(_harness.REPO / run["config"]) if (_harness.REPO / run["config"]).exists() else RunSpec()
    overlap = True
    sched = Schedule(
        net,
        n,
        overlap=overlap,
        apply_delay_steps=spec.outer.apply_delay_steps,
        deadlines=Limits.from_network(spec.network),
        round_compute=compute,
        round_overhead_s=overhead_s,
    )
    for r in range(rounds):
        partners = {w: [ids.index(p) for p in ev[w][r]["partners"]] for w in range(n)}
        sched.step(
            RoundRecord(
                steps=run["inner_steps"],
                bytes_sent={w: push for w in range(n)},
                kind="direct",
                peers=partners,
                members=list(range(n)),
                raw_bytes={w: raw for w in range(n)},
            )
        )
    tl = sched.tl
    rows = []
    for w in range(n):
        real_t = [e["wall_s"] for e in ev[w]]
        sim_t = [tl.plans[r][w] for r in range(rounds)]
        real_d = [real_t[0]] + [b - a for a, b in zip(real_t, real_t[1:])]
        sim_d = [sim_t[0]] + [b - a for a, b in zip(sim_t, sim_t[1:])]
        real_wait = [e["wait_s"] for e in ev[w]]
        fin = next(e for e in peers[w]["other_events"] if e["event"] == "finished")
        real_last_wait = fin["wait_s"] - real_wait[-1]  # the last exchange, drained after the last round
        sim_last_wait = tl.ends[-1][w] - tl.plans[-1][w]
        sim_wait = [
            max(0.0, tl.plans[r][w] - (tl.plans[r - 1][w] + compute[r][w])) if r else 0.0 for r in range(rounds)
        ]
        rows.append(
            {
                "peer": w,
                "real_round_s": real_d,
                "sim_round_s": sim_d,
                "round_err": [s / r - 1 for s, r in zip(sim_d, real_d)],
                "real_wait_cum_s": real_wait,
                "sim_wait_s": sim_wait,
                "real_last_exchange_wait_s": real_last_wait,
                "sim_last_exchange_wait_s": sim_last_wait,
                "real_wall_at_last_round_s": real_t[-1],
                "sim_wall_at_last_round_s": sim_t[-1],
                "real_end_s": real_t[-1] + real_last_wait,
                "sim_end_s": tl.ends[-1][w],
            }
        )
    errs = [abs(e) for row in rows for e in row["round_err"][1:]]  # round 1 has no exchange in it
    last = [
        row["sim_last_exchange_wait_s"] / row["real_last_exchange_wait_s"] - 1
        for row in rows
        if row["real_last_exchange_wait_s"] > 1.0
    ]
    end = [row["sim_end_s"] / row["real_end_s"] - 1 for row in rows]
    return {
        "file": str(path.relative_to(_harness.REPO)),
        "rate": run["rate"],
        "peers": n,
        "rounds": rounds,
        "goodput_factor": goodput,
        "round_overhead_s": overhead_s,
        "bytes_per_push": push,
        "latency_s": LATENCY_S,
        "mean_abs_round_err": statistics.fmean(errs) if errs else None,
        "max_abs_round_err": max(errs, default=None),
        "last_exchange_err": last,
        "end_err": end,
        "skipped": tl.skipped,
        "cut": tl.cut,
        "per_peer": rows,
    }


def main() -> None:
    ap = _harness.parser(__doc__, summary=True)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--goodput", type=float, default=1.0)
    ap.add_argument("--overhead-from", type=Path)
    a = ap.parse_args()
    overhead = measured_overhead(a.overhead_from) if a.overhead_from else 0.0
    if a.overhead_from:
        print(f"per-round overhead measured on {a.overhead_from}: {overhead:.2f} s")
    out = []
    for path in a.runs:
        c = check(path.resolve(), a.goodput, overhead)
        out.append(c)
        print(f"{c['file']}: {c['peers']} peers, {c['rounds']} rounds, rate {c['rate']}, goodput x{a.goodput}")
        for row in c["per_peer"]:
            rr = " ".join(f"{r:5.1f}/{s:5.1f}" for r, s in zip(row["real_round_s"], row["sim_round_s"]))
            print(
                f"  peer {row['peer']}: round s real/sim {rr} | last exchange wait real "
                f"{row['real_last_exchange_wait_s']:.1f} sim {row['sim_last_exchange_wait_s']:.1f} | "
                f"end real {row['real_end_s']:.1f} sim {row['sim_end_s']:.1f}"
            )
        le = ", ".join(f"{100 * e:+.0f}%" for e in c["last_exchange_err"])
        en = ", ".join(f"{100 * e:+.1f}%" for e in c["end_err"])
        print(
            f"  per-round time error (rounds 2+): mean {100 * (c['mean_abs_round_err'] or 0):.1f}%, max "
            f"{100 * (c['max_abs_round_err'] or 0):.1f}%; last exchange wait: {le}; end: {en}; "
            f"skipped {c['skipped']}, cut {c['cut']}"
        )
    if a.out:
        _harness.write_json(a.out, out)


if __name__ == "__main__":
    main()
