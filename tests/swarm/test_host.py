"""The host: everything exists once it is entered, every task it started is over once it is left."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from locomm.config import RunSpec
from locomm.peer.host import Host
from locomm.peer.options import NodeOptions
from locomm.peer.transport import reach
from locomm.protocol.membership import Heartbeat

pytestmark = pytest.mark.timeout(120)


def _spec() -> RunSpec:
    return RunSpec.preset("nano").replace("network", heartbeat_interval_s=0.2)


async def test_a_host_is_whole_inside_and_awaits_its_tasks_on_exit():
    forever = started = None
    async with Host(_spec(), NodeOptions()) as host:
        assert host.me and host.maddrs and host.run_id == host.spec.hash()[:16]
        assert host.rpc is not None and host.metrics is not None and host.faults.total == 0
        host.heartbeat = lambda: Heartbeat(peer=host.me, round=3, version="t")
        host.start_heartbeats()
        forever = host.spawn(asyncio.sleep(3600))
        started = host.spawn(host.sleep(3600))
        for _ in range(50):  # the loop publishes our heartbeat and reads it back
            await asyncio.sleep(0.1)
            if host.me in host.beats:
                break
        assert host.beats[host.me].round == 3
        assert await host.authorize(host.me, "member")
        assert not await host.authorize("12D3KooWnobody", "announced")
    assert forever.done() and forever.cancelled() and started.done()
    assert host.pool._shutdown  # the compute thread is gone too


async def test_a_background_error_is_logged_and_a_task_error_stops_the_host(caplog):
    async def boom() -> None:
        raise RuntimeError("boom")

    async with Host(_spec(), NodeOptions()) as host:
        task = host.spawn(boom(), background=True)
        await asyncio.sleep(0.05)
        assert task.done() and task.exception() is None
    assert "boom" in caplog.text

    with pytest.raises(RuntimeError, match="driver bug"):
        async with Host(_spec(), NodeOptions()) as host:

            async def bug() -> None:
                raise RuntimeError("driver bug")

            host.spawn(bug())
            await host.sleep(30)  # cancelled when the task fails


def _nobody(tmp_path, port: int | None = None) -> str:
    """The address of a peer id on a loopback port nobody listens on (or on ``port``)."""
    import socket

    from hivemind.p2p import P2P

    from locomm.peer.transport.records import SwarmValidator, load_identity

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    ident = tmp_path / "gone.id"
    P2P.generate_identity(str(ident))
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{SwarmValidator(load_identity(ident)).peer_id}"


async def test_an_initial_peer_out_of_reach_is_tried_again_then_one_error(monkeypatch, tmp_path):
    """p2pd fails to start when no --initial-peer answers: the attempt is retried, then a ConfigError (the
    one-line error `join` prints), never a crash of the retry path (it reached for the P2P that never started:
    an AttributeError and a traceback, seen when a joiner's initial peer had just left)."""
    from locomm.config import ConfigError
    from locomm.peer.transport import peer_cache

    monkeypatch.setattr(peer_cache, "BOOT_ATTEMPTS", 2)
    opts = NodeOptions(initial_peers=(_nobody(tmp_path),))
    with pytest.raises(ConfigError, match="cannot reach the swarm through --initial-peers"):
        async with Host(_spec(), opts):
            pass


async def test_a_stop_while_the_swarm_is_out_of_reach_is_a_stop_not_an_error(tmp_path):
    """Ctrl-C while a peer is still trying to reach the swarm ends it at once, as a stop (`join` exits 0), not as
    "cannot reach the swarm" (exit 2: chaos seed 14's final stop caught a restart between two tries)."""
    from locomm.peer.transport.reach import Stopped

    host = Host(_spec(), NodeOptions(initial_peers=(_nobody(tmp_path),)))
    asyncio.get_running_loop().call_later(1.0, host.stop.set)
    t0 = time.monotonic()
    with pytest.raises(Stopped):
        async with host:
            pass
    assert time.monotonic() - t0 < 30.0  # not the 40 s of tries


async def test_a_restart_that_remembers_peers_waits_past_a_first_joins_tries_for_them_to_come_back(
    monkeypatch, tmp_path
):
    """A restart whose checkpoint folder remembers peers it trained with keeps trying after a first join would have
    given up (``peer_cache.retry_in``): here every peer it knows is down for its first tries, then one comes back
    at its remembered address, and the restart joins through it. The tries are cut to 2 and the patience to 60 s
    so that this takes seconds, not the minutes of the defaults."""
    import json
    import socket

    from hivemind.dht import DHTNode
    from hivemind.p2p import P2P

    from locomm.peer.transport import peer_cache

    monkeypatch.setattr(peer_cache, "BOOT_ATTEMPTS", 2)
    monkeypatch.setattr(peer_cache, "BOOT_PATIENCE_S", 60.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    initial = _nobody(tmp_path)
    (tmp_path / "back").mkdir()
    back = _nobody(tmp_path / "back", port)  # an identity whose peer is down now, at the address the folder remembers
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / peer_cache.FILE_NAME).write_text(json.dumps([back]))
    opts = NodeOptions(initial_peers=(initial,), checkpoint_dir=tmp_path / "ckpt")
    tries: list[float] = []
    real_try = reach._try

    async def counted(*args, **kwargs):
        tries.append(time.monotonic())
        return await real_try(*args, **kwargs)

    monkeypatch.setattr(reach, "_try", counted)
    peer: list = []

    async def come_back() -> None:
        while len(tries) <= peer_cache.BOOT_ATTEMPTS:  # past a first join's last try
            await asyncio.sleep(0.1)
        ident = str(tmp_path / "back" / "gone.id")
        p2p = await P2P.create(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], identity_path=ident)
        peer.extend([p2p, await DHTNode.create(p2p=p2p)])

    returning = asyncio.create_task(come_back())
    try:
        async with Host(_spec(), opts) as host:
            assert host.dht is not None and returning.done()
    finally:
        returning.cancel()
        for svc in reversed(peer):
            await svc.shutdown()
    assert len(tries) > peer_cache.BOOT_ATTEMPTS  # a first join would have said "cannot reach the swarm"


