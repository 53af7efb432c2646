"""Loop responsiveness while a large payload is received and decoded: the codec pool vs decoding on the loop.

One receiving node, as node.py wires one: a hivemind P2P, a DHTNode on that P2P, an
RpcServer (no authorize hook) with its 2-thread codec pool, and Gossip, all on one
event loop (uvloop when installed, as the daemon). A sender, a node of the same kind
in a process of its own (its DHTNode joins the receiver's), pushes one
``--mb`` MiB fp32 payload (NoLoCo ``theta``, a few tensors, codec stack
``lossless`` by default) over Gossip's parallel streams. Meanwhile, on the
receiver's loop:

- a heartbeat-like *ticker* wakes every ``--interval`` s (``asyncio.sleep``): the
  gaps between its ticks are the figure (a blocked loop shows as a long gap);
- a *heartbeat* task stores a heartbeat record in the DHT every ``--interval`` s
  (``locomm.peer.transport.swarm.store_heartbeat``, awaited, then a sleep: as the node's
  heartbeat loop): the gaps between stores that completed;
- a 10 ms *probe* gives the loop's lag at a finer grain (its p99 is meaningful
  where a 0.5 s ticker gives only a few gaps).

Gaps count from the receiver's request to the sender until the payload is in the
mailbox (decoded, ``finish`` done), including the gap that spans the end. ``ok`` is
max gap <= 2 intervals, for the ticker and the heartbeat alike.

Two modes, the same payload, the same parts, the same codec:

- ``pool``: locomm's design: every part is decoded in the codec pool as it arrives.
- ``loop``: the previous gossip's design: every part's bytes are read first, then
  the whole payload is decoded in one go on the loop thread (the RpcServer's
  ``decode`` hook runs inline; parts are deferred to the final ``finish``).

Modes alternate (pool, loop, pool, loop: ``--repeat`` transfers each) so that other
load on the machine lands on both alike; a mode's gaps are pooled over its
repetitions. A watchdog thread notes what the loop thread was running whenever the
10 ms probe is more than 100 ms late (``loop_stalls_over_100ms``). The received
payload is checked bit-exact against the sent one, off the loop and after the
window. Memory: the sender holds the payload and its encoded parts (about 1.25 GB
peak RSS for 400 MiB), the receiver the decoded payload, its reference copy and, in
loop mode, the encoded parts (about 2 GB peak RSS): about 3.2 GB in all. The script runs
itself as a child in a new session and SIGKILLs that group at the end (or on
Ctrl-C / SIGTERM / timeout), so neither the sender nor a p2pd daemon outlives it.

    python benchmarks/responsiveness.py                 # about 1 minute on 2 cores
    python benchmarks/responsiveness.py --mb 400 --interval 0.5 --codec lossless --repeat 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing as mp
import os
import platform
import resource
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _harness

RUN_ID = "benchresponsive0"
COLS = 1024
PROBE_S = 0.01
STALL_S = 0.1


def shapes_for(mib: int) -> dict[str, tuple[int, int]]:
    """A few 2-D tensors, 40/30/20/10 % of ``mib`` MiB of fp32 (1024 columns each)."""
    rows = mib * (1 << 20) // 4 // COLS
    split = [rows * 4 // 10, rows * 3 // 10, rows * 2 // 10]
    split.append(rows - sum(split))
    return {f"layer{i}.weight": (r, COLS) for i, r in enumerate(split)}


def make_payload(shapes: dict[str, tuple[int, int]], seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"theta/{k}": torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}


def run_loop(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


class Node:
    """P2P + DHTNode + RpcServer + Gossip on this loop, as node.py builds them."""

    def __init__(self, shapes: dict[str, tuple[int, int]], codec_name: str, inline_decode: bool = False) -> None:
        self.shapes, self.codec_name, self.inline_decode = shapes, codec_name, inline_decode

    async def start(self, initial_peers: list[str] | None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from hivemind.dht import DHTNode
        from hivemind.p2p import P2P

        from locomm.compression.payload import PayloadCodec
        from locomm.peer.transport.gossip import Faults, Gossip
        from locomm.peer.transport.rpc import Limits, RpcServer

        class LoopDecodeServer(RpcServer):
            """The previous gossip's receive path: read every part, then decode all of it on the loop thread."""

            mode = "pool"

            async def decode(self, fn: Any, *args: Any) -> Any:
                if self.mode == "pool":
                    return await super().decode(fn, *args)
                if getattr(fn, "__name__", "") == "decode_part":
                    self.deferred.append((fn, args))
                    return None
                for f, a in self.deferred:  # finish: the whole payload, on the loop, in one go
                    f(*a)
                self.deferred.clear()
                return fn(*args)

        self.p2p = await P2P.create(initial_peers=initial_peers or None, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.me = self.p2p.peer_id.to_base58()
        self.dht = await DHTNode.create(p2p=self.p2p, initial_peers=initial_peers or None)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="locomm-codec")  # as node.py
        self.codec = PayloadCodec(self.shapes, {"theta": "parameter"}, {"parameter": self.codec_name})
        self.limits = Limits()
        self.server = LoopDecodeServer(self.p2p, RUN_ID, self.limits, self.pool, authorize=None)
        self.server.deferred = []
        self.gossip = Gossip(
            self.p2p,
            self.server,
            run_id=RUN_ID,
            me=self.me,
            codec=self.codec,
            limits=self.limits,
            faults=Faults(100),
            max_body_bytes=1 << 31,
            streams=4,
            parallel_threshold=16 << 20,
        )
        await self.server.add(self.gossip.service())
        if hasattr(self.codec, "warm_up"):
            self.codec.warm_up()
        else:  # numba compiles on first use
            import torch

            c = self.codec.codec(self.codec_name)
            if c is not None:
                c.decode(c.encode(torch.linspace(-1, 1, 4096)))

    async def maddrs(self) -> list[str]:
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.dht.shutdown()
        with contextlib.suppress(Exception):
            await self.p2p.shutdown()
        self.pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------ sender process


