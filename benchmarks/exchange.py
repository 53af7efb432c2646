"""Exchange speed on loopback: locomm's Gossip.exchange vs hivemind's DecentralizedAverager, same payload, same run.

Three figures (the peer daemon issue's "must show"):

1. A symmetric exchange of a 100 MiB fp32 payload (one NoLoCo ``theta`` payload:
   25 tensors of 1M floats, N(0, 0.02) like freshly initialised weights) between 2
   peers on loopback, each peer with a real hivemind P2P instance (its own p2pd
   daemon). locomm rows: ``Gossip.exchange`` on the RPC base (``RpcServer`` with
   ``authorize=None``, a 2-thread codec pool, ``Limits()`` defaults, as node.py
   wires them), both peers push to each other and wait for the other's payload,
   with the codec stack ``none`` (raw fp32) and ``lossless``, each with
   ``streams_per_transfer`` 1 and 4 (the streams a push really opens are counted:
   Gossip's rule is ``min(streams, parts, ceil(bytes / parallel_threshold))``,
   threshold 16 MiB). Baseline: one ``DecentralizedAverager.step()`` of the same
   tensors between the same 2 peers (matchmaking included, as a step is; its
   all-reduce phase alone is reported too). Ceiling: the same bytes pushed both
   ways on raw p2pd binary streams (no framing, no codec, no deadlines): what the
   daemons themselves allow on this machine. Every received payload is checked
   bit-exact (averager: against the true mean), outside the timing.
2. Launch to first heartbeat: wall time from starting `locomm-peer join` (a new
   process, imports included) to its first heartbeat record in the DHT.
3. Compute waiting on the network: a 3-peer NoLoCo swarm at H=50 on loopback
   (nano), the share of wall-clock the compute thread waited on exchanges.

Process layout: every row runs in a child process of its own, in a new session
(process group), that this script SIGKILLs as a group once the row is done, past
its timeout, or when this script is stopped (Ctrl-C, SIGTERM), so no p2pd daemon,
peer or averager process outlives it. In the default ``split`` layout each locomm
peer is a process of its own (as real peers are, and as hivemind runs each
averager), on uvloop as the daemon does; ``--layouts shared`` puts both peers on
one event loop (the previous script's layout).

Where ``unshare -n`` (root) or ``unshare -rn`` (user namespaces) works, each row
runs in a fresh network namespace with only ``lo``, so the bytes lo carried during
the timed rounds are this row's alone: ``wire_bytes_per_round`` (per peer; TCP/IP
headers, TLS and yamux framing included). ``bytes_sent_per_round`` is what the
sender wrote (Gossip's counter); for the averager, the butterfly all-reduce's
arithmetic.

Rows run ``--passes`` sweeps (the averager first in each), so that other load on
the machine lands on every row alike; a row's ``median_s`` is the median over all
its timed rounds (``--reps`` per pass, after ``--warmup``). MB = 10^6 bytes;
``effective_MBps`` = the raw fp32 payload (104.86 MB) over ``median_s``. Each row
records the 1-minute load average before and after it.

    python benchmarks/exchange.py --only exchange           # about 3 minutes on 2 idle cores
    python benchmarks/exchange.py --only heartbeat --only swarm
    python benchmarks/exchange.py                           # all three (about 5 minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from locomm.testing.launcher import Launcher

import _harness

N_TENSORS = 25
TENSOR_NUMEL = 1 << 20  # 4 MiB each in fp32: 100 MiB in all
PAYLOAD_BYTES = N_TENSORS * TENSOR_NUMEL * 4
RUN_ID = "benchexchange0000"
CHILD_TIMEOUT_S = 240.0
TARGET_SPEEDUP = 2.0
RAW = "raw-p2pd"
NETNS_ENV = "LOCOMM_BENCH_NETNS"


def theta(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"theta/t{i}": torch.randn(TENSOR_NUMEL, generator=g) * 0.02 for i in range(N_TENSORS)}


# ------------------------------------------------------------------------------ loopback accounting


def _lo_up() -> None:
    """Bring ``lo`` up in a fresh network namespace (ioctl SIOCGIFFLAGS / SIOCSIFFLAGS, no `ip` needed)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0))[:18])[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 0x1))


def lo_tx_bytes() -> int | None:
    """Bytes sent on ``lo`` so far, when this process has a namespace of its own (else None: shared)."""
    if os.environ.get(NETNS_ENV) != "1":
        return None
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    return None


