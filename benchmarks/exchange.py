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
import multiprocessing as mp
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
# Each worker gets its own inbox queue: first the other side's address/id, then one "go" per round
# from the parent once both are ready (a barrier, so both sides start each exchange together).

def gossip_worker(rank: int, inbox: mp.Queue, outbox: mp.Queue, res: mp.Queue, codec: str, rounds: int) -> None:
    import torch  # noqa: F401

    from hivemind.p2p import P2P

    from locomm.peer.gossip import Gossip
    from locomm.protocol.messages import TensorSpec

    async def main() -> None:
        loop = asyncio.get_running_loop()
        get = lambda: loop.run_in_executor(None, inbox.get)  # noqa: E731 - keep the loop serving pushes
        if rank == 0:
            p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            outbox.put(str((await p2p.get_visible_maddrs())[0]))
        else:
            p2p = await P2P.create(initial_peers=[await get()], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        me = p2p.peer_id.to_base58()
        outbox.put(me)
        other = await get()
        data = payload(rank)
        g = Gossip(p2p, run_id="bench", me=me, expected={k: TensorSpec((TENSOR_NUMEL,)) for k in data}, codec=codec,
                   timeout=120, max_body_bytes=1 << 31, max_faults=100)
        await g.start()
        times = []
        for r in range(rounds):
            g.advance(r)
            res.put(("ready", rank))
            await get()
            t0 = time.perf_counter()
            got = await g.exchange(r, [other], data)
            times.append(time.perf_counter() - t0)
            assert len(got) == 1, "the exchange failed"
        res.put(("times", rank, times, g.stats.bytes_sent))
        await asyncio.sleep(1.0)  # let the other side's last push finish before p2pd goes away
        await p2p.shutdown()

    asyncio.run(main())


def run_pair(target, extra: tuple, rounds: int) -> tuple[dict[int, list[float]], list]:
    """Start two workers, release them together for each round, collect their times."""
    ctx = mp.get_context("spawn")
    inbox = [ctx.Queue(), ctx.Queue()]
    res = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, inbox[r], inbox[1 - r], res, *extra, rounds)) for r in (0, 1)]
    for p in procs:
        p.start()
    times: dict[int, list[float]] = {}
    other: list = []
    try:
        for _ in range(rounds):
            for _ in range(2):
                kind, *_rest = res.get(timeout=600)
            inbox[0].put("go")
            inbox[1].put("go")
        while len(times) < 2:
            kind, rank, t, *more = res.get(timeout=600)
            times[rank] = t
            other = more
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return times, other


def summarize(method: str, times: dict[int, list[float]]) -> dict:
    per_round = [max(a, b) for a, b in zip(times[0], times[1])]
    warm = per_round[1:] or per_round  # the first round pays connection set-up
    return {"method": method, "median_s": statistics.median(warm), "all_s": per_round}


def bench_gossip(codec: str, rounds: int) -> dict:
    times, more = run_pair(gossip_worker, (codec,), rounds)
    return summarize(f"locomm gossip ({codec})", times) | {"bytes_sent_per_round": more[0] / rounds}


# ------------------------------------------------------------------- hivemind DecentralizedAverager

def averager_worker(rank: int, inbox: mp.Queue, outbox: mp.Queue, res: mp.Queue, rounds: int) -> None:
    import hivemind

    if rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        outbox.put([str(m) for m in dht.get_visible_maddrs()])
    else:
        dht = hivemind.DHT(start=True, initial_peers=inbox.get(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    avg = hivemind.averaging.DecentralizedAverager(list(payload(rank).values()), dht=dht, prefix="bench",
                                                   target_group_size=2, min_group_size=2, start=True)
    times = []
    for _ in range(rounds):
        res.put(("ready", rank))
        inbox.get()
        t0 = time.perf_counter()
        out = avg.step(timeout=120)
        times.append(time.perf_counter() - t0 if out is not None else float("inf"))
    res.put(("times", rank, times))
    time.sleep(1.0)
    avg.shutdown()
    dht.shutdown()


def bench_averager(rounds: int) -> dict:
    times, _ = run_pair(averager_worker, (), rounds)
    return summarize("hivemind DecentralizedAverager", times)


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