def sender_process(conn: Any, mib: int, codec_name: str, seed: int) -> None:
    async def main() -> None:
        from locomm.peer.transport.gossip import Outgoing

        node = Node(shapes_for(mib), codec_name)
        try:
            maddrs, receiver = await asyncio.to_thread(conn.recv)
            await node.start(maddrs)
            payload = make_payload(node.shapes, seed)
            conn.send(node.me)
            while True:
                msg = await asyncio.to_thread(conn.recv)
                if msg[0] == "stop":
                    break
                r = msg[1]
                node.gossip.advance(r)
                s0 = node.gossip.stats.bytes_sent
                out = Outgoing(r, payload, node.codec, node.server, [receiver])
                t0 = time.perf_counter()
                outcome = await node.gossip.push(receiver, out)
                out.close()
                del out
                conn.send(
                    {
                        "outcome": getattr(outcome, "name", str(outcome)),
                        "push_s": time.perf_counter() - t0,
                        "bytes_sent": node.gossip.stats.bytes_sent - s0,
                        "peak_rss_mb": peak_rss_mb(),
                    }
                )
        finally:
            await node.close()

    run_loop(main())


# ------------------------------------------------------------------------------ receiver (this process)


def gaps_in(ticks: list[float], t0: float, t1: float) -> list[float]:
    """Gaps between consecutive ticks that overlap [t0, t1] (the one spanning t1 included)."""
    return [b - a for a, b in zip(ticks, ticks[1:]) if b > t0 and a < t1]


