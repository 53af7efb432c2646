"""Membership by observation with real P2P and DHT nodes on loopback: identities whose heartbeats a DHT node
stores but that no p2pd answers for (ghosts) are never counted; a live peer is, once it answered a hello.

Issue 32: one DHT node minted 24 signed members with no p2pd behind any; all were admitted, stalled the honest
rounds to ``max_wait_s`` and were a joiner's only donors. A heartbeat is a signed record; a hello is a stream,
and libp2p's secure channel makes whoever answers one prove it holds the identity's key (``protocol/sightings.py``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from locomm.config import RunSpec

pytestmark = pytest.mark.timeout(180)


async def _scenario(tmp: Path) -> dict:
    from hivemind.dht import DHTNode
    from hivemind.p2p import P2P

    from locomm.peer.host import Host
    from locomm.peer.options import NodeOptions
    from locomm.peer.transport.records import SwarmValidator, load_identity
    from locomm.peer.transport.swarm import store_heartbeat
    from locomm.protocol.membership import Heartbeat, members_for_round, state_donors, swarm_round

    spec = RunSpec.preset("nano")
    ttl = spec.network.heartbeat_ttl_s
    out: dict = {}
    async with Host(spec, NodeOptions()) as reader:
        boot = str(reader.maddrs[0])
        reader.heartbeat = lambda: Heartbeat(peer=reader.me, round=5, join_round=0, started=True)
        await reader.publish()
        async with Host(spec, NodeOptions(initial_peers=(boot,))) as honest:
            honest.heartbeat = lambda: Heartbeat(peer=honest.me, round=5, join_round=0, started=True)
            await honest.publish()
            # The minting node: one P2P and DHT node; it signs each ghost's record with that ghost's key.
            p2p = await P2P.create(initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            dht = await DHTNode.create(p2p=p2p, initial_peers=[boot])
            ghosts = []
            for i in range(4):
                ident = tmp / f"ghost{i}.id"
                P2P.generate_identity(str(ident))
                v = SwarmValidator(load_identity(ident))
                dht.protocol.record_validator = v
                beat = Heartbeat(peer=v.peer_id, round=10**6, join_round=0, started=True, round_s=1.0)
                assert await store_heartbeat(dht, reader.run_id, v.peer_id, beat.record(), ttl)
                ghosts.append(v.peer_id)
            try:
                deadline = time.monotonic() + 60  # until every ghost was asked and did not answer
                while time.monotonic() < deadline:
                    beats = await reader.read_beats()
                    asked = all(reader.sightings.unanswered(g) for g in ghosts)
                    if asked and set(ghosts) <= set(reader.records) and honest.me in reader.beats:
                        break
                    await asyncio.sleep(0.5)
                out["records"] = set(reader.records)
                out["counted"] = {b.peer for b in beats}
                out["ghosts_unanswered"] = [reader.sightings.unanswered(g) for g in ghosts]
                out["members"] = members_for_round(beats, 5, reader.me, since=reader.since())
                out["round"] = swarm_round(beats)
                out["donors"] = state_donors(beats, 5, lambda b: b.round)
                out["honest_counts_reader"] = reader.me in {b.peer for b in await honest.read_beats()}
                out |= {"reader": reader.me, "honest": honest.me, "ghosts": ghosts}
            finally:
                await dht.shutdown()
                await p2p.shutdown()
    return out


def test_ghost_identities_are_never_counted_and_live_peers_are(tmp_path: Path) -> None:
    out = asyncio.run(asyncio.wait_for(_scenario(tmp_path), 150))
    reader, honest, ghosts = out["reader"], out["honest"], set(out["ghosts"])
    assert ghosts <= out["records"], "the ghosts' heartbeats were read (they are validly signed)"
    assert out["counted"] == {reader, honest}
    assert out["members"] == sorted([reader, honest])
    assert out["round"] == 5, "ghosts claiming round 10^6 have no say in the swarm's round"
    assert set(out["donors"]) <= {reader, honest} and not ghosts & set(out["donors"])
    assert out["ghosts_unanswered"] == [True] * len(ghosts), "each ghost was asked, and waits out a backoff"
    assert out["honest_counts_reader"]


async def test_a_live_identity_that_serves_no_exchange_is_told_apart_from_an_unreachable_one() -> None:
    """Real p2pd: a stream to a peer that runs no such handler fails "protocols not supported", which
    ``open_link`` raises as ``NotServed`` (alive: not waited for, breaks its promises), while a peer id nobody
    answers for is ``Unreachable``, and NotServed is not claimed for a protocol other than ours."""
    from hivemind.p2p import P2P

    from locomm.peer.transport.meter import NotServed, Unreachable
    from locomm.peer.transport.rpc import open_link
    from locomm.protocol.timing import Limits

    limits = Limits(request_timeout_s=5.0)
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    a = await P2P.create(host_maddrs=loopback)
    b = await P2P.create(host_maddrs=loopback, initial_peers=[str(m) for m in await a.get_visible_maddrs()])
    gone = await P2P.create(host_maddrs=loopback)
    nobody = gone.peer_id.to_base58()
    await gone.shutdown()
    try:
        with pytest.raises(NotServed):
            await open_link(b, a.peer_id.to_base58(), "locomm.run.gossip", limits)
        with pytest.raises(Unreachable) as e:
            await open_link(b, nobody, "locomm.run.gossip", limits)
        assert not isinstance(e.value, NotServed), e.value
    finally:
        await b.shutdown()
        await a.shutdown()
