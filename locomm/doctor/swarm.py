"""``locomm-peer doctor``'s swarm checks: can others dial this peer, its clock against the swarm, throughput.

Two p2pd daemons, both with throwaway identities (never the user's):

- the *observer* (``/ip4/127.0.0.1/tcp/0``, a client-mode DHT node) reads the run spec and heartbeats as
  ``locomm-peer status`` does (the spec the --initial-peers signed; records checked by
  :class:`~locomm.peer.transport.records.SwarmValidator`), pings peers for their DHT time, and downloads part of the
  initial peer's state over the state-sync RPC (``peer/transport/state_sync.py``). That service answers announced peers
  only, so the observer publishes a not-admitted heartbeat (``join_round = NOT_ADMITTED``: it is nobody's
  member, exactly as a joiner before its sync) tagged ``doctor``, which expires after ``heartbeat_ttl_s``;
- the *probe* listens where the peer would (--host-maddrs, --announce-maddrs), joins the DHT as a server
  node whose id is the run's heartbeat key, and then closes every connection. The swarm peers' own
  heartbeat loop reads and writes that key each ``heartbeat_interval_s``, and the probe is now the node
  nearest to it, so they dial the probe: a connection that shows up is one a swarm peer opened to the
  addresses we announce. This is the dial-back; nothing new runs on the swarm side.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from locomm.doctor.machine import Check
from locomm.protocol.membership import MAX_CLOCK_SKEW_S

PING_SAMPLES = 5
CLOCK_PEERS = 5
THROUGHPUT_S = 3.0
"""Seconds of state download at most (the state may be smaller: then all of it, once)."""
FETCH_BATCH_BYTES = 4 << 20
CLOCK_WARN_S, CLOCK_FAIL_S = 1.0, MAX_CLOCK_SKEW_S
"""A peer runs on the swarm's DHT time (peer/transport/dht_clock.py): it corrects its wall clock by up to
``MAX_CLOCK_SKEW_S`` (30 s, ``dht_clock.BOUND_S``) once a majority of the DHT nodes it asks agree, which a swarm
of two never does, and hivemind's bootstrap still refuses peers more than 3 s apart (the peer joins anyway, with
a warning). Over 1 s is a clock to fix; over 30 s is more than the peer can correct."""


def classify(maddr: str) -> str:
    """``relay``, ``loopback``, ``private``, ``public`` or ``other`` (a DNS name, say) for one multiaddr."""
    parts = str(maddr).split("/")
    if "p2p-circuit" in parts:
        return "relay"
    for proto, value in zip(parts, parts[1:]):
        if proto in ("ip4", "ip6"):
            ip = ipaddress.ip_address(value)
            if ip.is_loopback:
                return "loopback"
            if ip.is_unspecified:
                return "other"
            return "public" if ip.is_global else "private"
    return "other"


def address_check(maddrs: list[str]) -> Check:
    kinds = sorted({classify(m) for m in maddrs})
    shown = ", ".join(m.split("/p2p/")[0] for m in maddrs[:4])
    if "public" in kinds:
        return Check("addresses", "OK", len(maddrs), "addrs", f"public address announced: {shown}")
    if kinds == ["relay"]:
        return Check(
            "addresses",
            "WARN",
            len(maddrs),
            "addrs",
            f"only relayed addresses: {shown}",
            "a relay carries every byte; forward a port and pass --announce-maddrs",
        )
    if kinds == ["loopback"]:
        return Check(
            "addresses",
            "WARN",
            len(maddrs),
            "addrs",
            f"loopback only: {shown}",
            "only this machine can dial you: --host-maddrs /ip4/0.0.0.0/tcp/31337",
        )
    return Check(
        "addresses",
        "WARN",
        len(maddrs),
        "addrs",
        f"no public address, only {'/'.join(kinds)}: {shown}",
        "peers outside your network cannot dial these; forward the port on your router and pass "
        "--announce-maddrs /ip4/<public ip>/tcp/<port> (see the dial-back check)",
    )


def port_in_use(maddr: str) -> str | None:
    """Why a fixed TCP port of ``maddr`` cannot be bound, or None. A plain bind, on purpose: p2pd binds with
    SO_REUSEPORT, so a second p2pd on a running peer's port starts fine and takes some of its connections."""
    parts = str(maddr).split("/")
    ip = next((v for p, v in zip(parts, parts[1:]) if p in ("ip4", "ip6")), None)
    port = next((v for p, v in zip(parts, parts[1:]) if p == "tcp"), None)
    if ip is None or port in (None, "0"):
        return None
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, int(port)))
        except OSError as e:
            return f"port {port} cannot be bound: {e.strerror}"
    return None


