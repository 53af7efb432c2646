"""A bare libp2p relay: one hivemind p2pd with the circuit-relay (v2) service and nothing else.

    python -m locomm.testing.relay --host-maddr /ip4/11.77.3.10/tcp/0 --out relay.txt

Writes its multiaddrs (``/p2p/<id>`` included), one a line, to ``--out`` once it is up, then serves until
SIGINT/SIGTERM. benchmarks/links.py starts a few on the open hosts for small NAT runs: go-libp2p's
auto-relay (as p2pd runs it, with relay discovery on; hivemind has no switch to turn it off) waits for 4
relay candidates, or 3 minutes, before it reserves a slot, and a 4-peer swarm with 2 open peers has 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from pathlib import Path


async def serve(host_maddr: str, out: Path) -> None:
    from hivemind.p2p import P2P  # noqa: PLC0415 - the module's --help stays light

    p2p = await P2P.create(host_maddrs=[host_maddr], use_relay=True, use_auto_relay=False, force_reachability="public")
    try:
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        tmp = out.with_suffix(".tmp")
        tmp.write_text("\n".join(maddrs) + "\n")
        os.replace(tmp, out)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-maddr", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    asyncio.run(serve(args.host_maddr, args.out))


if __name__ == "__main__":
    main()