def netns_prefix() -> list[str]:
    """``unshare -n`` / ``unshare -rn`` where it works here; [] otherwise (rows then share the host's lo)."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return []
    for cmd in (["unshare", "-n"], ["unshare", "-rn"]):
        with contextlib.suppress(Exception):
            if subprocess.run([*cmd, "true"], capture_output=True, timeout=10).returncode == 0:
                return cmd
    return []


# ------------------------------------------------------------------------------ locomm gossip (child)


def run_loop(coro: Any, loop: str) -> Any:
    """The node's event loop: uvloop when installed (locomm/cli/daemon.py), else asyncio."""
    if loop == "uvloop":
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:
            pass
    import asyncio

    return asyncio.run(coro)


_OPENED: dict[int, GossipPeer] = {}


def _count_streams(gossip_mod: Any) -> None:
    """Count the streams Gossip really opens, per P2P (its rule: min(streams, parts, ceil(bytes / threshold)))."""
    if getattr(gossip_mod.open_link, "_counting", False):
        return
    open_link = gossip_mod.open_link

    async def counting_open_link(p2p: Any, *args: Any, **kwargs: Any) -> Any:
        peer = _OPENED.get(id(p2p))
        if peer is not None:
            peer.opened += 1
        return await open_link(p2p, *args, **kwargs)

    counting_open_link._counting = True  # type: ignore[attr-defined]
    gossip_mod.open_link = counting_open_link


class GossipPeer:
    """One locomm peer as node.py wires it: a P2P, a 2-thread codec pool, an RpcServer (no authorize hook), Gossip."""

    def __init__(self, idx: int, codec_name: str, streams: int) -> None:
        self.idx, self.codec_name, self.streams = idx, codec_name, streams
        self.p2p: Any = None
        self.pool: Any = None
        self.opened = 0

    async def start(self, initial_peers: list[str] | None) -> str:
        from concurrent.futures import ThreadPoolExecutor

        from hivemind.p2p import P2P

        import locomm.peer.transport.gossip as gossip_mod
        from locomm.compression.payload import PayloadCodec
        from locomm.peer.transport.gossip import Faults, Gossip
        from locomm.peer.transport.rpc import Limits, RpcServer

        self.p2p = await P2P.create(initial_peers=initial_peers or None, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.me = self.p2p.peer_id.to_base58()
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="locomm-codec")  # as node.py
        shapes = {f"t{i}": (TENSOR_NUMEL,) for i in range(N_TENSORS)}
        codec = PayloadCodec(shapes, {"theta": "parameter"}, {"parameter": self.codec_name})
        limits = Limits()
        server = RpcServer(self.p2p, RUN_ID, limits, self.pool, authorize=None)  # everyone allowed
        self.gossip = Gossip(
            self.p2p,
            server,
            run_id=RUN_ID,
            me=self.me,
            codec=codec,
            limits=limits,
            faults=Faults(100),
            max_body_bytes=1 << 30,
            streams=self.streams,
            parallel_threshold=16 << 20,
        )
        await server.add(self.gossip.service())
        if hasattr(codec, "warm_up"):
            codec.warm_up()  # numba compiles on first use (the warm-up round would pay it otherwise)
        _count_streams(gossip_mod)
        _OPENED[id(self.p2p)] = self
        self.payload = theta(self.idx)
        return self.me

    async def maddrs(self) -> list[str]:
        return [str(m) for m in await self.p2p.get_visible_maddrs()]

    async def exchange(self, r: int, other: str) -> dict[str, Any]:
        self.gossip.advance(r)
        s0, o0 = self.gossip.stats.bytes_sent, self.opened
        got = await self.gossip.exchange(r, [other], self.payload)
        t_end = time.perf_counter()
        return {
            "t_end": t_end,
            "got": got.get(other),
            "sent": self.gossip.stats.bytes_sent - s0,
            "streams": self.opened - o0,
        }

    async def close(self) -> None:
        if self.p2p is not None:
            with contextlib.suppress(Exception):
                await self.p2p.shutdown()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