async def connect(p2p: Any, peer: str, maddrs: list[str], timeout_s: float = 5.0) -> bool:
    """Dial ``peer`` at ``maddrs`` (p2pd's connect takes them without their ``/p2p/ID`` part)."""
    from hivemind.p2p import PeerID  # noqa: PLC0415
    from hivemind.utils.multiaddr import Multiaddr  # noqa: PLC0415

    try:
        addrs = [Multiaddr(str(m).split("/p2p/")[0]) for m in maddrs]
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer), addrs), timeout_s)
        return True
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - unreachable: what the checks report
        return False


async def clock_check(p2p: Any, dht: Any, beats: list[Any]) -> tuple[Check, dict[str, float]]:
    """Our DHT time against up to CLOCK_PEERS live peers: NTP-style, the min-RTT sample of PING_SAMPLES."""
    from hivemind.p2p import PeerID  # noqa: PLC0415
    from hivemind.utils import get_dht_time  # noqa: PLC0415

    from locomm.peer.transport import dht_clock  # noqa: PLC0415 - the wall clock here: doctor follows no swarm

    rtts: dict[str, float] = {}
    offsets: list[float] = []
    for b in beats[:CLOCK_PEERS]:
        peer = PeerID.from_base58(b.peer)
        await connect(p2p, b.peer, list(b.maddrs))
        samples = []
        for _ in range(PING_SAMPLES):
            with contextlib.suppress(Exception):
                if (s := await dht_clock.ping(dht.protocol, peer, dht.protocol.wait_timeout)) is not None:
                    samples.append(s)
        if samples:
            off, rtt = min(samples, key=lambda s: s[1])
            offsets.append(off)
            rtts[b.peer] = rtt
    now = get_dht_time()
    ages = [now - b.time for b in beats if b.time]  # >= 0 on synced clocks: a negative one is a peer ahead of us
    if not offsets:
        return Check("clock", "WARN", None, "s", "no live peer answered a DHT ping", "see the dial checks"), rtts
    off = statistics.median(offsets)
    worst = max(offsets, key=abs)
    detail = (
        f"swarm time - ours = {off:+.3f} s (median of {len(offsets)} peer(s), +-{max(rtts.values()) / 2:.3f} s; "
        f"worst {worst:+.3f} s)" + (f"; newest heartbeat {min(ages):.1f} s old" if ages else "")
    )
    fix = "sync your clock with NTP (timedatectl set-ntp true; or chrony/ntpd)"
    status = "FAIL" if abs(off) > CLOCK_FAIL_S else "WARN" if abs(off) > CLOCK_WARN_S else "OK"
    return Check("clock", status, round(off, 4), "s", detail, fix if status != "OK" else ""), rtts


