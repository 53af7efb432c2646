"""Every peer derives the same groups, whatever it has banned: bans skip a partner at exchange time only."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from locomm.compression.payload import PayloadCodec
from locomm.config import RunSpec
from locomm.peer.gossip import Faults, Gossip
from locomm.peer.rpc import Limits, RpcServer
from locomm.peer.swarm import Heartbeat, members_for_round
from locomm.protocol.schedule import group_of, noloco_groups

PEERS = ["pa", "pb", "pc", "pd", "pe", "pf"]


def beats(round_idx: int) -> list[Heartbeat]:
    return [Heartbeat(peer=p, round=round_idx, join_round=0) for p in PEERS]


def test_groups_identical_across_peers_while_one_has_banned_another():
    faults = {p: Faults(max_faults=1) for p in PEERS}
    faults["pa"].record("pb", "garbage")  # pa bans pb; nobody else does
    assert faults["pa"].banned == {"pb"}
    for r in range(20):
        views = {p: members_for_round(beats(r), r, p) for p in PEERS}
        assert len({tuple(v) for v in views.values()}) == 1, views  # bans never change the members
        groups = {p: noloco_groups(r, views[p], 2, seed=0) for p in PEERS}
        assert len({repr(g) for g in groups.values()}) == 1


def test_a_banned_partner_is_skipped_at_exchange_time():
    spec = RunSpec.preset("nano")
    codec = PayloadCodec({"w": (4, 4)}, {"theta": "parameter"}, spec.compression)
    faults = Faults(max_faults=1)
    faults.record("pb", "garbage")

    async def run() -> dict:
        with ThreadPoolExecutor(1) as pool:
            server = RpcServer(None, "run", Limits(), pool)  # type: ignore[arg-type]
            g = Gossip(
                None,
                server,
                run_id="run",
                me="pa",
                codec=codec,
                limits=Limits(),
                faults=faults,  # type: ignore[arg-type]
                max_body_bytes=1 << 20,
            )
            # The only partner is banned: no stream is opened (there is no network here), the round is local.
            return await g.exchange(0, ["pa", "pb"], {})

    assert asyncio.run(run()) == {}
    members = members_for_round(beats(0), 0, "pa")
    assert "pb" in members and group_of("pa", noloco_groups(0, members, 2)) is not None