class RawPeer(GossipPeer):
    """The ceiling: the same bytes through the same p2pd daemons on plain binary streams, no framing, no codec,
    no deadlines (``streams`` streams per direction, 1 MiB writes, reads into one preallocated buffer)."""

    async def start(self, initial_peers: list[str] | None) -> str:
        import asyncio

        from hivemind.p2p import P2P

        self.p2p = await P2P.create(initial_peers=initial_peers or None, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.me = self.p2p.peer_id.to_base58()
        self.inbox: dict[int, bytearray] = {}
        self.filled: dict[int, int] = {}
        self.arrived = asyncio.Condition()

        async def handler(_info: Any, reader: Any, writer: Any) -> None:
            r, off, n = (int(x) for x in (await reader.readline()).split())
            buf = self.inbox.setdefault(r, bytearray(PAYLOAD_BYTES))
            view = memoryview(buf)
            got = 0
            while got < n:
                chunk = await reader.read(min(1 << 20, n - got))
                if not chunk:
                    raise ConnectionError("raw stream ended early")
                view[off + got : off + got + len(chunk)] = chunk
                got += len(chunk)
            writer.write(b"ok")
            await writer.drain()
            writer.close()
            async with self.arrived:
                self.filled[r] = self.filled.get(r, 0) + n
                self.arrived.notify_all()

        await self.p2p.add_binary_stream_handler("bench.raw", handler)
        import torch

        self.payload = theta(self.idx)
        self.blob = memoryview(torch.cat(list(self.payload.values())).numpy()).cast("B")
        return self.me

    async def exchange(self, r: int, other: str) -> dict[str, Any]:
        import asyncio

        from hivemind.p2p import PeerID

        size = -(-PAYLOAD_BYTES // self.streams)

        async def send(off: int) -> None:
            n = min(size, PAYLOAD_BYTES - off)
            _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(other), "bench.raw")
            self.opened += 1
            writer.write(f"{r} {off} {n}\n".encode())
            for o in range(off, off + n, 1 << 20):
                writer.write(self.blob[o : min(off + n, o + (1 << 20))])
                await writer.drain()
            await reader.readexactly(2)
            writer.close()

        o0 = self.opened
        await asyncio.gather(*(send(off) for off in range(0, PAYLOAD_BYTES, size)))
        async with self.arrived:
            await self.arrived.wait_for(lambda: self.filled.get(r, 0) >= PAYLOAD_BYTES)
        t_end = time.perf_counter()
        import torch

        flat = torch.frombuffer(self.inbox.pop(r), dtype=torch.float32)
        got, k = {}, 0
        for name in sorted(self.payload, key=lambda n: int(n.rsplit("t", 1)[1])):
            got[name] = flat[k : k + TENSOR_NUMEL]
            k += TENSOR_NUMEL
        return {"t_end": t_end, "got": got, "sent": PAYLOAD_BYTES, "streams": self.opened - o0}


def make_peer(idx: int, codec_name: str, streams: int) -> GossipPeer:
    return (RawPeer if codec_name == RAW else GossipPeer)(idx, codec_name, streams)


def _same(got: Any, want: dict[str, Any]) -> bool:
    import torch

    return got is not None and set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def gossip_peer_process(conn: Any, idx: int, codec_name: str, streams: int, loop: str) -> None:
    """A peer in a process of its own (layout "split"): driven over a pipe, one round per "go"."""
    import asyncio

    async def main() -> None:
        peer = make_peer(idx, codec_name, streams)
        try:
            initial = await asyncio.to_thread(conn.recv)
            conn.send((await peer.start(initial), await peer.maddrs()))
            other = await asyncio.to_thread(conn.recv)
            want = theta(1 - idx)
            while True:
                msg = await asyncio.to_thread(conn.recv)
                if msg[0] == "stop":
                    break
                _, r, t_start = msg
                await asyncio.sleep(max(0.0, t_start - time.perf_counter()))
                res = await peer.exchange(r, other)
                ok = _same(res.pop("got"), want)  # bit-exact (outside the timing)
                conn.send({**res, "ok": ok})
        finally:
            await peer.close()

    run_loop(main(), loop)


def bench_gossip(codec_name: str, streams: int, warmup: int, reps: int, layout: str, loop: str) -> dict[str, Any]:
    """Rounds of a symmetric 2-peer exchange; round time = from the common start to the later peer's return."""
    times, sent, wire, used = [], [], [], []

    def record(r: int, t_start: float, results: list[dict[str, Any]], w0: int | None, w1: int | None) -> None:
        if not all(x["ok"] for x in results):
            raise RuntimeError(f"round {r}: a payload did not arrive or differs from what was sent")
        used.append(statistics.mean(x["streams"] for x in results))  # per push (no pulls, no retries here)
        if r >= warmup:
            times.append(max(x["t_end"] for x in results) - t_start)
            sent.append(statistics.mean(x["sent"] for x in results))
            if w0 is not None and w1 is not None:
                wire.append((w1 - w0) / 2)

    if layout == "split":
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(2)]
        procs = [
            ctx.Process(target=gossip_peer_process, args=(child, i, codec_name, streams, loop), daemon=True)
            for i, (_, child) in enumerate(pipes)
        ]
        conns = [mine for mine, _ in pipes]
        try:
            for p in procs:
                p.start()
            conns[0].send(None)
            id0, maddrs0 = conns[0].recv()
            conns[1].send(maddrs0)
            id1, _ = conns[1].recv()
            conns[0].send(id1)
            conns[1].send(id0)
            for r in range(warmup + reps):
                w0 = lo_tx_bytes()
                t_start = time.perf_counter() + 0.2
                for c in conns:
                    c.send(("go", r, t_start))
                results = [c.recv() for c in conns]
                record(r, t_start, results, w0, lo_tx_bytes())
            for c in conns:
                c.send(("stop",))
            for p in procs:
                p.join(30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
    else:
        import asyncio

        async def main() -> None:
            peers = [make_peer(i, codec_name, streams) for i in range(2)]
            try:
                ids = [await peers[0].start(None)]
                ids.append(await peers[1].start(await peers[0].maddrs()))
                want = [theta(1), theta(0)]
                for r in range(warmup + reps):
                    w0 = lo_tx_bytes()
                    t_start = time.perf_counter()
                    results = await asyncio.wait_for(
                        asyncio.gather(peers[0].exchange(r, ids[1]), peers[1].exchange(r, ids[0])), 300
                    )
                    w1 = lo_tx_bytes()
                    for x, w in zip(results, want):
                        x["ok"] = _same(x.pop("got"), w)
                    record(r, t_start, results, w0, w1)
            finally:
                for p in reversed(peers):
                    await p.close()

        run_loop(main(), loop)
    if codec_name == RAW:
        return {
            "method": f"ceiling: raw p2pd binary streams (streams={streams})",
            "kind": "ceiling",
            "codec": "none, no framing",
            "layout": layout,
            "loop": loop,
            "streams_configured": streams,
            "streams_used": max(used),
            "median_s": statistics.median(times),
            "all_s": times,
            "bytes_sent_per_round": statistics.mean(sent),
            "wire_bytes_per_round": statistics.mean(wire) if wire else None,
        }
    return {
        "method": f"locomm Gossip.exchange ({codec_name}, streams={streams})",
        "kind": "locomm",
        "codec": codec_name,
        "layout": layout,
        "loop": loop,
        "streams_configured": streams,
        "streams_used": max(used),
        "streams_used_per_round": used,
        "parallel_threshold_bytes": 16 << 20,
        "median_s": statistics.median(times),
        "all_s": times,
        "bytes_sent_per_round": statistics.mean(sent),
        "wire_bytes_per_round": statistics.mean(wire) if wire else None,
    }


# ------------------------------------------------------------------- hivemind DecentralizedAverager (child)


def bench_averager(warmup: int, reps: int) -> dict[str, Any]:
    import hivemind
    import torch
    from hivemind.averaging.control import AveragingStage

    data = [list(theta(i).values()) for i in range(2)]
    want = [(x + y) / 2 for x, y in zip(*data)]
    dhts: list[Any] = []
    avgs: list[Any] = []
    times, allreduce, wire = [], [], []
    try:
        d1 = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        dhts.append(d1)
        dhts.append(
            hivemind.DHT(
                start=True,
                initial_peers=[str(m) for m in d1.get_visible_maddrs()],
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            )
        )
        for i, d in enumerate(dhts):
            avgs.append(
                hivemind.averaging.DecentralizedAverager(
                    [t.clone() for t in data[i]],
                    dht=d,
                    prefix="bench",
                    target_group_size=2,
                    min_group_size=2,
                    start=True,
                )
            )
        for r in range(warmup + reps):
            for av, tensors in zip(avgs, data):  # every round averages the same two payloads
                with av.get_tensors() as local:
                    for dst, src in zip(local, tensors):
                        dst.copy_(src)
            w0 = lo_tx_bytes()
            t0 = time.perf_counter()
            controls = [av.step(timeout=120, wait=False) for av in avgs]
            t_ar = None
            while not all(c.done() for c in controls):
                if t_ar is None and any(
                    c.stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED) for c in controls
                ):
                    t_ar = time.perf_counter()
                time.sleep(0.001)
            dt = time.perf_counter() - t0
            w1 = lo_tx_bytes()
            if not all(c.result() for c in controls):
                raise RuntimeError(f"round {r}: an averager step failed")
            for av in avgs:
                with av.get_tensors() as local:
                    if not all(torch.allclose(x, y, atol=1e-6) for x, y in zip(local, want)):
                        raise RuntimeError(f"round {r}: the averaged tensors are wrong")
            if r >= warmup:
                times.append(dt)
                allreduce.append(dt - ((t_ar or t0) - t0))
                if w0 is not None and w1 is not None:
                    wire.append((w1 - w0) / 2)
    finally:
        for av in avgs:
            with contextlib.suppress(Exception):
                av.shutdown()
        for d in reversed(dhts):
            with contextlib.suppress(Exception):
                d.shutdown()
    # Butterfly all-reduce of 2 equal peers: each sends the half the other reduces, then returns its own half
    # averaged: the whole payload's bytes per peer per step (fp32, hivemind's default NoCompression).
    return {
        "method": "hivemind DecentralizedAverager.step",
        "kind": "averager",
        "codec": "none (NoCompression)",
        "median_s": statistics.median(times),
        "all_s": times,
        "allreduce_median_s": statistics.median(allreduce),
        "allreduce_all_s": allreduce,
        "matchmaking_median_s": statistics.median(t - a for t, a in zip(times, allreduce)),
        "bytes_sent_per_round": PAYLOAD_BYTES,
        "bytes_sent_source": "arithmetic (butterfly all-reduce, 2 peers)",
        "wire_bytes_per_round": statistics.mean(wire) if wire else None,
    }


