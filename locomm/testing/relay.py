"""A bare libp2p relay: one hivemind p2pd with the circuit-relay (v2) service and nothing else.

    python -m locomm.testing.relay --host-maddr /ip4/11.77.3.10/tcp/0 --out relay.txt

Writes its multiaddrs (``/p2p/<id>`` included), one a line, to ``--out`` once it is up and has carried a
probe through a relayed connection, then serves until SIGINT/SIGTERM. benchmarks/links.py starts a few on
the open hosts for small NAT runs: go-libp2p's auto-relay (as p2pd runs it, with relay discovery on;
hivemind has no switch to turn it off) waits for 4 relay candidates, or 3 minutes, before it reserves a
slot, and a 4-peer swarm with 2 open peers has 2.

**Why the probe.** hivemind 1.1.12's p2pd runs two circuit-relay services on one host: the one its
``-relayDataLimit`` / ``-relayTimeLimit`` flags configure (4 GiB and 30 min per relayed connection, started by
go-libp2p's relay manager when the host is public), and a second one its ``EnableRelayV2`` starts with
go-libp2p's ``DefaultResources()``: 128 KiB per direction and 2 minutes per relayed connection. Both register
the hop protocol; the one registered last serves it. With ``force_reachability="public"`` the two start
microseconds apart, and the limited one wins about 1 start in 4 here (13 of 46, docs/results/nat.md): every
relayed connection through it is reset after exactly 131072 bytes each way (its log: ``relayed 131072
bytes``), a new one gets another 128 KiB, and a nano payload (~0.4 MB) never gets through. So before
announcing itself the relay checks which one serves: a private node reserves a slot on it (a static relay, no
listen address, so the relay is its only route) and another sends it ``PROBE_BYTES`` (twice the default
budget) through the circuit. A relay that cuts it is restarted (a new identity and port), at most ``--tries``
times; a probe that gets nothing through (a probe node's p2pd failing to start or dial, or no answer within
``--probe-timeout``) is repeated, then the relay restarted too. When no start carries it, the relay exits with
an error and writes no ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

PROBE_BYTES = 1 << 18
"""Sent through the relay by the probe: twice go-libp2p's default budget of 128 KiB per direction."""
PROBE_HANDLER = "locomm-relay-probe"
PROBE_ATTEMPTS = 3
"""Probes per start while none gets a byte through (a probe node's p2pd failing to start or to dial)."""
CHUNK = 1 << 16


def _log(msg: str) -> None:
    print(f"relay: {msg}", file=sys.stderr, flush=True)


def _static_relay_p2p() -> Any:
    """hivemind's P2P whose auto-relay uses only its trusted relays (p2pd ``-relayDiscovery=0``): it reserves at
    once instead of waiting for 4 candidates. Only for the probe's private node."""
    from hivemind.p2p import P2P  # noqa: PLC0415 - the module's --help stays light

    class StaticRelayP2P(P2P):
        @staticmethod
        def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
            return P2P._make_process_args(*args, **kwargs, relayDiscovery=0)

    return StaticRelayP2P


