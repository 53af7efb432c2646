"""Poisoning in a real swarm: 6 `locomm-peer join` processes on loopback, one of them sending poisoned updates.

The simulator's table (benchmarks/poisoning.py) checks the rule; this checks the daemon: the same 6 peers
(nano, shards i/6, started together, ``--until-round R``) run once clean and once per attack, with peer
``p5`` started with the hidden ``--attack KIND`` (``protocol/attacks.py``). Reported per run:

- the honest peers' (p0..p4) mean final validation loss, against the clean run's (goal: within 2%);
- the attacker's exchanges: every applied round of an honest peer whose planned partners included the
  attacker and where the attacker's update was screened (it arrived), or where the attacker was already
  banned and so skipped. ``blocked`` counts those rejected, clipped or skipped for a ban (goal: >= 95%);
- on the clean run, honest updates rejected or clipped (goal: 0).

    python benchmarks/poisoning_swarm.py                          # noloco: clean, scale100, target (~6 min)
    python benchmarks/poisoning_swarm.py --algo sparseloco --attacks scale100,noise
    python benchmarks/poisoning_swarm.py --resume                 # keep the runs already in the JSON
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from locomm.config import RunSpec
from locomm.testing.launcher import Launcher

import _harness

PEERS = 6
ATTACKER = PEERS - 1


def spec_for(algo: str, rounds: int, inner_steps: int) -> RunSpec:
    return (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=2.0, batch_size=8, seq_len=64)
        .replace("outer", algo=algo, inner_steps=inner_steps)
        .replace("train", steps=rounds * inner_steps, eval_batches=4, eval_interval=0)
        .replace("network", heartbeat_interval_s=1.0, heartbeat_ttl_s=6.0, request_timeout_s=10.0)
    )


def run_swarm(spec: RunSpec, attack: str | None, rounds: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="locomm-poison-") as tmp:
        folder = Path(tmp)
        cfg = folder / "run.toml"
        spec.save(cfg)
        t0 = time.time()
        with Launcher(folder, threads=1, grace_s=10.0) as peers:
            common = ["--until-round", str(rounds), "--wait-for-peers", str(PEERS)]
            first = peers.start("p0", *common, "--shard", f"0/{PEERS}", config=cfg)
            boot = first.address()
            for i in range(1, PEERS):
                extra = ["--attack", attack] if attack is not None and i == ATTACKER else []
                peers.start(f"p{i}", *common, "--shard", f"{i}/{PEERS}", *extra, config=cfg, initial_peers=boot)
            codes = {p.name: p.wait(timeout_s) for p in peers}
            ids = {p.name: p.events("started")[0]["peer"] for p in peers}
            finished = {p.name: (p.events("finished") or [{}])[0] for p in peers}
            rounds_ev = {p.name: p.events("round") for p in peers}
            screened = {p.name: p.events("screened") for p in peers}
            bans = {p.name: p.events("banned") for p in peers}
        wall = time.time() - t0
    honest = [f"p{i}" for i in range(PEERS) if attack is None or i != ATTACKER]
    attacker = ids[f"p{ATTACKER}"] if attack is not None else None
    tally = {"exchanges": 0, "rejected": 0, "clipped": 0, "banned_skip": 0, "accepted": 0}
    honest_hits = {"rejected": 0, "clipped": 0}
    for name in honest:
        partners = {e["round"] - 1: set(e.get("partners", ())) for e in rounds_ev[name]}  # "round" is after +1
        # when this peer had the attacker banned: bans end (10 min, doubling), so a ban is an interval
        banned = [(b["time"], b["time"] + b["for_s"]) for b in bans[name] if b.get("banned_peer") == attacker]
        for ev in screened[name]:
            r = ev["round"]
            rejected, clipped = set(ev["rejected"]), set(ev["clipped"])
            honest_hits["rejected"] += len(rejected - {attacker})
            honest_hits["clipped"] += len(clipped - {attacker})
            if attacker is None or attacker not in partners.get(r, ()):
                continue
            if attacker in ev["senders"]:
                tally["exchanges"] += 1
                if attacker in rejected:
                    tally["rejected"] += 1
                elif attacker in clipped:
                    tally["clipped"] += 1
                else:
                    tally["accepted"] += 1
            elif any(t0 <= ev["time"] < t1 for t0, t1 in banned):
                tally["exchanges"] += 1
                tally["banned_skip"] += 1
    losses = {n: finished[n].get("final_loss") for n in honest}
    good = [v for v in losses.values() if isinstance(v, float)]
    blocked = tally["rejected"] + tally["clipped"] + tally["banned_skip"]
    return {
        "attack": attack,
        "exit_codes": codes,
        "wall_s": wall,
        "honest_final_loss": losses,
        "honest_mean_final_loss": sum(good) / len(good) if good else None,
        "attacker_exchanges": tally,
        "blocked_fraction": blocked / tally["exchanges"] if tally["exchanges"] else None,
        "honest_rejected": honest_hits["rejected"],
        "honest_clipped": honest_hits["clipped"],
        "banned_by": sorted(n for n in honest if any(b.get("banned_peer") == attacker for b in bans[n])),
    }


def main() -> None:
    ap = _harness.parser(__doc__, out="poisoning_swarm.json", resume=True)
    ap.add_argument("--algo", default="noloco", choices=["noloco", "gasloc", "sparseloco"])
    ap.add_argument("--attacks", default="scale100,target")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    spec = spec_for(args.algo, args.rounds, args.inner_steps)
    done = _harness.Entries(args.out, resume=args.resume)
    for attack in [None, *[a for a in args.attacks.split(",") if a]]:
        name = f"{args.algo}/{attack or 'clean'}"
        if name in done:
            continue
        print(f"{name}: running", flush=True)
        res = run_swarm(spec, attack, args.rounds, args.timeout)
        clean = done[f"{args.algo}/clean"] if attack and f"{args.algo}/clean" in done else None
        if clean and clean.get("honest_mean_final_loss") and res["honest_mean_final_loss"]:
            res["vs_clean"] = res["honest_mean_final_loss"] / clean["honest_mean_final_loss"] - 1
        done.add(name, res)
        print(f"{name}: {res}", flush=True)


if __name__ == "__main__":
    main()