def worst_start(ticks: list[float], t0: float, t1: float) -> float | None:
    """When (seconds after t0) the longest gap in [t0, t1] began."""
    pairs = [(b - a, a - t0) for a, b in zip(ticks, ticks[1:]) if b > t0 and a < t1]
    return max(pairs)[1] if pairs else None


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from locomm.peer.transport.swarm import store_heartbeat

    shapes = shapes_for(args.mb)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=sender_process, args=(theirs, args.mb, args.codec, args.seed), daemon=True)
    node = Node(shapes, args.codec)
    ticks: list[float] = []
    probes: list[float] = []
    beats: list[tuple[float, float]] = []  # (completed at, store latency)
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(args.interval)

    async def probe() -> None:
        while not stop.is_set():
            probes.append(time.monotonic())
            await asyncio.sleep(PROBE_S)

    # A watchdog thread: when the probe has not ticked for STALL_S, note what the loop thread is running.
    import threading
    import traceback

    loop_thread = threading.get_ident()
    stalls: list[tuple[float, str]] = []

    def watchdog() -> None:
        seen = None
        while not stop.is_set():
            time.sleep(0.02)
            last = probes[-1] if probes else None
            if last is None or last == seen or time.monotonic() - last < STALL_S:
                continue
            seen = last
            frame = sys._current_frames().get(loop_thread)
            where = (
                " <- ".join(
                    f"{Path(f.filename).name}:{f.lineno} {f.name}"
                    for f in reversed(traceback.extract_stack(frame)[-4:])
                )
                if frame
                else "?"
            )
            stalls.append((time.monotonic(), where))

    threading.Thread(target=watchdog, daemon=True).start()

    async def heartbeat() -> None:
        n = 0
        while not stop.is_set():
            t = time.monotonic()
            ok = await store_heartbeat(node.dht, RUN_ID, node.me, {"round": n, "join_round": 0, "step": n}, 60.0)
            beats.append((time.monotonic(), time.monotonic() - t if ok else float("inf")))
            n += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.interval)

    tasks: list[asyncio.Task] = []
    runs = []
    try:
        proc.start()
        await node.start(None)
        mine.send((await node.maddrs(), node.me))
        sender = await asyncio.to_thread(mine.recv)
        want = make_payload(shapes, args.seed)
        payload_bytes = sum(v.numel() * 4 for v in want.values())
        tasks = [asyncio.create_task(f()) for f in (ticker, probe, heartbeat)]
        await asyncio.sleep(2 * args.interval)
        for r, mode in enumerate(m for _ in range(args.repeat) for m in args.modes):
            node.server.mode = mode
            node.gossip.advance(r)
            await asyncio.sleep(2 * args.interval)  # a few undisturbed ticks first
            t0 = time.monotonic()
            mine.send(("push", r))
            async with node.gossip.arrived:
                await asyncio.wait_for(
                    node.gossip.arrived.wait_for(lambda r=r: sender in node.gossip.mailbox.get(r, {})), args.timeout
                )
            t1 = time.monotonic()
            got = node.gossip.mailbox[r].pop(sender)
            await asyncio.sleep(2 * args.interval)  # let the gap that spans the end close (nothing else on the loop)
            sent = await asyncio.to_thread(mine.recv)
            exact = await asyncio.to_thread(
                lambda got=got: set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
            )
            del got
            runs.append(
                {
                    "mode": mode,
                    "payload_bytes": payload_bytes,
                    "bytes_on_wire": sent["bytes_sent"],
                    "push_outcome": sent["outcome"],
                    "bit_exact": exact,
                    "transfer_decode_s": t1 - t0,
                    "tick_gaps": gaps_in(ticks, t0, t1),
                    "probe_gaps": gaps_in(probes, t0, t1),
                    "beat_gaps": gaps_in([b[0] for b in beats], t0, t1),
                    "store_latencies": [lat for at, lat in beats if t0 < at < t1 + args.interval],
                    "probe_max_gap_starts_at_s": worst_start(probes, t0, t1),
                    "stalls": [
                        {"at_s": round(at - t0, 3), "loop_thread_in": where}
                        for at, where in stalls
                        if t0 <= at <= t1 + args.interval
                    ][:4],
                    "sender_peak_rss_mb": sent["peak_rss_mb"],
                    "receiver_peak_rss_mb": peak_rss_mb(),
                    "load_avg_1m": os.getloadavg()[0],
                }
            )
            if not exact or sent["outcome"] != "OK":
                raise RuntimeError(f"{mode}: the payload did not arrive intact ({sent}, bit-exact: {exact})")
        mine.send(("stop",))
        await asyncio.to_thread(proc.join, 30)
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await node.close()
        if proc.is_alive():
            proc.kill()
    return {
        "runs": runs,
        "setup": {
            "payload_mib": args.mb,
            "tensors": {k: list(v) for k, v in shapes.items()},
            "codec": args.codec,
            "interval_s": args.interval,
            "streams": 4,
            "cpus": os.cpu_count(),
            "load_avg_at_end": os.getloadavg(),
            "python": platform.python_version(),
        },
    }


DECODE = {
    "pool": "in the codec pool (RpcServer.decode -> run_in_executor), part by part as parts arrive",
    "loop": "on the loop thread: every part read first, then all decoded in one go (the previous gossip)",
}