async def probe(relay: str, nbytes: int = PROBE_BYTES) -> tuple[int, str]:
    """Bytes one relayed connection through ``relay`` (a multiaddr with ``/p2p/<id>``) carried of ``nbytes``,
    and what happened. A private node without listen addresses reserves a slot on the relay; a second one,
    also without listen addresses (nothing to dial or hole-punch directly), streams ``nbytes`` to it."""
    from hivemind.p2p import P2P  # noqa: PLC0415

    got = asyncio.get_running_loop().create_future()

    async def sink(_: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0  # p2pd streams have no half-close: read the known size, then answer
        try:
            while n < nbytes and (chunk := await reader.read(min(CHUNK, nbytes - n))):
                n += len(chunk)
            writer.write(str(n).encode())
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if not got.done():
                got.set_result(n)

    nodes: list[Any] = []
    sent, reply = 0, b""
    try:
        target = await _static_relay_p2p().create(
            initial_peers=[relay],
            host_maddrs=(),
            no_listen=True,
            use_relay=True,
            use_auto_relay=True,
            force_reachability="private",
            trusted_relays=[relay],
        )
        nodes.append(target)
        await target.add_binary_stream_handler(PROBE_HANDLER, sink)
        while True:  # its reservation: a relayed address to announce
            with contextlib.suppress(ValueError):  # hivemind raises while there is no address at all
                if any("p2p-circuit" in str(m) for m in await target.get_visible_maddrs(latest=True)):
                    break
            await asyncio.sleep(0.2)
        # the target's relayed address as a bootstrap peer too: p2pd dials it at start, no DHT lookup needed
        circuit = f"{relay}/p2p-circuit/p2p/{target.peer_id}"
        dialer = await P2P.create(initial_peers=[relay, circuit], host_maddrs=(), no_listen=True, use_relay=True)
        nodes.append(dialer)
        for wait in (0.5, 1.0, 2.0, None):  # if that dial failed, a DHT lookup, which may come up empty at first
            try:
                _, reader, writer = await dialer.call_binary_stream_handler(target.peer_id, PROBE_HANDLER)
                break
            except Exception:  # noqa: BLE001 - hivemind's ControlFailure, or a dial error
                if wait is None:
                    raise
                await asyncio.sleep(wait)
        block = bytes(CHUNK)
        while sent < nbytes:
            writer.write(block[: min(CHUNK, nbytes - sent)])
            await writer.drain()
            sent += min(CHUNK, nbytes - sent)
        reply = await reader.read(32)
        writer.close()
        what = f"the sink answered {reply!r}"
    except Exception as e:  # noqa: BLE001 - p2pd fails in many ways (start, dial, reset); the caller probes again
        what = f"{type(e).__name__}: {e}"
    finally:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(got), 2 if sent else 0.01)  # what the sink had when it stopped
        for node in nodes:
            with contextlib.suppress(Exception):
                await node.shutdown()
    n = got.result() if got.done() else 0
    return n, "ok" if n == nbytes and reply == str(n).encode() else f"{what} after {sent} sent"


async def serve(host_maddr: str, out: Path, tries: int, probe_timeout: float) -> int:
    from hivemind.p2p import P2P  # noqa: PLC0415

    for k in range(1, tries + 1):
        p2p = await P2P.create(
            host_maddrs=[host_maddr], use_relay=True, use_auto_relay=False, force_reachability="public"
        )
        try:
            maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
            n = 0
            for attempt in range(1, PROBE_ATTEMPTS + 1):
                t0 = time.monotonic()
                try:
                    n, what = await asyncio.wait_for(probe(maddrs[0]), probe_timeout)
                except TimeoutError:
                    n, what = 0, f"no answer within {probe_timeout:g} s"
                dt = time.monotonic() - t0
                _log(f"start {k}/{tries}, probe {attempt}: {n} of {PROBE_BYTES} bytes in {dt:.1f} s: {what}")
                if n > 0:  # through the relay: all of it, or cut at its limit (no point in probing it again)
                    break
            if n < PROBE_BYTES and k < tries:
                continue  # a new start (identity, port): the relay with the wider limits may win this time
            if n < PROBE_BYTES:  # the probe itself can fail alike on every start (seen: 96 KiB in all 8)
                _log(f"no start of {tries} carried {PROBE_BYTES} bytes; announcing the last one unchecked")
            tmp = out.with_suffix(".tmp")
            tmp.write_text("\n".join(maddrs) + "\n")
            os.replace(tmp, out)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
            return 0
        finally:
            with contextlib.suppress(Exception):
                await p2p.shutdown()
    return 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-maddr", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tries", type=int, default=8, help="Starts to try before announcing one unchecked (default 8)")
    ap.add_argument("--probe-timeout", type=float, default=30.0, help="Seconds per probe (default 30)")
    args = ap.parse_args()
    sys.exit(asyncio.run(serve(args.host_maddr, args.out, args.tries, args.probe_timeout)))


if __name__ == "__main__":
    main()