async def test_a_joiner_learns_how_long_its_trusted_peer_has_seen_each_peer_alive():
    """``Host.ages``: a joiner has seen every peer alive for seconds; its ``--initial-peers`` may have seen them for
    hours. It asks them (``hello.ask_seen``) and takes, per peer, the earliest round anyone it trusts first saw it
    alive in: what orders its state donors (``membership.state_donors``)."""
    async with Host(_spec(), NodeOptions()) as a:
        a.heartbeat = lambda: Heartbeat(peer=a.me, round=9, version="t", started=True)
        a.start_heartbeats()
        a.sightings.saw("QmOldPeer", time.monotonic(), 2)  # seen since its round 2 ...
        a.sightings.saw("QmNewPeer", time.monotonic(), 9)  # ... and one seen just now
        opts = NodeOptions(initial_peers=(str(a.maddrs[0]),))
        async with Host(_spec(), opts) as b:
            for _ in range(100):
                if a.me in b.beats:  # read, and seen alive
                    break
                await asyncio.sleep(0.1)
                await b.read_beats()
            assert a.me in b.trusted and a.me in b.beats
            assert await b.ages() == {}  # b has no heartbeat: to a it is an outsider, and gets nothing
            b.heartbeat = lambda: Heartbeat(peer=b.me, round=0, version="t")
            await b.publish()
            for _ in range(20):  # a's read of b's record: at most one per 0.5 s (``Host.recheck``)
                if got := await b.ages():
                    break
                await asyncio.sleep(0.25)
            assert {k: got.get(k) for k in ("QmOldPeer", "QmNewPeer")} == {"QmOldPeer": 2, "QmNewPeer": 9}
            b.sightings.saw("QmNewPeer", time.monotonic(), 5)  # its own, earlier: the earliest counts
            assert (await b.ages())["QmNewPeer"] == 5