def summarize(mode: str, runs: list[dict[str, Any]], interval: float, codec: str) -> dict[str, Any]:
    """One mode's figures over its repetitions: gaps pooled, max and p99 over all of them."""
    ticks = [g for r in runs for g in r["tick_gaps"]]
    beats = [g for r in runs for g in r["beat_gaps"]]
    probes = [g for r in runs for g in r["probe_gaps"]]
    lat = [x for r in runs for x in r["store_latencies"]]
    max_gap, max_beat = (max(ticks) if ticks else None), (max(beats) if beats else None)
    return {
        "mode": mode,
        "decode": DECODE[mode],
        "codec": codec,
        "payload_bytes": runs[0]["payload_bytes"],
        "bytes_on_wire": runs[0]["bytes_on_wire"],
        "repetitions": len(runs),
        "bit_exact": all(r["bit_exact"] for r in runs),
        "push_outcomes": sorted({r["push_outcome"] for r in runs}),
        "transfer_decode_s": statistics.median(r["transfer_decode_s"] for r in runs),
        "transfer_decode_all_s": [r["transfer_decode_s"] for r in runs],
        "interval_s": interval,
        "max_gap_s": max_gap,
        "p99_gap_s": pct(ticks, 0.99),
        "median_gap_s": pct(ticks, 0.5),
        "gaps": len(ticks),
        "max_gap_per_repetition_s": [max(r["tick_gaps"]) if r["tick_gaps"] else None for r in runs],
        "heartbeat_store_max_gap_s": max_beat,
        "heartbeat_store_p99_gap_s": pct(beats, 0.99),
        "heartbeat_store_gaps": len(beats),
        "heartbeat_store_max_latency_s": max(lat) if lat else None,
        "probe_interval_s": PROBE_S,
        "probe_max_gap_s": max(probes) if probes else None,
        "probe_p99_gap_s": pct(probes, 0.99),
        "probe_p50_gap_s": pct(probes, 0.5),
        "probe_gaps": len(probes),
        "probe_max_gap_starts_at_s": [r["probe_max_gap_starts_at_s"] for r in runs],
        "loop_stalls_over_100ms": [{**x, "repetition": i} for i, r in enumerate(runs) for x in r["stalls"]][:8],
        "ok": (max_gap is not None and max_gap <= 2 * interval and max_beat is not None and max_beat <= 2 * interval),
        "sender_peak_rss_mb": max(r["sender_peak_rss_mb"] for r in runs),
        "receiver_peak_rss_mb": max(r["receiver_peak_rss_mb"] for r in runs),
        "load_avg_1m": [r["load_avg_1m"] for r in runs],
    }


def run_in_own_session(timeout: float) -> int:
    """Run this script again as a child in a new session, then SIGKILL that whole process group: the sender
    process and both p2pd daemons go with it, whatever happened."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--child"], start_new_session=True
    )
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"stopped after {timeout:.0f} s", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)


def main() -> None:
    ap = _harness.parser(__doc__, out="responsiveness.json", summary=True)
    ap.add_argument("--mb", type=int, default=400, help="payload size in MiB of fp32 (>= 400 for the must-show)")
    ap.add_argument("--codec", default="lossless")
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--modes", default="pool,loop", help="pool (locomm), loop (decode on the loop thread)")
    ap.add_argument("--repeat", type=int, default=2, help="transfers per mode (gaps pooled)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    if not args.child:
        for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind like Ctrl-C: the child's group is still killed
            signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
        sys.exit(run_in_own_session(args.timeout * len(args.modes) * args.repeat + 120))
    res = run_loop(measure(args))
    runs = {m: summarize(m, [r for r in res["runs"] if r["mode"] == m], args.interval, args.codec) for m in args.modes}
    out: dict[str, Any] = {"setup": res["setup"]}
    if "pool" in runs:
        p = runs["pool"]
        out.update(
            {
                "payload_bytes": p["payload_bytes"],
                "codec": args.codec,
                "transfer_decode_s": p["transfer_decode_s"],
                "max_gap_s": p["max_gap_s"],
                "p99_gap_s": p["p99_gap_s"],
                "interval_s": args.interval,
                "ok": p["ok"],
            }
        )
    if "loop" in runs:
        q = runs["loop"]
        out["contrast_decode_on_loop"] = {
            k: q[k]
            for k in (
                "transfer_decode_s",
                "max_gap_s",
                "p99_gap_s",
                "heartbeat_store_max_gap_s",
                "probe_max_gap_s",
                "ok",
            )
        }
    out.update(runs)
    for mode, r in runs.items():
        print(
            f"{mode:>4}: {r['payload_bytes'] / 2**20:.0f} MiB {r['codec']} x{r['repetitions']}, "
            f"{r['transfer_decode_s']:.2f} s each (median); ticker every {r['interval_s']} s: max gap "
            f"{r['max_gap_s']:.3f} s, p99 {r['p99_gap_s']:.3f} s; heartbeat store max gap "
            f"{r['heartbeat_store_max_gap_s']:.3f} s; 10 ms probe max {r['probe_max_gap_s']:.3f} s, "
            f"p99 {r['probe_p99_gap_s']:.3f} s; ok={r['ok']}"
        )
    _harness.write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
