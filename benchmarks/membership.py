"""How often do two peers derive different groups? A 6-peer loopback swarm with churn.

Every peer logs, per round, the members it derived (``member_ids`` in its "round" events).
Groups are a seeded function of the member list, so two peers disagree on a round's groups
exactly when they logged different member lists for it. The run: 6 real `locomm-peer join`
processes (nano preset) on loopback; after ``--kill-at`` rounds one peer is SIGKILLed and a
new one joins; the swarm runs to ``--rounds``. Prints JSON (also to ``--out``):

    python benchmarks/membership.py --rounds 30 --inner-steps 100 --kill-at 8 --join-at 15 \
        --out benchmarks/results/membership.json

Rounds here last seconds, so the heartbeat TTL is scaled down with them (a real run: 5 s heartbeats,
a 30 s TTL, rounds of a minute or more); with a TTL longer than a round, expiry instead of the round
counter decides when a dead peer leaves, and peers that read at different times disagree.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from locomm.config import RunSpec
from locomm.testing.launcher import Launcher

import _harness


def main() -> None:
    ap = _harness.parser(__doc__)
    ap.add_argument("--peers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=12)
    ap.add_argument("--join-at", type=int, default=20)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--heartbeat-interval", type=float, default=1.0)
    ap.add_argument(
        "--heartbeat-ttl",
        type=float,
        default=3.0,
        help="Keep it below a round's duration, as in a real run (5 s heartbeats, 30 s TTL, minute rounds)",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="locomm-membership-"))
    spec = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=1.0, batch_size=8, seq_len=64)
        .replace("outer", algo="noloco", inner_steps=args.inner_steps)
        .replace("train", steps=args.rounds * args.inner_steps, eval_batches=2, eval_interval=0)
        .replace(
            "network",
            heartbeat_interval_s=args.heartbeat_interval,
            heartbeat_ttl_s=args.heartbeat_ttl,
            stall_timeout_s=5.0,
        )
    )
    cfg = tmp / "run.toml"
    spec.save(cfg)
    # Stopped at the end as before: SIGKILL to each peer's group at once (no grace).
    peers = Launcher(tmp, grace_s=0.0, stop_signal=signal.SIGKILL)

    def launch(name: str, initial: str | None, wait: int) -> None:
        until = ("-q", "--until-round", str(args.rounds), "--wait-for-peers", str(wait))
        peers.start(name, *until, config=cfg, initial_peers=initial)

    t0 = time.time()
    with peers:
        launch("p0", None, args.peers)
        boot = peers["p0"].address(timeout=float("inf"))
        for i in range(1, args.peers):
            launch(f"p{i}", boot, args.peers)
        killed = joined = False
        while peers.running():
            r = peers["p0"].round()
            if not killed and r >= args.kill_at:
                peers[f"p{args.peers - 1}"].kill(group=True)
                killed = True
            if killed and not joined and r >= args.join_at:
                launch("joiner", boot, 0)
                joined = True
            if time.time() - t0 > 900:
                break
            time.sleep(0.5)
    by_round: dict[int, list[tuple[str, tuple[str, ...]]]] = defaultdict(list)
    for p in peers:
        for e in p.events("round"):
            if "member_ids" in e:
                # The event is written after the round counter moved on: it describes round - 1.
                by_round[e["round"] - 1].append((p.name, tuple(e["member_ids"])))
    disagree = [r for r, views in by_round.items() if len({v for _, v in views}) > 1]
    result = {
        "command": " ".join(sys.argv),
        "inner_steps": args.inner_steps,
        "heartbeat_interval_s": args.heartbeat_interval,
        "heartbeat_ttl_s": args.heartbeat_ttl,
        "peers": args.peers,
        "rounds": args.rounds,
        "kill_at": args.kill_at,
        "join_at": args.join_at,
        "rounds_observed": len(by_round),
        "rounds_with_disagreement": len(disagree),
        "disagreement_rate": len(disagree) / max(1, len(by_round)),
        "disagreeing_rounds": sorted(disagree),
        "wall_s": time.time() - t0,
        "finished": {p.name: next(iter(p.events("finished")), {}).get("exchanges_failed") for p in peers},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        _harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