async def throughput_check(p2p: Any, me: str, peer: str, run_id: str, limits: Any, rtt: float | None) -> Check:
    """Download (part of) ``peer``'s state over the state-sync RPC: bytes/s, request overhead included."""
    from locomm.peer.transport.rpc import Link, request  # noqa: PLC0415
    from locomm.protocol.messages import ErrorCode, ProtocolViolation  # noqa: PLC0415
    from locomm.protocol.state_messages import state_fetch_header, state_manifest_header  # noqa: PLC0415

    handler = f"locomm.{run_id}.state"
    rtt_ms = f"rtt {rtt * 1e3:.1f} ms" if rtt is not None else "rtt ?"
    for attempt in range(10):  # the peer reads our heartbeat at most every 0.5 s
        try:
            resp, _ = await request(p2p, peer, handler, state_manifest_header(run_id, me), limits)
            break
        except ProtocolViolation as v:
            if attempt == 9 or v.code not in (ErrorCode.UNAUTHORIZED, ErrorCode.NOT_READY):
                why = "it has no state yet (before its first round)" if v.code == ErrorCode.NOT_READY else v
                return Check(
                    "throughput",
                    "WARN",
                    None,
                    "MB/s",
                    f"{peer[-8:]} served no state: {why}; {rtt_ms}",
                    "run doctor again once the swarm has trained a round",
                )
            await asyncio.sleep(0.5)
    entries = sorted(resp["manifest"], key=lambda e: -_nbytes(e))
    batches: list[list[dict[str, Any]]] = [[]]
    for e in entries:
        if batches[-1] and sum(_nbytes(x) for x in batches[-1]) + _nbytes(e) > FETCH_BATCH_BYTES:
            batches.append([])
        batches[-1].append(e)
    moved, t0, why = 0, time.perf_counter(), ""
    for batch in batches:
        want = [_nbytes(e) for e in batch]

        async def body(link: Link, answer: dict[str, Any], want: list[int] = want) -> int:
            link.expect(sum(want) + 4 * len(want))
            return sum([len(await link.read_part(n)) for n in want])

        header = state_fetch_header(run_id, me, [e["name"] for e in batch], resp["state_hash"])
        try:
            _, n = await request(p2p, peer, handler, header, limits, body=body)
        except (Exception, TimeoutError) as e:  # noqa: BLE001 - its state moved on, say: what we have is a measure
            why = f"{type(e).__name__}: {e}"
            break
        moved += n
        if time.perf_counter() - t0 > THROUGHPUT_S:
            break
    dt = time.perf_counter() - t0
    if moved == 0:
        return Check("throughput", "WARN", None, "MB/s", f"no state bytes from {peer[-8:]} ({why}); {rtt_ms}", "")
    rate = moved / dt
    detail = f"{moved / 1e6:.1f} MB of state from {peer[-8:]} in {dt:.2f} s ({rate * 8 / 1e6:.1f} Mbit/s); {rtt_ms}"
    return Check("throughput", "OK", round(rate / 1e6, 3), "MB/s", detail)


def _nbytes(entry: dict[str, Any]) -> int:
    n = 4  # the manifest is fp32 throughout (state.py)
    for d in entry.get("shape", ()):
        n *= int(d)
    return n


class _ProbeP2P:
    """A p2pd without libp2p's own Kademlia DHT (hivemind's is separate): that one redials the peers in its
    routing table on its own, and the probe must open no connection after it hangs up."""

    @staticmethod
    async def create(**kw: Any) -> Any:
        from hivemind.p2p import P2P  # noqa: PLC0415

        class NoKad(P2P):
            DHT_MODE_MAPPING = {**P2P.DHT_MODE_MAPPING, "off": {}}

        return await NoKad.create(dht_mode="off", **kw)


async def dial_back(
    probe: Any, window_s: float, ignore: set[str], cycle_s: float, reannounce: Callable[[], Awaitable[Any]]
) -> tuple[bool, list[str]]:
    """Hang up, then wait up to ``window_s`` for a swarm peer (not one of ``ignore``: our own observer
    reaches the probe through loopback) to open a connection to the probe.

    Each ``cycle_s`` without one, ``reannounce()`` pings the swarm again (a peer whose request to us was cut
    by the hang-up drops us from its routing table) and we hang up once more. A connection that shows up
    after a hang-up is one a swarm peer opened: the probe opens none while it waits."""
    deadline = time.monotonic() + window_s
    while True:
        for info in await probe.list_peers():
            if info.peer_id.to_base58() not in ignore:
                with contextlib.suppress(Exception):
                    await probe._client.disconnect(info.peer_id)
        cycle_end = min(deadline, time.monotonic() + cycle_s)
        while time.monotonic() < cycle_end:
            await asyncio.sleep(0.25)
            peers = [p.peer_id.to_base58() for p in await probe.list_peers()]
            if peers := [p for p in peers if p not in ignore]:
                return True, peers
        if time.monotonic() >= deadline:
            return False, []
        with contextlib.suppress(Exception):
            await reannounce()