def _p2pd_children() -> set[int]:
    """The p2pd processes this test process started, zombies included (gone means reaped)."""
    import os

    from locomm.testing import procs

    return {p.pid for p in procs.table(zombies=True).values() if p.ppid == os.getpid() and p.comm == "p2pd"}


async def test_a_stop_cuts_a_try_in_flight_and_stops_the_p2pd_it_started(monkeypatch, tmp_path):
    """Ctrl-C while a try is in flight ends it there: the p2pd it started is stopped before the host says Stopped,
    and it does not wait for the try to fail on its own. Before, a signal waited for the try (chaos seed 14's final
    stop: 27.6 s). The initial peer here accepts TCP and never answers: p2pd waits for it about 5 s."""
    from locomm.peer.transport import reach
    from locomm.peer.transport.reach import Stopped
    from locomm.testing import procs

    if not procs.available():
        pytest.skip("reads child processes from /proc (Linux)")
    held: list = []
    server = await asyncio.start_server(lambda r, w: held.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    silent = _nobody(tmp_path, port)
    exits: list[int | None] = []
    real_stop = reach._stop_p2pd

    async def noted_stop(p2p) -> None:
        await real_stop(p2p)
        exits.append(p2p._child.returncode)

    monkeypatch.setattr(reach, "_stop_p2pd", noted_stop)
    before = _p2pd_children()
    host = Host(_spec(), NodeOptions(initial_peers=(silent,)))

    async def stop_once_p2pd_runs() -> float:
        while not _p2pd_children() - before:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        host.stop.set()
        return time.monotonic()

    stopper = asyncio.create_task(stop_once_p2pd_runs())
    try:
        with pytest.raises(Stopped):
            async with host:
                pass
        assert stopper.done()
        cut_s = time.monotonic() - stopper.result()
    finally:
        stopper.cancel()
        server.close()
        for w in held:
            w.close()
    # stopped by our SIGTERM while it was still starting (p2pd exits 143 on it), not exited on its own (1)
    assert exits in ([143], [-signal.SIGTERM]), exits
    assert not _p2pd_children() - before  # and it is gone (reaped), before Stopped
    assert cut_s < 30.0, cut_s


async def test_a_heartbeat_whose_ttl_shrank_is_still_stored_and_read_so_a_goodbye_lands():
    """A record's TTL is 7 x the round time (at least the spec's); DHT nodes keep whichever value of a subkey
    expires later. On the main before, a heartbeat published when the round time had fallen (a goodbye after a
    short last round) expired sooner than the one before it and was refused: readers kept the old one, and the
    leaver's partners waited for it to a deadline for 3 rounds (`tests/swarm/test_long_lived.py`, under load).
    Also an earlier process of the same identity that stored a longer-lived record is outlived."""
    from hivemind.utils import get_dht_time

    from locomm.peer.transport.swarm import read_heartbeats, store_heartbeat, stored_expiration

    async with Host(_spec(), NodeOptions()) as host:
        # An earlier process's record: round 5 of 10-s rounds, living 7 x 10 s (the spec's TTL here: 30 s).
        slow = Heartbeat(peer=host.me, round=5, round_s=10.0)
        assert await store_heartbeat(host.dht, host.run_id, host.me, slow.record(), 70.0)
        assert await stored_expiration(host.dht, host.run_id, host.me) > get_dht_time() + 70.0
        # A fast round now: its TTL is the spec's, far shorter. Published, it must replace the record.
        await host.publish(Heartbeat(peer=host.me, round=6, round_s=0.1, finished=True))
        (mine,) = [b for b in await read_heartbeats(host.dht, host.run_id) if b.peer == host.me]
        assert mine.round == 6 and mine.finished
        # And the next, with a TTL shorter again, lands too (no read needed: the host kept the expiration).
        await host.publish(Heartbeat(peer=host.me, round=7, round_s=0.01))
        (mine,) = [b for b in await read_heartbeats(host.dht, host.run_id) if b.peer == host.me]
        assert mine.round == 7
