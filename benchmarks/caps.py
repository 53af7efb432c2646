"""Traffic caps measured on the wire: a capped sender's veth, sampled every second, in network namespaces.

Two hosts on one unshaped bridge (locomm/testing/netlab.py), each running a real p2pd:

- ``--level rpc`` (default): an RpcServer on each side, the exchange layer and nothing else. The receiver
  serves a ``sink`` service (reads what it is sent under the ordinary deadlines of ``[network]``, answers
  OK); the sender attaches ``Shaper(--cap, None)`` to its P2P through ``RpcServer(shaper=...)`` and pushes
  ``--streams`` parallel links back to back for ``--seconds``, every link opened by ``rpc.open_link`` (so
  it picks the shaper up from its P2P, as gossip's pushes do). Then the same without a cap, for contrast.
- ``--level peer``: ``locomm-peer join`` peers (``--peers``, ``--config``), peer 0 started with
  ``--max-upload-mbit --cap`` (``--direction down``: ``--max-download-mbit``, its veth's ``rx_bytes``); the same
  sampling on peer 0's veth. Needs the host to hand
  ``Shaper(opts.max_upload_mbit, ...)`` to its RpcServer.

The sampler reads ``/sys/class/net/eth0/statistics/tx_bytes`` in the sender's namespace every second
(wire bytes: Ethernet, IP, TCP, noise and yamux framing on top of what the shaper counts); the result is
the mean rate over the busiest ``--window`` seconds and its ratio to the cap.

    sudo .venv/bin/python benchmarks/caps.py                      # 20 Mbit/s, 4 streams, 80 s; then uncapped
    sudo .venv/bin/python benchmarks/caps.py --level peer --config benchmarks/configs/links-56m.toml
Output: benchmarks/results/caps.json (``--out``); one entry per case (``capped``, ``uncapped``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _harness

RUN = "capsbench0000000"
PIECE = 1 << 20


# ------------------------------------------------------------------------------ in a namespace


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def receiver(ip: str) -> None:
    """p2pd on ``ip`` and an RpcServer serving ``sink``; prints its address, then (on SIGINT) its counts."""
    from hivemind.p2p import P2P  # noqa: PLC0415

    from locomm.config.distributed import NetworkConfig  # noqa: PLC0415
    from locomm.peer.transport.rpc import Limits, RpcServer, Service  # noqa: PLC0415

    p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"])
    with ThreadPoolExecutor(1) as pool:
        server = RpcServer(p2p, RUN, Limits.from_network(NetworkConfig()), pool)
        got = {"ok": 0, "bytes": 0}

        async def sink(call: Any) -> None:
            n, k = int(call.msg.fields["nbytes"]), int(call.msg.fields["streams"])
            call.link.expect(n, k)  # the deadlines a partner holds a k-stream push to
            done = 0
            while done < n:
                done += len(await call.link.read_part(PIECE))
            got["ok"] += 1
            got["bytes"] += done
            await call.answer()

        await server.add(Service("sink", {"sink": sink}))
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        print(json.dumps({"maddrs": maddrs}), flush=True)
        await _until_signalled()
        print(json.dumps({**got, "cut": server.stats.cut, "errors": dict(server.stats.errors_answered)}), flush=True)
    await p2p.shutdown()


async def sender(ip: str, target: str, cap: float | None, seconds: float, streams: int, per_stream: int) -> None:
    """Pushes of ``streams`` parallel links of ``per_stream`` bytes to ``target``, back to back, for ``seconds``."""
    from hivemind.p2p import P2P  # noqa: PLC0415

    from locomm.config.distributed import NetworkConfig  # noqa: PLC0415
    from locomm.peer.transport.rpc import Limits, RpcServer, open_link  # noqa: PLC0415
    from locomm.peer.transport.shaper import Shaper  # noqa: PLC0415
    from locomm.protocol.messages import envelope  # noqa: PLC0415

    p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=[target])
    me, peer = p2p.peer_id.to_base58(), target.rsplit("/p2p/", 1)[1]
    limits = Limits.from_network(NetworkConfig())
    shaper = Shaper(cap, None)
    outcomes: dict[str, int] = {}
    data = os.urandom(PIECE)
    with ThreadPoolExecutor(1) as pool:
        server = RpcServer(p2p, RUN, limits, pool, shaper=shaper)  # attaches the shaper to p2p
        shaper.check(NetworkConfig())
        handler = server.handler_name("sink")

        async def lane() -> str:
            link = await open_link(p2p, peer, handler, limits, "send", streams)
            try:
                await link.write_header(envelope(RUN, "sink", 0, me, nbytes=per_stream, streams=streams))
                link.expect(per_stream, streams)
                for _ in range(per_stream // PIECE):
                    await link.write_part(data)
                code, _ = await link.read_answer()
                return code.name
            finally:
                link.writer.close()

        t0 = time.monotonic()
        print(json.dumps({"start": time.time()}), flush=True)
        while time.monotonic() - t0 < seconds:
            for r in await asyncio.gather(*(lane() for _ in range(streams)), return_exceptions=True):
                key = r if isinstance(r, str) else type(r).__name__
                outcomes[key] = outcomes.get(key, 0) + 1
        elapsed = time.monotonic() - t0
        granted = shaper.up.granted if shaper.up is not None else None
        print(json.dumps({"elapsed_s": elapsed, "granted": granted, "outcomes": outcomes}), flush=True)
    await p2p.shutdown()


# ------------------------------------------------------------------------------ the bench


def tx_bytes(host: Any, counter: str = "tx_bytes") -> int:
    return int(host.run(["cat", f"/sys/class/net/eth0/statistics/{counter}"], timeout=10).stdout)


def busiest(samples: list[tuple[float, int]], window: float) -> dict[str, Any] | None:
    """The mean rate over the busiest ``window`` seconds of ``(t, tx_bytes)`` samples (and the per-second ones)."""
    best = None
    j = 0
    for i, (t0, b0) in enumerate(samples):
        j = max(j, i)
        while j < len(samples) and samples[j][0] - t0 < window:
            j += 1
        if j == len(samples):
            break
        t1, b1 = samples[j]
        rate = (b1 - b0) * 8 / (t1 - t0)
        if best is None or rate > best["mbit"] * 1e6:
            best = {"mbit": rate / 1e6, "from_s": t0 - samples[0][0], "span_s": t1 - t0, "bytes": b1 - b0}
    return best


def per_second(samples: list[tuple[float, int]]) -> list[float]:
    return [round((b1 - b0) * 8 / (t1 - t0) / 1e6, 3) for (t0, b0), (t1, b1) in zip(samples, samples[1:]) if t1 > t0]


def read_json_line(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited ({proc.returncode}); see its log")
            continue
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise TimeoutError("no JSON line in time")


def sample_until(host: Any, done: Any, limit_s: float, counter: str = "tx_bytes") -> list[tuple[float, int]]:
    samples = [(time.monotonic(), tx_bytes(host, counter))]
    end = samples[0][0] + limit_s
    while not done() and time.monotonic() < end:
        nxt = samples[-1][0] + 1.0
        time.sleep(max(0.0, nxt - time.monotonic()))
        samples.append((time.monotonic(), tx_bytes(host, counter)))
    return samples


def rpc_case(lab: Any, args: Any, cap: float | None, seconds: float) -> dict[str, Any]:
    rx, tx = lab.hosts["rx"], lab.hosts["tx"]
    me = [sys.executable, str(Path(__file__).resolve())]
    logs = Path(args.workdir)
    logs.mkdir(parents=True, exist_ok=True)
    tag = "capped" if cap else "uncapped"

    def pipes(who: str) -> dict[str, Any]:
        return {"stdout": subprocess.PIPE, "stderr": open(logs / f"{tag}-{who}.log", "w"), "text": True}  # noqa: SIM115

    rxp = rx.popen([*me, "--role", "rx", "--ip", rx.ip], **pipes("rx"))
    maddrs = read_json_line(rxp, 60)["maddrs"]
    target = next(m for m in maddrs if f"/ip4/{rx.ip}/" in m)
    cmd = [*me, "--role", "tx", "--ip", tx.ip, "--target", target, "--seconds", str(seconds)]
    cmd += ["--streams", str(args.streams), "--per-stream-mb", str(args.per_stream_mb)]
    txp = tx.popen([*cmd, "--cap", str(cap or 0)], **pipes("tx"))  # 0: no cap
    read_json_line(txp, 60)  # started pushing
    samples = sample_until(tx, lambda: txp.poll() is not None, seconds + 120)
    sent = read_json_line(txp, 30)
    rxp.send_signal(signal.SIGINT)
    got = read_json_line(rxp, 30)
    window = min(args.window, 0.75 * seconds)  # the uncapped contrast runs shorter than one window
    best = busiest(samples, window)
    row = {
        "cap_mbit": cap,
        "window_s": window,
        "streams": args.streams,
        "per_stream_mb": args.per_stream_mb,
        "seconds": seconds,
        "busiest_window": best,
        "ratio_to_cap": best["mbit"] / cap if best and cap else None,
        "app_mbit": sent["granted"] * 8 / sent["elapsed_s"] / 1e6 if sent.get("granted") else None,
        "sender": sent,
        "receiver": got,
        "per_second_mbit": per_second(samples),
    }
    return row


def last_json(path: Path) -> dict[str, Any] | None:
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.startswith("{")] if path.exists() else []
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def peer_case(lab: Any, args: Any, cap: float | None) -> dict[str, Any]:
    from locomm.config import RunSpec  # noqa: PLC0415
    from locomm.testing.launcher import Launcher  # noqa: PLC0415

    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="capped-" if cap else "uncapped-", dir=args.workdir))  # no old announce
    spec = RunSpec.load(args.config)
    spec.save(folder / "run.toml")
    hosts = [lab.hosts[f"p{i}"] for i in range(args.peers)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with Launcher(folder, grace_s=5.0, stop_signal=signal.SIGINT, threads=None, env=env, cwd=_harness.REPO) as peers:

        def launch(i: int, initial: str | None) -> Any:
            extra = [f"--max-{args.direction}load-mbit", str(cap)] if i == 0 and cap else []
            return peers.start(
                f"peer{i}",
                *("--until-round", str(args.rounds), "--shard", f"{i}/{args.peers}"),
                *("--wait-for-peers", str(args.peers), "--host-maddrs", f"/ip4/{hosts[i].ip}/tcp/0", "--json"),
                *extra,
                config=folder / "run.toml",
                device="cpu",
                initial_peers=initial,
                announce=initial is None,
                spawn=hosts[i].popen,
            )

        p0 = launch(0, None)
        boot = p0.address(timeout=180, ip=hosts[0].ip)
        rest = [launch(i, boot) for i in range(1, args.peers)]
        counter = "tx_bytes" if args.direction == "up" else "rx_bytes"
        samples = sample_until(hosts[0], lambda: p0.poll() is not None, args.timeout, counter)
        for p in rest:
            p.stop()
    best = busiest(samples, args.window)
    return {
        "cap_mbit": cap,
        "direction": args.direction,
        "peers": args.peers,
        "config": str(args.config),
        "rounds": args.rounds,
        "busiest_window": best,
        "ratio_to_cap": best["mbit"] / cap if best and cap else None,
        "per_second_mbit": per_second(samples),
        "peer0_exit": p0.returncode,
        "peer0_summary": last_json(folder / "peer0.out"),
        "folder": str(folder),
    }


def main() -> int:
    ap = _harness.parser(__doc__, out="caps.json")
    ap.add_argument("--role", choices=("bench", "rx", "tx"), default="bench", help=argparse_hidden())
    ap.add_argument("--level", choices=("rpc", "peer"), default="rpc")
    ap.add_argument(
        "--direction", choices=("up", "down"), default="up", help="peer: cap peer 0's upload or its download"
    )
    ap.add_argument("--cap", type=float, default=20.0, help="Upload cap of the sender, Mbit/s")
    ap.add_argument("--seconds", type=float, default=80.0, help="rpc: how long the capped sender pushes")
    ap.add_argument("--uncapped-seconds", type=float, default=20.0, help="rpc: how long the uncapped one pushes")
    ap.add_argument("--window", type=float, default=60.0, help="The busiest window reported, seconds")
    ap.add_argument("--streams", type=int, default=4, help="rpc: parallel links per push (sharing the cap)")
    ap.add_argument("--per-stream-mb", type=float, default=8.0, help="rpc: MiB each link carries per push")
    ap.add_argument("--ip", help=argparse_hidden())
    ap.add_argument("--target", help=argparse_hidden())
    ap.add_argument("--config", type=Path, default=_harness.HERE / "configs" / "links-56m.toml")
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="peer: the most a case runs, seconds")
    ap.add_argument("--workdir", default="/tmp/locomm-caps")
    ap.add_argument("--no-contrast", action="store_true", help="Skip the uncapped case")
    args = ap.parse_args()
    if args.role == "rx":
        asyncio.run(receiver(args.ip))
        return 0
    if args.role == "tx":
        per = int(args.per_stream_mb * PIECE) // PIECE * PIECE
        asyncio.run(sender(args.ip, args.target, args.cap or None, args.seconds, args.streams, per))
        return 0

    from locomm.testing import netlab  # noqa: PLC0415

    out: dict[str, Any] = {"level": args.level, "cap_mbit": args.cap, "window_s": args.window, "cases": {}}
    with netlab.Lab(grace_s=5.0) as lab:
        if args.level == "rpc":
            lab.add_host("rx")
            lab.add_host("tx")
        else:
            for i in range(args.peers):
                lab.add_host(f"p{i}")
        cases = [("capped", args.cap)] + ([] if args.no_contrast else [("uncapped", None)])
        for name, cap in cases:
            if args.level == "rpc":
                row = rpc_case(lab, args, cap, args.seconds if cap else args.uncapped_seconds)
            else:
                row = peer_case(lab, args, cap)
            out["cases"][name] = row
            b = row["busiest_window"]
            rate = f"{b['mbit']:.2f} Mbit/s over {b['span_s']:.1f} s" if b else "no full window"
            ratio = f" ({row['ratio_to_cap']:.3f} of the cap)" if row.get("ratio_to_cap") else ""
            print(f"caps: {name}: {rate}{ratio}", flush=True)
            _harness.write_json(args.out, out)
    print(json.dumps({k: v["busiest_window"] for k, v in out["cases"].items()}))
    return 0


def argparse_hidden() -> str:
    import argparse  # noqa: PLC0415

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
