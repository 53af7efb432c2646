"""The swarm's DHT records: the run spec and one heartbeat per peer (the I/O; the rules are in
``protocol/membership.py``).

DHT records (small ones only; tensors never go through the DHT):

- ``locomm.spec``: {"hash", "toml", "version"}; the first peer stores it, joiners
  read it and refuse a swarm whose hash or protocol version differs from theirs.
- ``locomm.<run>.peers``, one subkey per peer id: a heartbeat
  (:class:`locomm.protocol.membership.Heartbeat`) that expires after ``heartbeat_ttl_s``, or after
  MEMBER_LAG_ROUNDS + 2 of the peer's rounds when that is longer (membership is decided by the round
  counter, not by expiry). A record with any malformed field is dropped when read.
"""

from __future__ import annotations

import logging
from typing import Any

from hivemind.dht import DHTNode
from hivemind.utils import get_dht_time

from locomm import PROTOCOL_VERSION
from locomm.protocol.membership import MEMBER_LAG_ROUNDS, Heartbeat, members_for_round, pick_stage

__all__ = [
    "MEMBER_LAG_ROUNDS",
    "SPEC_KEY",
    "Heartbeat",
    "fetch_spec",
    "members_for_round",
    "peers_key",
    "pick_stage",
    "publish_spec",
    "read_heartbeats",
    "store_heartbeat",
]

log = logging.getLogger(__name__)
SPEC_KEY = "locomm.spec"


def peers_key(run_id: str) -> str:
    return f"locomm.{run_id}.peers"


async def publish_spec(dht: DHTNode, spec_hash: str, toml: str, ttl: float = 3600.0) -> None:
    await dht.store(
        SPEC_KEY,
        {"hash": spec_hash, "toml": toml, "version": PROTOCOL_VERSION},
        expiration_time=get_dht_time() + ttl,
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
    """Store ``record`` (usually ``Heartbeat.record()``) as ``peer``'s heartbeat, stamped with the DHT time."""
    now = get_dht_time()
    return await dht.store(peers_key(run_id), subkey=peer, value={**record, "time": now}, expiration_time=now + ttl)


async def read_heartbeats(dht: DHTNode, run_id: str) -> list[Heartbeat]:
    """The live, well-formed heartbeats of a run, sorted by peer id (malformed ones are dropped)."""
    found = await dht.get(peers_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    out = []
    for peer, item in found.value.items():
        expires = getattr(item, "expiration_time", 0.0)
        if not isinstance(expires, int | float) or expires < now:
            continue
        beat = Heartbeat.parse(peer, getattr(item, "value", None), expires)
        if beat is None:
            log.debug("ignoring a malformed heartbeat from %r", peer)
            continue
        out.append(beat)
    return sorted(out, key=lambda h: h.peer)