def child_main(spec: dict[str, Any]) -> None:
    if os.environ.get(NETNS_ENV) == "1":
        _lo_up()
    if spec["kind"] == "averager":
        row = bench_averager(spec["warmup"], spec["reps"])
    else:
        row = bench_gossip(spec["codec"], spec["streams"], spec["warmup"], spec["reps"], spec["layout"], spec["loop"])
    print("ROW " + json.dumps(row), flush=True)


# ------------------------------------------------------------------------------ orchestration


def run_child(spec: dict[str, Any], netns: list[str], timeout: float = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """One row in a child process of its own session; its whole process group is killed afterwards."""
    env = {**os.environ, NETNS_ENV: "1" if netns else "0"}
    load0 = os.getloadavg()[0]
    proc = subprocess.Popen(
        [*netns, sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", f"timed out after {timeout:.0f} s"
    finally:
        with contextlib.suppress(Exception):
            os.killpg(proc.pid, signal.SIGKILL)  # p2pd daemons and averager processes share the group
        with contextlib.suppress(Exception):
            proc.communicate(timeout=10)
    rows = [line[4:] for line in out.splitlines() if line.startswith("ROW ")]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"{spec}: child failed (rc {proc.returncode}): {err[-3000:]}")
    row = json.loads(rows[-1])
    row["load_avg_1m"] = [load0, os.getloadavg()[0]]  # before, after: other work on this machine
    return row


def _merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the same row's passes: medians over every timed round of every pass."""
    row = dict(runs[-1])
    row["all_s"] = [t for r in runs for t in r["all_s"]]
    row["median_s"] = statistics.median(row["all_s"])
    row["pass_medians_s"] = [r["median_s"] for r in runs]
    row["load_avg_1m"] = [r["load_avg_1m"] for r in runs]
    if "allreduce_all_s" in row:
        row["allreduce_all_s"] = [t for r in runs for t in r["allreduce_all_s"]]
        row["allreduce_median_s"] = statistics.median(row["allreduce_all_s"])
        row["matchmaking_median_s"] = statistics.median(
            t - a for r in runs for t, a in zip(r["all_s"], r["allreduce_all_s"])
        )
    for key in ("bytes_sent_per_round", "wire_bytes_per_round"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        row[key] = statistics.mean(vals) if vals else None
    return row


def bench_exchange(
    warmup: int,
    reps: int,
    streams: list[int],
    codecs: list[str],
    layouts: list[str],
    loop: str,
    ceiling: bool = True,
    passes: int = 2,
) -> dict[str, Any]:
    """Every row, ``passes`` times over (the averager row first in each pass), so that a change in the machine's
    other load lands on every row alike; a row's figure is the median over all its timed rounds."""
    netns = netns_prefix()
    specs: list[dict[str, Any]] = [{"kind": "averager", "warmup": warmup, "reps": reps}]
    for layout in layouts:
        for codec in [*codecs, *([RAW] if ceiling else [])]:
            for s in streams if codec != RAW else [max(streams)]:
                specs.append(
                    {
                        "kind": "gossip",
                        "codec": codec,
                        "streams": s,
                        "warmup": warmup,
                        "reps": reps,
                        "layout": layout,
                        "loop": loop,
                    }
                )
    runs: list[list[dict[str, Any]]] = [[] for _ in specs]
    for k in range(passes):
        for spec, acc in zip(specs, runs):
            row = run_child(spec, netns)
            if spec.get("layout", "split") != "split":
                row["method"] += f" [{spec['layout']} loop]"
            acc.append(row)
            print(
                f"  pass {k + 1}/{passes} {row['method']}: median {row['median_s']:.3f} s", file=sys.stderr, flush=True
            )
    rows = [_merge(acc) for acc in runs]
    base, base_ar = rows[0]["median_s"], rows[0]["allreduce_median_s"]
    for r in rows:
        r["effective_MBps"] = PAYLOAD_BYTES / 1e6 / r["median_s"]
        if r["kind"] == "locomm":
            r["averager_s_over_locomm_s"] = base / r["median_s"]
            r["averager_allreduce_s_over_locomm_s"] = base_ar / r["median_s"]
        elif r["kind"] == "ceiling":
            r["averager_s_over_ceiling_s"] = base / r["median_s"]
    loc = [r for r in rows if r["kind"] == "locomm"]
    best = min(loc, key=lambda r: r["median_s"])
    return {
        "rows": rows,
        "netns_isolated": bool(netns),
        "target": {
            "min_speedup": TARGET_SPEEDUP,
            "best_row": best["method"],
            "best_speedup": best["averager_s_over_locomm_s"],
            "met": best["averager_s_over_locomm_s"] >= TARGET_SPEEDUP,
            "met_by": [r["method"] for r in loc if r["averager_s_over_locomm_s"] >= TARGET_SPEEDUP],
        },
    }


def first_heartbeat() -> dict[str, Any]:
    # Killed as a group at once when done or past 300 s; the peer's environment is this script's.
    with (
        tempfile.TemporaryDirectory() as d,
        Launcher(d, grace_s=0.0, stop_signal=signal.SIGKILL, threads=None) as peers,
    ):
        p = peers.start("p", "--preset", "nano", "--rounds", "1", "--inner-steps", "5", announce=False)
        p.wait(timeout=300)
        started = p.events("started")[0]
        return {
            "launch_to_first_heartbeat_s": started["first_heartbeat_at"] - p.started_at,
            "node_start_to_first_heartbeat_s": started["first_heartbeat_s"],
        }


def overlap(peers: int, rounds: int) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "locomm.cli.main",
            "swarm",
            "--peers",
            str(peers),
            "--rounds",
            str(rounds),
            "--inner-steps",
            "50",
            "--preset",
            "nano",
            "--json",
            "--plot",
            str(Path(tempfile.gettempdir()) / "locomm-exchange-bench.png"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_table(ex: dict[str, Any]) -> None:
    print(
        "| method | streams used | median s per 100 MiB exchange | effective MB/s | bytes sent / peer "
        "| wire bytes / peer | averager_s / locomm_s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in ex["rows"]:
        wire = f"{r['wire_bytes_per_round'] / 1e6:.1f} MB" if r.get("wire_bytes_per_round") else "n/a"
        ratio = {
            "locomm": f"{r.get('averager_s_over_locomm_s', 0):.2f}x",
            "ceiling": f"({r.get('averager_s_over_ceiling_s', 0):.2f}x)",
        }.get(r["kind"], "1.00x")
        print(
            f"| {r['method']} | {r.get('streams_used', '-')} | {r['median_s']:.3f} | {r['effective_MBps']:.0f} "
            f"| {r['bytes_sent_per_round'] / 1e6:.1f} MB | {wire} | {ratio} |"
        )
    av = ex["rows"][0]
    print(
        f"(averager step = {av['matchmaking_median_s']:.3f} s matchmaking + {av['allreduce_median_s']:.3f} s "
        f"all-reduce)"
    )
    ceil = [r for r in ex["rows"] if r["kind"] == "ceiling"]
    if ceil:
        print(
            f"(ceiling: the same bytes on raw p2pd streams take {ceil[0]['median_s']:.3f} s, "
            f"{ceil[0]['averager_s_over_ceiling_s']:.2f}x less than the averager step: about the most an exchange "
            f"that moves every fp32 byte through these daemons can gain)"
        )
    t = ex["target"]
    print(
        f"target locomm >= {t['min_speedup']:.0f}x faster than one averager step: "
        f"{'MET' if t['met'] else 'NOT MET'} (best {t['best_speedup']:.2f}x, {t['best_row']})"
    )


def main() -> None:
    ap = _harness.parser(__doc__, out="exchange.json", summary=True)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=4, help="timed rounds per row and pass (>= 3)")
    ap.add_argument("--passes", type=int, default=2, help="sweeps over all rows (medians over all passes)")
    ap.add_argument("--streams", default="1,4", help="streams_per_transfer values, one row each")
    ap.add_argument("--codecs", default="none,lossless")
    ap.add_argument(
        "--layouts",
        default="split",
        help="split: each locomm peer in a process of its own (as real peers, and as the averagers); "
        "shared: both peers on one event loop in one process (the previous script's layout)",
    )
    ap.add_argument("--no-ceiling", action="store_true", help="skip the raw p2pd stream row")
    ap.add_argument(
        "--loop",
        choices=["uvloop", "asyncio"],
        default="uvloop",
        help="locomm peers' event loop (the daemon uses uvloop when installed; so does hivemind)",
    )
    ap.add_argument(
        "--only",
        choices=["exchange", "heartbeat", "swarm"],
        action="append",
        help="measure only these (repeatable); the others' keys are kept from the existing JSON",
    )
    a = ap.parse_args()
    if a.child:
        child_main(json.loads(a.child))
        return
    # SIGTERM / SIGHUP unwind like Ctrl-C, so every row's process group is still killed on the way out.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    if a.reps < 3:
        ap.error("--reps must be >= 3")
    parts = a.only or ["exchange", "heartbeat", "swarm"]
    result: dict[str, Any] = {}
    if a.only and a.out.exists():
        result = _harness.read_json(a.out)
    if "exchange" in parts:
        ex = bench_exchange(
            a.warmup,
            a.reps,
            [int(s) for s in a.streams.split(",")],
            a.codecs.split(","),
            a.layouts.split(","),
            a.loop,
            ceiling=not a.no_ceiling,
            passes=a.passes,
        )
        print_table(ex)
        result.update(
            {
                "exchange": ex["rows"],
                "target": ex["target"],
                "setup": {
                    "payload": f"NoLoCo theta, {N_TENSORS} fp32 tensors of {TENSOR_NUMEL} values",
                    "payload_bytes": PAYLOAD_BYTES,
                    "peers": 2,
                    "warmup_rounds": a.warmup,
                    "timed_rounds": a.reps,
                    "passes": a.passes,
                    "netns_isolated": ex["netns_isolated"],
                    "cpus": os.cpu_count(),
                    "load_avg_at_end": os.getloadavg(),
                    "python": platform.python_version(),
                },
            }
        )
    if "heartbeat" in parts:
        hb = first_heartbeat()
        print(
            f"\nlaunch -> first heartbeat: {hb['launch_to_first_heartbeat_s']:.2f} s "
            f"(of which node start-up {hb['node_start_to_first_heartbeat_s']:.2f} s; the rest is Python imports)"
        )
        result["first_heartbeat"] = hb
    if "swarm" in parts:
        sw = overlap(3, 6)
        print(
            f"NoLoCo H=50, 3 peers on loopback: compute waited on the network {100 * sw['wait_fraction']:.1f}% of "
            f"wall-clock ({sw['rounds_completed']} rounds, loss {sw['initial_loss']:.3f} -> {sw['final_loss']:.3f})"
        )
        result["swarm"] = sw
    _harness.write_json(a.out, result)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
