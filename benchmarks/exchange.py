"""Exchange speed on loopback: locomm's gossip push vs hivemind's DecentralizedAverager, same payload, same run.

Three figures (the peer daemon issue's "must show"):

1. A symmetric exchange of a 100 MB fp32 payload (25 tensors of 1M floats,
   N(0, 0.02) like a pseudo-gradient) between 2 peers on loopback: locomm's
   gossip (raw fp32, and with the lossless codec) against one
   DecentralizedAverager all-reduce step on the same tensors. Each side runs in
   its own process, as real peers do; times are medians after warm-up.
2. Launch to first heartbeat: wall time from starting `locomm-peer join` (a new
   process, imports included) to its first heartbeat record in the DHT.
3. Compute waiting on the network: a 3-peer NoLoCo swarm at H=50 on loopback
   (nano), the share of wall-clock the compute thread waited on exchanges.

    python benchmarks/exchange.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
N_TENSORS = 25
TENSOR_NUMEL = 1 << 20  # 4 MiB each in fp32: 100 MiB in all


def payload(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"delta/t{i}": torch.randn(TENSOR_NUMEL, generator=g) * 0.02 for i in range(N_TENSORS)}


# ------------------------------------------------------------------------------ locomm gossip
# Both sides live in this process: their p2pd daemons are separate processes either way, and the
# Python side (framing, encode/decode) of both peers shares this one event loop, which if anything
# handicaps locomm against the averager, whose workers are processes of their own.

def bench_gossip(codec: str, rounds: int) -> dict:
    from hivemind.p2p import P2P

    from locomm.peer.gossip import Gossip
    from locomm.protocol.messages import TensorSpec

    async def main() -> tuple[list[float], int]:
        a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        b = await P2P.create(initial_peers=await a.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        ids = [a.peer_id.to_base58(), b.peer_id.to_base58()]
        data = [payload(0), payload(1)]
        expected = {k: TensorSpec((TENSOR_NUMEL,)) for k in data[0]}
        nodes = [Gossip(p, run_id="bench", me=me, expected=expected, codec=codec, timeout=120,
                        max_body_bytes=1 << 31, max_faults=100) for p, me in zip((a, b), ids)]
        for g in nodes:
            await g.start()
        times = []
        for r in range(rounds):
            for g in nodes:
                g.advance(r)
            t0 = time.perf_counter()
            got = await asyncio.wait_for(asyncio.gather(nodes[0].exchange(r, [ids[1]], data[0]),
                                                        nodes[1].exchange(r, [ids[0]], data[1])), 300)
            times.append(time.perf_counter() - t0)
            assert all(len(x) == 1 for x in got), "the exchange failed"
        sent = nodes[0].stats.bytes_sent
        await a.shutdown()
        await b.shutdown()
        return times, sent

    times, sent = asyncio.run(main())
    warm = times[1:] or times  # the first round pays connection set-up
    return {"method": f"locomm gossip ({codec})", "median_s": statistics.median(warm), "all_s": times,
            "bytes_sent_per_round": sent / rounds}


# ------------------------------------------------------------------- hivemind DecentralizedAverager

def bench_averager(rounds: int) -> dict:
    import concurrent.futures

    import hivemind

    d1 = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    d2 = hivemind.DHT(start=True, initial_peers=[str(m) for m in d1.get_visible_maddrs()],
                      host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    avgs = [hivemind.averaging.DecentralizedAverager(list(payload(i).values()), dht=d, prefix="bench",
                                                     target_group_size=2, min_group_size=2, start=True)
            for i, d in enumerate((d1, d2))]
    times = []
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for _ in range(rounds):
                t0 = time.perf_counter()
                outs = list(pool.map(lambda av: av.step(timeout=120), avgs))
                times.append(time.perf_counter() - t0 if all(outs) else float("inf"))
    finally:
        for av in avgs:
            av.shutdown()
        d2.shutdown()
        d1.shutdown()
    warm = times[1:] or times
    return {"method": "hivemind DecentralizedAverager", "median_s": statistics.median(warm), "all_s": times}


# -------------------------------------------------------------------- start-up and overlap

def first_heartbeat() -> dict:
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "p.jsonl"
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "locomm.cli.main", "join", "--preset", "nano", "--rounds", "1",
                                 "--inner-steps", "5", "--device", "cpu", "--log-file", str(log)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc.wait(timeout=300)
        started = next(json.loads(line) for line in log.read_text().splitlines() if '"started"' in line)
        return {"launch_to_first_heartbeat_s": started["first_heartbeat_at"] - t0,
                "node_start_to_first_heartbeat_s": started["first_heartbeat_s"]}


def overlap(peers: int, rounds: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "locomm.cli.main", "swarm", "--peers", str(peers), "--rounds",
                          str(rounds), "--inner-steps", "50", "--preset", "nano", "--json", "--plot",
                          str(Path(tempfile.gettempdir()) / "locomm-exchange-bench.png")],
                         capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    rows = [bench_averager(a.rounds), bench_gossip("none", a.rounds), bench_gossip("lossless", a.rounds)]
    base = rows[0]["median_s"]
    print("| method | median s per 100 MB exchange | speed-up vs DecentralizedAverager |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['median_s']:.3f} | {base / r['median_s']:.2f}x |")
    hb = first_heartbeat()
    print(f"\nlaunch -> first heartbeat: {hb['launch_to_first_heartbeat_s']:.2f} s "
          f"(of which node start-up {hb['node_start_to_first_heartbeat_s']:.2f} s; the rest is Python imports)")
    sw = overlap(3, 6)
    print(f"NoLoCo H=50, 3 peers on loopback: compute waited on the network {100 * sw['wait_fraction']:.1f}% of "
          f"wall-clock ({sw['rounds_completed']} rounds, loss {sw['initial_loss']:.3f} -> {sw['final_loss']:.3f})")
    out = HERE / "results" / "exchange.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"exchange": rows, "first_heartbeat": hb, "swarm": sw}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
