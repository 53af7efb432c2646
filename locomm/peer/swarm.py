"""Membership through hivemind's DHT: the run spec record and one heartbeat per peer.

DHT records (small ones only; tensors never go through the DHT):

- ``locomm.spec``: {"hash", "toml", "version"}; the first peer stores it, joiners
  read it and refuse a swarm whose hash or protocol version differs from theirs.
- ``locomm.<run>.peers``, one subkey per peer id: a heartbeat {round, join_round,
  step, loss, val_loss, tokens_per_s, bytes_sent, last_exchange, version, maddrs,
  time} that expires after ``heartbeat_ttl_s``, or after MEMBER_LAG_ROUNDS + 2 of the
  peer's rounds when that is longer (membership is decided by the round counter, not by expiry).

The members of round r are the live peers whose ``join_round <= r`` and whose
last round is not far behind r (:func:`members_for_round`), sorted by peer id. A
joiner announces a join_round a little ahead of the swarm, so every peer includes
it from the same round on. Local bans never change the members.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hivemind.dht import DHTNode
from hivemind.utils import get_dht_time

from locomm import PROTOCOL_VERSION

log = logging.getLogger(__name__)
SPEC_KEY = "locomm.spec"


def peers_key(run_id: str) -> str:
    return f"locomm.{run_id}.peers"


@dataclass
class Heartbeat:
    peer: str
    round: int
    join_round: int
    fields: dict[str, Any]
    expires: float


async def publish_spec(dht: DHTNode, spec_hash: str, toml: str, ttl: float = 3600.0) -> None:
    await dht.store(
        SPEC_KEY, {"hash": spec_hash, "toml": toml, "version": PROTOCOL_VERSION}, expiration_time=get_dht_time() + ttl
    )


async def fetch_spec(dht: DHTNode) -> dict[str, Any] | None:
    found = await dht.get(SPEC_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    v = found.value
    if not all(k in v for k in ("hash", "toml", "version")):
        return None
    return v


async def store_heartbeat(dht: DHTNode, run_id: str, peer: str, record: dict[str, Any], ttl: float) -> bool:
    return await dht.store(
        peers_key(run_id), subkey=peer, value={**record, "time": get_dht_time()}, expiration_time=get_dht_time() + ttl
    )


async def read_heartbeats(dht: DHTNode, run_id: str) -> list[Heartbeat]:
    found = await dht.get(peers_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    out = []
    for peer, item in found.value.items():
        value = getattr(item, "value", None)
        expires = getattr(item, "expiration_time", 0.0)
        if not isinstance(peer, str) or not isinstance(value, dict) or expires < now:
            continue
        try:
            out.append(
                Heartbeat(
                    peer=peer,
                    round=int(value.get("round", 0)),
                    join_round=int(value.get("join_round", 0)),
                    fields=value,
                    expires=expires,
                )
            )
        except (TypeError, ValueError):
            log.warning("ignoring malformed heartbeat from %s", peer)
    return sorted(out, key=lambda h: h.peer)


MEMBER_LAG_ROUNDS = 3
"""A peer whose last heartbeat is more than this many rounds behind round r is not a member of r."""


def members_for_round(
    beats: list[Heartbeat], round_idx: int, me: str, fresh_s: float = 0.0, now: float | None = None
) -> list[str]:
    """The members of round r, from a snapshot every peer reads alike.

    A peer is a member of r when it was admitted by r (``join_round <= r``) and either its last published
    round is at least ``r - MEMBER_LAG_ROUNDS`` or its heartbeat is younger than ``fresh_s`` (a live peer
    that is merely slow stays in). A peer that died drops out when both fail: its frozen round counter is
    content every peer reads alike, so where rounds are longer than the heartbeat TTL (any real run) it
    drops out for everyone at the same round, whenever each one reads. Local bans are not applied: a banned
    partner is skipped at exchange time instead.
    """
    now = get_dht_time() if now is None else now
    members = {
        h.peer
        for h in beats
        if h.join_round <= round_idx
        and (h.round >= round_idx - MEMBER_LAG_ROUNDS or now - float(h.fields.get("time", 0.0) or 0.0) < fresh_s)
    }
    members.add(me)
    return sorted(members)
