"""Which circuit-relay service a public p2pd serves with, how to make it the wide one, and the check a relaying
node runs before it serves.

hivemind 1.1.12's p2pd runs two circuit-relay (v2) services on one host: the one its ``-relayDataLimit`` /
``-relayTimeLimit`` flags configure (4 GiB and 30 min per relayed connection, started by go-libp2p's relay
manager, in a goroutine of its own, when the host turns public), and a second one its ``EnableRelayV2`` starts
from ``main`` with go-libp2p's ``DefaultResources()``: 128 KiB per direction and 2 minutes per relayed
connection. Both register the hop protocol; the one registered last serves it. With
``force_reachability="public"`` the host is public at once and the two start microseconds apart, on different
OS threads: which one registers last is a race. Every relayed connection through the limited one is reset after
131072 bytes each way (the probe below sees 98304 of its 262144 arrive), so no payload gets through. Measured on
a bare relay in a network namespace (docs/results/nat.md): limited on 7 of 8 starts with Go's default thread
count on an idle 2-core machine, 3 of 6 with ``GOMAXPROCS=16``, and on none of 22 with ``GOMAXPROCS=1`` (6 idle,
16 beside a 2-process CPU hog). With one thread ``main`` runs on until it blocks, so ``EnableRelayV2`` registers
first and the flags' service, whose goroutine runs after, serves. So a relaying public p2pd starts with one Go
thread (:func:`one_go_thread`: a home link's relaying needs far less than a core), and a start is still checked
from outside, since the ordering is Go's scheduler's, not a promise: a private node reserves a slot on the relay
(a static relay, no listen address, so the relay is its only route) and another sends it ``PROBE_BYTES`` through
the circuit (:func:`check`). A start that cuts it is restarted; the bare test relay (locomm/testing/relay.py) and
a ``--reachability public`` peer (locomm/peer/host.py) both do so.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)
PROBE_BYTES = 1 << 18
"""Sent through the relay by the probe: twice go-libp2p's default budget of 128 KiB per direction."""
PROBE_HANDLER = "locomm-relay-probe"
PROBE_ATTEMPTS = 3
"""Probes per start while none gets a byte through (a probe node's p2pd failing to start or to dial)."""
CHUNK = 1 << 16


@contextlib.contextmanager
def one_go_thread() -> Iterator[None]:
    """Run the p2pd that hivemind spawns inside this block (it inherits this process's environment) with
    ``GOMAXPROCS=1``: its relay service is then the wide one (module docstring). The variable is restored after;
    a Python process ignores it, so another spawn that happens meanwhile is unharmed."""
    before = os.environ.get("GOMAXPROCS")
    os.environ["GOMAXPROCS"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GOMAXPROCS", None)
        else:
            os.environ["GOMAXPROCS"] = before


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
                await asyncio.wait_for(node.shutdown(), 10)  # bounded: a stop waits on this clean-up
    n = got.result() if got.done() else 0
    return n, "ok" if n == nbytes and reply == str(n).encode() else f"{what} after {sent} sent"


async def check(maddr: str, timeout_s: float = 30.0) -> tuple[int, str, float]:
    """Probe the relay at ``maddr`` (with ``/p2p/<id>``): bytes carried of ``PROBE_BYTES``, what happened and the
    seconds it took. A probe that gets nothing through (a probe node's p2pd failing to start or dial, or no
    answer within ``timeout_s``) is repeated, at most ``PROBE_ATTEMPTS`` times; one that gets some bytes
    through (all, or cut at the relay's limit) is final."""
    n, what, t0 = 0, "not probed", time.monotonic()
    for _ in range(PROBE_ATTEMPTS):
        try:
            n, what = await asyncio.wait_for(probe(maddr), timeout_s)
        except TimeoutError:
            n, what = 0, f"no answer within {timeout_s:g} s"
        if n > 0:
            break
    return n, what, time.monotonic() - t0


def public_maddr(maddrs: list[Any]) -> str | None:
    """The first TCP multiaddr of ``maddrs`` on an address libp2p relays through (not loopback, link-local or
    unspecified): a relay on such an address announces no relayed address, so there is nothing to check."""
    for m in map(str, maddrs):
        parts = m.split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or "p2p-circuit" in m:
            continue
        with contextlib.suppress(ValueError):
            ip = ipaddress.ip_address(parts[2])
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
                return m
    return None


async def start_checked(create: Callable[[], Awaitable[Any]], event: Callable[..., None], starts: int) -> Any:
    """A P2P from ``create`` whose relay service carried the probe: one that cut it is shut down and created again
    (same identity), at most ``starts`` times; after the last it is kept with a warning. ``event`` gets one
    ``relay_checked`` event per start (start, carried, probe_bytes, s). Each p2pd starts with one Go thread
    (:func:`one_go_thread`)."""
    for start in range(1, starts + 1):
        with one_go_thread():
            p2p = await create()
        try:
            maddr = public_maddr(await p2p.get_visible_maddrs())
            if maddr is None:
                log.info("relay check skipped: no address that libp2p relays through (loopback only)")
                return p2p
            n, what, dt = await check(maddr)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(p2p.shutdown(), 10)
            raise
        event("relay_checked", start=start, carried=n, probe_bytes=PROBE_BYTES, s=dt)
        if n >= PROBE_BYTES:
            log.info("relay service checked: a relayed connection carried %d bytes (%.1f s)", n, dt)
            return p2p
        if start == starts:
            log.warning(
                "relay service unchecked after %d starts (the last carried %d of %d bytes: %s); serving anyway: "
                "payloads relayed through this peer may be cut at 128 KiB",
                start,
                n,
                PROBE_BYTES,
                what,
            )
            return p2p
        log.warning(
            "relay service limited (a relayed connection carried %d of %d bytes: %s); restarting p2pd (%d/%d)",
            n,
            PROBE_BYTES,
            what,
            start + 1,
            starts,
        )
        with contextlib.suppress(Exception):
            await asyncio.wait_for(p2p.shutdown(), 10)
    raise ValueError(f"starts must be at least 1, got {starts}")
