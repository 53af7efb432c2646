"""A bare libp2p relay: one hivemind p2pd with the circuit-relay (v2) service and nothing else.

    python -m locomm.testing.relay --host-maddr /ip4/11.77.3.10/tcp/0 --out relay.txt

Writes its multiaddrs (``/p2p/<id>`` included), one a line, to ``--out`` once it is up and has carried a
probe through a relayed connection, then serves until SIGINT/SIGTERM. benchmarks/links.py starts a few on
the open hosts for small NAT runs: go-libp2p's auto-relay (as p2pd runs it, with relay discovery on;
hivemind has no switch to turn it off) waits for 4 relay candidates, or 3 minutes, before it reserves a
slot, and a 4-peer swarm with 2 open peers has 2.

**Why one Go thread and the probe.** p2pd runs two circuit-relay services, one of them limited to 128 KiB per
relayed connection, and which one serves is a race at start that Go's default thread count loses most of the
time (locomm/peer/transport/relay_check.py, docs/results/nat.md). So p2pd starts with ``GOMAXPROCS=1``
(``relay_check.one_go_thread``), which made the wide one serve in 22 of 22 measured starts, and before announcing
itself the relay still checks which one serves (``relay_check.check``); a start that cuts the probe is restarted
with a new identity and port, at most ``--tries`` times; after the last, the relay announces itself unchecked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from locomm.peer.transport.relay_check import PROBE_BYTES, check, one_go_thread


def _log(msg: str) -> None:
    print(f"relay: {msg}", file=sys.stderr, flush=True)


async def serve(host_maddr: str, out: Path, tries: int, probe_timeout: float) -> int:
    from hivemind.p2p import P2P  # noqa: PLC0415

    for k in range(1, tries + 1):
        with one_go_thread():
            p2p = await P2P.create(
                host_maddrs=[host_maddr], use_relay=True, use_auto_relay=False, force_reachability="public"
            )
        try:
            maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
            n, what, dt = await check(maddrs[0], probe_timeout)
            _log(f"start {k}/{tries}: {n} of {PROBE_BYTES} bytes in {dt:.1f} s: {what}")
            if n < PROBE_BYTES and k < tries:
                continue  # a new start (identity, port): the relay with the wider limits may win this time
            if n < PROBE_BYTES:
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
