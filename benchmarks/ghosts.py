"""Ghost identities against a live swarm: signed heartbeats with no p2pd behind them (issue 32).

Three real ``locomm-peer join`` peers (nano, NoLoCo, loopback) train ``--rounds`` rounds, twice: clean, and while
one DHT node (a P2P and a DHT client, bootstrapped through peer 0) publishes signed heartbeats for ``--ghosts``
identities it holds the keys of and runs no p2pd for. The ghosts lie the way issue 32 measured: join round 0
(backdated past the admission cap), the honest peers' current round, a pace that promises a payload soon and
never sends one (``round_s`` 1 s, ``up_Bps`` 1 GB/s, a round that began now); ``--far`` of them claim round
10^9 instead. When the honest peers reach round ``--join-at``, a fourth peer joins (``--config``, through peer
0): its donors and its first round show whether ghosts served it or set its round.

Reported per run: each honest peer's rounds, exchanges, network wait and wall-clock; the most members any peer
counted in a round (``member_ids`` in its round events) and whether a ghost was ever among them; the joiner's
``synced`` / ``sync_failed`` event and first round.

    python benchmarks/ghosts.py --out benchmarks/results/ghosts.json          # 24 ghosts, 3 far, 40 rounds
    python benchmarks/ghosts.py --quick                                        # 8 ghosts, 30 rounds

Before membership by observation (issue 32): all 24 ghosts admitted in the round they appeared, honest rounds
from 0.32 s to 20.3 s (``max_wait_s``), a joiner's 5 donors all ghosts (``sync_failed``), and 3 ghosts of 7
claiming round 10^9 sent a joiner to round 1,000,000,002.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from locomm import __version__
from locomm.config import RunSpec
from locomm.testing.launcher import Launcher, PeerProcess

import _harness

PEERS = 3
FAR_ROUND = 10**9


def spec_file(folder: Path) -> tuple[Path, RunSpec]:
    spec = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=1.0, batch_size=8, seq_len=64)
        .replace("outer", algo="noloco", inner_steps=50)  # rounds of ~1 s: the joiner meets a swarm still running
        .replace("train", steps=100_000, eval_batches=2, eval_interval=0)
        .replace("network", heartbeat_interval_s=1.0, heartbeat_ttl_s=10.0)
    )
    path = folder / "run.toml"
    spec.save(path)
    return path, spec


def poisoned_state(spec: RunSpec, poison: str) -> dict[str, Any]:
    """A state in the layout a joiner of ``spec`` expects (``state_tensors`` of a fresh model and its outer
    algorithm), poisoned: ``init`` is a fresh model's weights (a joiner given it trains from scratch, as the
    ghosts' joiner did before); ``noise`` adds noise of each tensor's own scale to them."""
    import torch  # noqa: PLC0415

    from locomm.peer.transport.state_sync import state_tensors  # noqa: PLC0415
    from locomm.protocol import build_outer  # noqa: PLC0415
    from locomm.train import Trainer  # noqa: PLC0415

    trainer = Trainer(spec, device="cpu", worker_id=0, num_workers=1, stream=12345)
    params = dict(trainer.model.named_parameters())
    tensors = state_tensors(params, build_outer(spec.outer, params, "sybil"))
    g = torch.Generator().manual_seed(7)
    out = {}
    for k, v in tensors.items():
        v = v.detach().to(torch.float32).clone().contiguous()
        if poison == "noise" and v.numel() > 1:
            v += 3.0 * (v.std() + 1e-3) * torch.randn(v.shape, generator=g)
        out[k] = v
    return out


async def haunt(
    boot: str,
    run_id: str,
    ttl: float,
    n: int,
    far: int,
    folder: Path,
    round_of: Any,
    stop: asyncio.Event,
    *,
    live: RunSpec | None = None,
    poison: str = "init",
) -> dict[str, Any]:
    """Keep ``n`` identities' heartbeats stored until ``stop``: one DHT node signing each with that identity's
    key. Ghosts (``live`` None) have nobody behind them. Live ones (``live``: the run's spec) each run a p2pd
    of their own with that identity, answer hellos (so every peer sees them alive and counts them), serve a
    poisoned state to state downloads at the round they claim, put their p2pd's addresses in their heartbeat,
    and run no gossip service: a push to them fails, and nothing ever comes from them."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    from hivemind.dht import DHTNode  # noqa: PLC0415
    from hivemind.p2p import P2P  # noqa: PLC0415
    from hivemind.utils import get_dht_time  # noqa: PLC0415

    from locomm.peer.transport import hello  # noqa: PLC0415
    from locomm.peer.transport.records import SwarmValidator, load_identity  # noqa: PLC0415
    from locomm.peer.transport.rpc import RpcServer  # noqa: PLC0415
    from locomm.peer.transport.state_sync import Snapshot, StateServer  # noqa: PLC0415
    from locomm.peer.transport.swarm import store_heartbeat  # noqa: PLC0415
    from locomm.protocol.timing import Limits  # noqa: PLC0415

    loopback = ["/ip4/127.0.0.1/tcp/0"]
    p2p = await P2P.create(initial_peers=[boot], host_maddrs=loopback)
    dht = await DHTNode.create(p2p=p2p, initial_peers=[boot], client_mode=True, ensure_bootstrap_success=False)
    validators, lives, servers, maddrs = [], [], [], []
    pool = ThreadPoolExecutor(1)
    tensors = await asyncio.to_thread(poisoned_state, live, poison) if live is not None else None
    stats: dict[str, Any] = {"ghosts": [], "stored": 0, "refused": 0, "live": live is not None, "hellos": 0}

    def seen(_peer: str) -> None:
        stats["hellos"] += 1

    try:
        for i in range(n):
            path = folder / f"ghost{i}.id"
            P2P.generate_identity(str(path))
            validators.append(SwarmValidator(load_identity(path)))
            if live is not None:
                own = await P2P.create(identity_path=str(path), initial_peers=[boot], host_maddrs=loopback)
                lives.append(own)
                await hello.serve(own, run_id, seen)
                server = StateServer(run_id, copies=1000)
                await RpcServer(own, run_id, Limits.from_network(live.network), pool).add(server.service())
                servers.append(server)
                maddrs.append([str(m) for m in await own.get_visible_maddrs()])
        stats["ghosts"] = [v.peer_id for v in validators]
        while not stop.is_set():
            now = get_dht_time()
            for i, v in enumerate(validators):
                claimed = FAR_ROUND if i < far else round_of()
                dht.protocol.record_validator = v  # this store is signed with the identity's own key
                beat = {
                    "round": claimed,
                    "join_round": 0,
                    "started": True,
                    "version": __version__,
                    "round_s": 1.0,
                    "round_t0": now,
                    "up_Bps": 1e9,
                    "partners": 1,
                    "eta_s": 0.5,
                }
                if servers:
                    beat["maddrs"] = maddrs[i]
                    if servers[i].snapshot is None or servers[i].snapshot.round != claimed:
                        servers[i].snapshot = Snapshot(claimed, tensors)  # the round it claims: no lie to catch
                ok = await store_heartbeat(dht, run_id, v.peer_id, beat, ttl)
                stats["stored" if ok else "refused"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
        stats["state_bytes_served"] = sum(
            n
            for s in servers
            for q in s._sent.values()
            for _, n in q  # within the last FETCH_WINDOW_S
        )
    finally:
        for node in (dht, p2p, *lives):
            with contextlib.suppress(Exception):
                await node.shutdown()
        pool.shutdown(wait=False)
    return stats


def run_swarm(folder: Path, args: Any, ghosts: int) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    cfg, spec = spec_file(folder)
    run_id = spec.hash()[:16]
    out: dict[str, Any] = {"ghosts": ghosts}
    with Launcher(folder, grace_s=10.0) as peers:
        end = ("--until-round", str(args.rounds), "--wait-for-peers", str(PEERS))
        p0 = peers.start("p0", *end, "--shard", f"0/{PEERS}", config=cfg)
        boot = p0.address()
        procs: list[PeerProcess] = [p0]
        procs += [
            peers.start(f"p{i}", *end, "--shard", f"{i}/{PEERS}", config=cfg, initial_peers=boot)
            for i in range(1, PEERS)
        ]
        t0 = time.perf_counter()
        joiner: PeerProcess | None = None

        async def main() -> dict[str, Any] | None:
            nonlocal joiner
            stop = asyncio.Event()
            task = None
            if ghosts:
                kw = dict(ttl=spec.network.heartbeat_ttl_s, n=ghosts, far=args.far, folder=folder, stop=stop)
                live = spec if args.live else None
                task = asyncio.create_task(haunt(boot, run_id, round_of=p0.round, live=live, poison=args.poison, **kw))
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if joiner is None and p0.round() >= args.join_at:
                    joiner = peers.start("joiner", "--until-round", str(args.rounds), config=cfg, initial_peers=boot)
                await asyncio.sleep(0.5)
            if joiner is not None:
                while joiner.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
            stop.set()
            return await task if task else None

        haunted = asyncio.run(main())
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        ghost_ids = set(haunted["ghosts"]) if haunted else set()
        out["haunt"] = {k: v for k, v in (haunted or {}).items() if k != "ghosts"}
        out["peers"], counted, round_s = [], [], []
        for p in procs:
            fin = (p.events("finished") or [{}])[0]
            rounds = p.events("round")
            counted += [len(e.get("member_ids", [])) for e in rounds]
            walls = [e["wall_s"] for e in rounds if "wall_s" in e]  # since the peer's training began
            round_s += [b - a for a, b in zip(walls, walls[1:], strict=False)]
            ghosts_counted = sum(1 for e in rounds for m in e.get("member_ids", []) if m in ghost_ids)
            out["peers"].append(
                {
                    "name": p.name,
                    "returncode": p.poll(),
                    "rounds": fin.get("rounds_completed"),
                    "exchanges_ok": fin.get("exchanges_ok"),
                    "exchanges_failed": fin.get("exchanges_failed"),
                    "wait_s": fin.get("wait_s"),
                    "faults": fin.get("faults"),
                    "final_loss": fin.get("final_loss"),
                    "ghosts_counted": ghosts_counted,
                }
            )
        out["most_members"] = max(counted, default=0)
        out["ghosts_ever_counted"] = sum(p["ghosts_counted"] for p in out["peers"])
        out["round_wall_s"] = {
            "median": round(statistics.median(round_s), 2) if round_s else None,
            "max": round(max(round_s), 2) if round_s else None,
        }
        if joiner is not None:
            synced = joiner.events("synced") or joiner.events("sync_failed")
            jrounds = joiner.events("round")
            out["joiner"] = {
                "returncode": joiner.poll(),
                "sync": synced[0] if synced else None,
                "first_round": jrounds[0].get("round") if jrounds else None,
                "rounds": len(jrounds),
                "final_loss": (joiner.events("finished") or [{}])[0].get("final_loss"),
                "ghosts_counted": sum(1 for e in jrounds for m in e.get("member_ids", []) if m in ghost_ids),
            }
            if synced:  # whose state it took, and whom it asked and faulted: honest peers or ghosts
                sync = synced[0]
                for k in ("donor_ids", "faulted_ids", "asked"):
                    ids = sync.get(k, [])
                    out["joiner"][f"{k}_ghosts"] = sum(1 for m in ids if m in ghost_ids)
                    out["joiner"][f"{k}_honest"] = len(ids) - out["joiner"][f"{k}_ghosts"]
            out["joiner"]["tail"] = joiner.tail()[-1500:]
    return out


def main() -> int:
    ap = _harness.parser(__doc__.split("\n\n")[0], out="ghosts.json", quick=True)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--ghosts", type=int, default=24)
    ap.add_argument("--far", type=int, default=3, help="Ghosts claiming round 10^9")
    ap.add_argument("--join-at", type=int, default=10, help="Honest round at which a fourth peer joins")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--keep", type=Path, help="Keep the peers' logs in this folder (default: a temporary one)")
    ap.add_argument("--only", choices=["clean", "haunted"], help="Run one of the two swarms")
    ap.add_argument("--live", action="store_true", help="Each identity runs a p2pd of its own (see haunt)")
    ap.add_argument("--poison", choices=["init", "noise"], default="init", help="The state live identities serve")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.ghosts, args.far, args.join_at = 30, 8, 2, 4
    result: dict[str, Any] = {"bench": "ghosts", "rounds": args.rounds, "peers": PEERS, "far": args.far}
    result.update(live=args.live, poison=args.poison if args.live else None, ghosts=args.ghosts)
    with tempfile.TemporaryDirectory(prefix="locomm-ghosts-") as tmp:
        folder = args.keep or Path(tmp)
        for name, n in (("clean", 0), ("haunted", args.ghosts)):
            if args.only in (None, name):
                result[name] = run_swarm(folder / name, args, n)
    _harness.write_json(args.out, result)
    for name in ("clean", "haunted"):
        if name not in result:
            continue
        r = result[name]
        print(
            f"{name}: wall {r['wall_s']} s, round wall median {r['round_wall_s']['median']} s max "
            f"{r['round_wall_s']['max']} s, most members {r['most_members']}, ghosts counted "
            f"{r['ghosts_ever_counted']}, exchanges {[p['exchanges_ok'] for p in r['peers']]}, network wait "
            f"{[round(p['wait_s'] or 0, 1) for p in r['peers']]} s, joiner "
            f"{ {k: v for k, v in (r.get('joiner') or {}).items() if k != 'tail'} }",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
