"""How each partner's payload reached us: pushed to us or pulled by us, over a direct or a relayed connection.

A NATed peer is reached over a connection it opened (direct), through a libp2p circuit relay (its relay
address, ``.../p2p/<relay>/p2p-circuit``), or over a hole-punched direct connection (DCUtR upgrades a relayed
one). Which one a transfer used is read from p2pd's live connections to the partner (``P2P.list_peers``: one
entry per connection, with its remote multiaddr; p2pd's ``doListPeers``): a relayed connection's remote
address holds ``/p2p-circuit``. They are read as the payload completes; libp2p opens new streams on a direct
connection when it has one, so "direct" is reported whenever one is live (a transfer that began on a relay
while hole punching succeeded reads as direct).

Every arrival is logged (``exchange path: ...``) and, when a ``sink`` is set (the node's event log), written as
an ``exchange`` event: ``round``, ``peer``, ``via`` (push / pull), ``conn`` (direct / relay / none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from hivemind.p2p import P2P

log = logging.getLogger(__name__)

CIRCUIT = "/p2p-circuit"
KEEP_ROUNDS = 4
"""Rounds of paths kept (older ones are dropped as new rounds arrive)."""
LIST_TIMEOUT_S = 5.0


def conn_kind(addrs: list[str]) -> str:
    """'direct' when any live connection is not relayed, 'relay' when all are, 'none' without one."""
    if not addrs:
        return "none"
    return "direct" if any(CIRCUIT not in a for a in addrs) else "relay"


async def live_connections(p2p: P2P) -> dict[str, list[str]]:
    """Peer id -> the remote multiaddrs of this node's live connections to it, as p2pd holds them (what the
    peer's packets came from, not what it declares); empty when p2pd does not answer in ``LIST_TIMEOUT_S``."""
    conns: dict[str, list[str]] = {}
    with contextlib.suppress(Exception):
        async with asyncio.timeout(LIST_TIMEOUT_S):
            infos = await p2p.list_peers()
        for i in infos:
            conns.setdefault(i.peer_id.to_base58(), []).extend(str(a) for a in i.addrs)
    return conns


async def connection_addrs(p2p: P2P, peer: str) -> list[str]:
    """The remote multiaddrs of this node's live connections to ``peer`` (empty when it has none)."""
    return (await live_connections(p2p)).get(peer, [])


class PathLog:
    """round -> {partner: (via, conn)} of the payloads that arrived, and the ``exchange`` events they make."""

    def __init__(self) -> None:
        self.rounds: dict[int, dict[str, tuple[str, str]]] = defaultdict(dict)
        self.sink: Callable[..., Any] | None = None
        """Called as ``sink("exchange", round=..., peer=..., via=..., conn=...)`` per arrival (the event log)."""

    async def arrived(self, round_idx: int, peer: str, pulled: bool, p2p: P2P, **timing: Any) -> None:
        """``peer``'s payload of ``round_idx`` is here (``pulled``: over a stream we opened); ``timing`` goes into
        the event as it is (the transfer's wall-clock times: when it opened, its first and last part came)."""
        conns = await connection_addrs(p2p, peer)
        via, conn = "pull" if pulled else "push", conn_kind(conns)
        self.rounds[round_idx][peer] = (via, conn)
        for r in [r for r in self.rounds if r < round_idx - KEEP_ROUNDS]:
            del self.rounds[r]
        log.info("exchange path: round=%d peer=%s via=%s conn=%s addrs=%s", round_idx, peer, via, conn, conns)
        if self.sink is not None:
            self.sink("exchange", round=round_idx, peer=peer, via=via, conn=conn, addrs=conns, **timing)
