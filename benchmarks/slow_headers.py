"""Slow headers from outsiders against a live swarm: honest exchanges with and without the attack (issue 32).

Three real ``locomm-peer join`` peers (nano, NoLoCo, loopback) train ``--rounds`` rounds together, twice: once
clean, once while an outsider (``--identities`` P2P nodes with no heartbeat in the swarm, bootstrapped
through peer 0) keeps ``--streams`` streams open to every honest peer's ``gossip`` and ``state`` handlers per
identity, sending nothing: the slow-header attack that, before the policy was asked ahead of the shared slots,
held all 256 inbound slots and made every push, pull and state request NOT_READY. Each attack stream reopens
as soon as it ends. Reported per run: each peer's exchanges (the ``finished`` summary), its wall-clock, and
the attack's streams (opened, answered, how long the server held each before answering or closing).

    python benchmarks/slow_headers.py --rounds 20 --out benchmarks/results/slow_headers.json

The must-show of issue 32: the attacked run's honest exchanges at least 90% of the clean run's.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from locomm.config import RunSpec
from locomm.testing.launcher import Launcher, PeerProcess

import _harness

PEERS = 3
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def spec_file(folder: Path) -> tuple[Path, str]:
    spec = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=1.0, batch_size=8, seq_len=64)
        .replace("outer", algo="noloco", inner_steps=20)
        .replace("train", steps=100_000, eval_batches=2, eval_interval=0)
    )
    path = folder / "run.toml"
    spec.save(path)
    return path, spec.hash()[:16]


async def attack(
    boot: list[str], targets: list[str], run_id: str, identities: int, streams: int, stop: asyncio.Event
) -> dict[str, Any]:
    """Hold ``streams`` silent streams per identity, target and handler until ``stop``; what the servers did."""
    from hivemind.p2p import P2P, PeerID  # noqa: PLC0415

    loop = asyncio.get_running_loop()
    stats: dict[str, Any] = {"opened": 0, "answered": 0, "closed_silent": 0, "failed": 0, "held_s": []}
    nodes = []
    for _ in range(identities):
        while not stop.is_set():  # the swarm may have ended (a short run) or be busy: try while it runs
            try:
                nodes.append(await P2P.create(initial_peers=boot, host_maddrs=LOOPBACK))
                break
            except Exception as e:  # noqa: BLE001 - p2pd's "failed to connect to bootstrap peers"
                stats["failed"] += 1
                print(f"attacker: {e}", file=sys.stderr, flush=True)
                await asyncio.sleep(1.0)

    async def hold(node: Any, peer: str, handler: str) -> None:
        while not stop.is_set():
            try:
                _, reader, writer = await asyncio.wait_for(
                    node.call_binary_stream_handler(PeerID.from_base58(peer), handler), 10
                )
            except Exception:  # noqa: BLE001 - refused at the dial, or p2pd busy: try again shortly
                stats["failed"] += 1
                await asyncio.sleep(0.5)
                continue
            stats["opened"] += 1
            t0 = loop.time()
            try:
                data = await asyncio.wait_for(reader.read(64), 60)  # the server's answer, or its close
            except Exception:  # noqa: BLE001 - reset, or held past 60 s
                data = b""
            stats["held_s"].append(round(loop.time() - t0, 3))
            stats["answered" if data else "closed_silent"] += 1
            writer.close()

    handlers = [f"locomm.{run_id}.{s}" for s in ("gossip", "state")]
    tasks = [
        asyncio.create_task(hold(n, p, h)) for n in nodes for p in targets for h in handlers for _ in range(streams)
    ]
    await stop.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for n in nodes:
        await n.shutdown()
    held = stats.pop("held_s")
    stats["streams"] = len(tasks)
    stats["held_s_median"] = statistics.median(held) if held else None
    stats["held_s_max"] = max(held) if held else None
    return stats


def run_swarm(folder: Path, rounds: int, attack_kw: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    cfg, run_id = spec_file(folder)
    out: dict[str, Any] = {"attacked": attack_kw is not None}
    with Launcher(folder, grace_s=10.0) as peers:
        end = ("--until-round", str(rounds), "--wait-for-peers", str(PEERS))
        p0 = peers.start("p0", *end, "--shard", f"0/{PEERS}", config=cfg)
        boot = p0.address()
        procs: list[PeerProcess] = [p0]
        procs += [
            peers.start(f"p{i}", *end, "--shard", f"{i}/{PEERS}", config=cfg, initial_peers=boot)
            for i in range(1, PEERS)
        ]
        targets = [p.address().rsplit("/p2p/", 1)[1] for p in procs]
        t0 = time.perf_counter()

        async def main() -> dict[str, Any] | None:
            stop = asyncio.Event()
            task = asyncio.create_task(attack([boot], targets, run_id, stop=stop, **attack_kw)) if attack_kw else None
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            stop.set()
            return await task if task else None

        out["attack"] = asyncio.run(main())
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        out["peers"] = []
        for p in procs:
            fin = p.events("finished")
            s = fin[0] if fin else {}
            out["peers"].append(
                {
                    "name": p.name,
                    "returncode": p.poll(),
                    "rounds": s.get("rounds_completed"),
                    "exchanges_ok": s.get("exchanges_ok"),
                    "exchanges_failed": s.get("exchanges_failed"),
                    "wait_s": s.get("wait_s"),
                }
            )
    out["exchanges_ok"] = sum(p["exchanges_ok"] or 0 for p in out["peers"])
    return out


def main() -> int:
    ap = _harness.parser(__doc__.split("\n\n")[0], out="slow_headers.json")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--identities", type=int, default=4, help="Outsider P2P identities")
    ap.add_argument("--streams", type=int, default=40, help="Silent streams per identity, target and handler")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()
    result: dict[str, Any] = {"bench": "slow_headers", "rounds": args.rounds, "peers": PEERS}
    with tempfile.TemporaryDirectory(prefix="locomm-slowhdr-") as tmp:
        result["clean"] = run_swarm(Path(tmp) / "clean", args.rounds, None, args.timeout)
        kw = {"identities": args.identities, "streams": args.streams}
        result["attacked"] = run_swarm(Path(tmp) / "attacked", args.rounds, kw, args.timeout)
    clean, hit = result["clean"]["exchanges_ok"], result["attacked"]["exchanges_ok"]
    result["ratio"] = round(hit / clean, 3) if clean else None
    _harness.write_json(args.out, result)
    a = result["attacked"]["attack"]
    print(
        f"honest exchanges: clean {clean}, attacked {hit} (ratio {result['ratio']}); wall "
        f"{result['clean']['wall_s']} s vs {result['attacked']['wall_s']} s; attack: {a['streams']} streams held, "
        f"{a['opened']} opened, {a['answered']} answered, median held {a['held_s_median']} s, "
        f"max {a['held_s_max']} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