async def swarm_checks(
    initial_peers: list[str],
    *,
    swarm_key: Path | None,
    host_maddrs: list[str],
    announce_maddrs: list[str],
    deadline_s: float = 60.0,
) -> tuple[list[Check], dict[str, Any]]:
    """The swarm checks, in order (listen, spec, addresses, dial-back, clock, throughput), and the run's spec."""
    from hivemind.dht import DHTNode  # noqa: PLC0415
    from hivemind.dht.routing import DHTID  # noqa: PLC0415
    from hivemind.p2p import P2P, PeerID  # noqa: PLC0415

    from locomm import __version__  # noqa: PLC0415
    from locomm.config import RunSpec  # noqa: PLC0415
    from locomm.peer.transport.records import SwarmKey, SwarmValidator, load_identity, peers_key  # noqa: PLC0415
    from locomm.peer.transport.swarm import fetch_spec, peer_ids_of, read_heartbeats, store_heartbeat  # noqa: PLC0415
    from locomm.protocol.membership import NOT_ADMITTED, Heartbeat  # noqa: PLC0415
    from locomm.protocol.timing import Limits  # noqa: PLC0415

    checks: list[Check] = []
    info: dict[str, Any] = {}
    trusted = peer_ids_of(initial_peers)
    key = SwarmKey.load(swarm_key) if swarm_key is not None else None
    async with contextlib.AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="locomm-doctor-")))
        for m in host_maddrs:
            if (busy := port_in_use(m)) is not None:
                checks.append(
                    Check(
                        "listen",
                        "FAIL",
                        None,
                        "",
                        f"{m}: {busy}",
                        "a peer already running here? stop "
                        "it first (doctor binds the port join will use), or pick another port",
                    )
                )
                return checks, info
        try:
            probe = await _ProbeP2P.create(host_maddrs=host_maddrs, announce_maddrs=announce_maddrs or None)
        except Exception as e:  # noqa: BLE001 - p2pd says "address already in use" in its own words
            checks.append(
                Check(
                    "listen",
                    "FAIL",
                    None,
                    "",
                    f"cannot listen on {' '.join(host_maddrs)}: {e}",
                    "is a peer already running on this port? stop it, or pick another port",
                )
            )
            return checks, info
        stack.push_async_callback(probe.shutdown)
        bound = [str(m) for m in await probe.get_visible_maddrs()]
        ports = " ".join(sorted({m.split("/p2p/")[0] for m in bound}))
        checks.append(Check("listen", "OK", len(bound), "addrs", f"bound {' '.join(host_maddrs)}: {ports}"))
        ident = tmp / "observer.id"
        observer = await P2P.create(
            initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(ident)
        )
        stack.push_async_callback(observer.shutdown)
        validator = SwarmValidator(load_identity(ident), swarm_key=key)
        for peer in trusted:
            validator.trust(peer)
        dht = await DHTNode.create(
            p2p=observer, initial_peers=initial_peers, client_mode=True, record_validator=validator
        )
        stack.push_async_callback(dht.shutdown)
        spec = None
        for _ in range(6):  # a fresh client's first lookups can miss (as in cli/status.py)
            spec = next((s for s in [await fetch_spec(dht, p) for p in trusted] if s is not None), None)
            if spec is not None:
                break
            await asyncio.sleep(0.5)
        if spec is None or (spec["closed"] and key is None):
            why = "this swarm is closed: pass --swarm-key" if spec else "no run spec signed by --initial-peers"
            checks.append(Check("swarm", "FAIL", None, "", why, "check --initial-peers and --swarm-key"))
            return checks, info
        run = RunSpec.from_toml(spec["toml"])
        run_id = spec["hash"][:16]
        info["spec"] = run
        validator.set_run(run_id, run.network.heartbeat_ttl_s)
        beats = [b for b in await read_heartbeats(dht, run_id) if b.admitted or b.peer in trusted]
        checks.append(Check("swarm", "OK", len(beats), "peers", f"run {run_id}: {len(beats)} live peers"))

        # dial-back: the probe becomes the DHT node nearest to the heartbeat key, then hangs up and waits.
        # It dials the initial peers itself (no p2pd bootstrap, which would redial them on its own later).
        for m in initial_peers:
            await connect(probe, peer_ids_of([m])[0], [m])
        probe_dht = await DHTNode.create(
            p2p=probe, initial_peers=initial_peers, node_id=DHTID.generate(source=peers_key(run_id))
        )
        stack.push_async_callback(probe_dht.shutdown)
        visible = [str(m) for m in await probe.get_visible_maddrs(latest=True)]
        checks.append(address_check(visible))
        # Each peer's heartbeat loop touches the key once an interval; a loaded peer can be late by a few.
        window = 4 * run.network.heartbeat_interval_s + 10.0
        me = observer.peer_id.to_base58()

        async def reannounce() -> None:
            for p in trusted:
                await probe_dht.protocol.call_ping(PeerID.from_base58(p))

        cycle = 2 * run.network.heartbeat_interval_s + 2.0
        dial_task = asyncio.create_task(dial_back(probe, window, {me}, cycle, reannounce))
        stack.callback(dial_task.cancel)

        beat = Heartbeat(peer=me, join_round=NOT_ADMITTED, version=__version__)
        await store_heartbeat(dht, run_id, me, {**beat.record(), "doctor": True}, run.network.heartbeat_ttl_s)
        clock, rtts = await clock_check(observer, dht, beats)
        checks.append(clock)
        target = next((p for p in trusted if any(b.peer == p for b in beats)), trusted[0])
        limits = Limits.from_network(run.network)
        checks.append(await throughput_check(observer, me, target, run_id, limits, rtts.get(target)))

        dialled, by = await dial_task
        shown = [m for m in visible if not m.startswith("/ip4/127.")] or visible  # the address others would dial
        port = "/".join(shown[0].split("/")[:5]) if shown else "?"
        if dialled:
            checks.append(
                Check(
                    "dial-back",
                    "OK",
                    1,
                    "",
                    f"swarm peer {by[0][-8:]} opened a new connection to us (listening at {port})",
                )
            )
        else:
            checks.append(
                Check(
                    "dial-back",
                    "WARN",
                    0,
                    "",
                    f"no swarm peer could open a connection to {port} in {window:.0f} s",
                    "forward the port on your router (or open it in the firewall) "
                    "and pass --announce-maddrs /ip4/<public ip>/tcp/<port>; you can still train "
                    "through connections you open, but peers cannot reach you first",
                )
            )
    return checks, info


def run_swarm_checks(initial_peers: list[str], **kw: Any) -> tuple[list[Check], dict[str, Any]]:
    """:func:`swarm_checks` on a fresh event loop, under its deadline."""
    deadline = kw.get("deadline_s", 60.0)
    try:
        return asyncio.run(asyncio.wait_for(swarm_checks(initial_peers, **kw), deadline))
    except TimeoutError:
        return [Check("swarm", "FAIL", None, "", f"the swarm checks ran past {deadline:.0f} s", "")], {}
    except Exception as e:  # noqa: BLE001 - an unreachable swarm is a result, not a traceback
        return [
            Check(
                "swarm",
                "FAIL",
                None,
                "",
                f"cannot reach the swarm: {type(e).__name__}: {e}",
                "check --initial-peers (a running peer's multiaddr) and your network",
            )
        ], {}
