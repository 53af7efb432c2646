"""The swarm's DHT records: the run spec and one heartbeat per peer (the I/O; the rules are in
``protocol/membership.py``, the signatures and checks in ``peer/transport/records.py``).

DHT records (small ones only; tensors never go through the DHT), each signed by its writer:

- ``locomm.spec.<peer id>``: {"hash", "toml", "version", "closed"}, the spec that peer runs; every peer
  stores its own and refreshes it, so the spec lives as long as any peer does. A joiner without
  --config reads the records of the peers its --initial-peers name (``/p2p/ID``) and nobody else's.
- ``locomm.swarm.<swarm id>`` (certificate mode): the same value, one subkey per member; what a joiner
  holding a certificate of that founder reads (``join --swarm ID``), through any DHT node.
- ``locomm.<run>.peers``, one subkey per peer id (only that peer may write it): a heartbeat
  (:class:`locomm.protocol.membership.Heartbeat`) that expires after ``heartbeat_ttl_s``, or after
  MEMBER_LAG_ROUNDS + 2 of the peer's rounds when that is longer (membership is decided by the round
  counter, not by expiry). A record with any malformed field is dropped when read.
"""

from __future__ import annotations

import logging
from typing import Any

from hivemind.dht import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord

from locomm import PROTOCOL_VERSION
from locomm.config import RunSpec
from locomm.peer.transport import dht_clock
from locomm.peer.transport.records import SPEC_TTL_S, SwarmKey, peers_key, spec_key, swarm_spec_key
from locomm.protocol.membership import MAX_CLOCK_SKEW_S, MEMBER_LAG_ROUNDS, Heartbeat, members_for_round, pick_stage

__all__ = [
    "MEMBER_LAG_ROUNDS",
    "Heartbeat",
    "drop_refused",
    "fetch_spec",
    "fetch_swarm_specs",
    "members_for_round",
    "peer_ids_of",
    "peers_key",
    "pick_stage",
    "publish_spec",
    "read_heartbeats",
    "spec_key",
    "store_heartbeat",
]

log = logging.getLogger(__name__)


def peer_ids_of(maddrs: list[str] | tuple[str, ...]) -> list[str]:
    """The peer ids named by multiaddrs' ``/p2p/ID`` parts, in order, without repeats."""
    out: list[str] = []
    for m in maddrs:
        parts = str(m).split("/")
        for proto, value in zip(parts, parts[1:]):
            if proto in ("p2p", "ipfs") and value and value not in out:
                out.append(value)
    return out


async def publish_spec(
    dht: DHTNode, peer: str, spec: RunSpec, key: SwarmKey | None = None, *, ttl: float = SPEC_TTL_S
) -> bool:
    """Store the spec ``peer`` (this node) runs under its own key (the DHT's validator signs it), marked closed
    when it runs with a swarm ``key``; with a certificate also under the swarm's key, subkey ``peer``."""
    value = {"hash": spec.hash(), "toml": spec.to_toml(), "version": PROTOCOL_VERSION, "closed": key is not None}
    expires = dht_clock.now() + ttl + MAX_CLOCK_SKEW_S  # lives ttl for a reader whose clock is that far ahead
    ok = await dht.store(spec_key(peer), value, expiration_time=expires)
    if key is not None and key.swarm_id is not None:
        ok = await dht.store(swarm_spec_key(key.swarm_id), subkey=peer, value=value, expiration_time=expires) and ok
    return ok


def drop_refused(dht: DHTNode, key: str) -> int:
    """Drop from this node's storage and cache each record of ``key`` that its validator refuses now; the
    number dropped.

    A node's validator learns keys as it goes (a spec key once its owner's record verifies, the peers key
    once a joiner knows its run), and a record stored before that was taken unchecked. hivemind's read
    starts from what the node holds and keeps the value that expires last, checked only at the end: such a
    record, with a far expiration, would hide the signed one and the read would return nothing.
    """
    validator = getattr(getattr(dht, "protocol", None), "record_validator", None)
    if validator is None:
        return 0
    key_id = DHTID.generate(source=key)
    key_bytes = key_id.to_bytes()
    dumps = dht.protocol.serializer.dumps
    dropped = 0
    for store in (dht.protocol.storage, dht.protocol.cache):
        held = store.get(key_id)
        if held is None:
            continue
        if isinstance(held.value, DictionaryDHTValue):
            items = list(held.value.items())
            good = [
                (sub, item)
                for sub, item in items
                if validator.validate(DHTRecord(key_bytes, dumps(sub), item.value, item.expiration_time))
            ]
            if len(good) < len(items):
                dropped += len(items) - len(good)
                del store[key_id]  # rebuilt from the good ones: the dictionary's own expiration was the bad one's
                for sub, item in good:
                    store.store_subkey(key_id, sub, item.value, item.expiration_time)
        elif not validator.validate(
            DHTRecord(key_bytes, DHTProtocol.IS_REGULAR_VALUE, held.value, held.expiration_time)
        ):
            dropped += 1
            del store[key_id]
    return dropped


async def fetch_spec(dht: DHTNode, peer: str) -> dict[str, Any] | None:
    """The spec record ``peer`` signed (the validator refused any other), or None."""
    drop_refused(dht, spec_key(peer))
    found = await dht.get(spec_key(peer), latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    v = found.value
    if not all(k in v for k in ("hash", "toml", "version", "closed")):
        return None
    return v


async def fetch_swarm_specs(dht: DHTNode, swarm_id: str) -> dict[str, dict[str, Any]]:
    """The spec records members of ``swarm_id`` stored under the swarm's key, by member (the validator, which
    holds this peer's certificate, refused every record without a certificate of the same founder)."""
    key = swarm_spec_key(swarm_id)
    drop_refused(dht, key)
    found = await dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    out = {}
    for peer, item in found.value.items():
        v = getattr(item, "value", None)
        if isinstance(peer, str) and isinstance(v, dict) and all(k in v for k in ("hash", "toml", "version", "closed")):
            out[peer] = v
    return out


async def store_heartbeat(
    dht: DHTNode,
    run_id: str,
    peer: str,
    record: dict[str, Any],
    ttl: float,
    not_before: float = 0.0,
    *,
    elsewhere: bool = False,
) -> bool:
    """Store ``record`` (usually ``Heartbeat.record()``) as ``peer``'s heartbeat, stamped with the DHT time; it
    expires ``MAX_CLOCK_SKEW_S`` after ``ttl``, so it lives ``ttl`` for readers whose clock is up to that far ahead
    of ours (a writer 30 s behind with a 12 s TTL stored records every reader had already expired), and never
    before ``not_before`` (the expiration of the writer's last record: DHT nodes keep whichever value expires
    later and refuse the other, so a record whose TTL shrank with its round time would be refused), as far as
    the validator lets a record live (``records.SwarmValidator``: 2 x ``ttl`` + 2 x ``MAX_CLOCK_SKEW_S``).
    ``elsewhere``: on other nodes only (a goodbye: our own storage goes with us), True when one took it."""
    now = dht_clock.now()
    expires = min(max(now + ttl + MAX_CLOCK_SKEW_S, not_before), now + 2 * ttl + 2 * MAX_CLOCK_SKEW_S - 1.0)
    value = {**record, "time": now}
    return await dht.store(peers_key(run_id), subkey=peer, value=value, expiration_time=expires, exclude_self=elsewhere)


async def stored_expiration(dht: DHTNode, run_id: str, peer: str) -> float:
    """When ``peer``'s heartbeat record now in the DHT expires (0: none found): a store that expires sooner is
    refused, as when an earlier process of the same identity stored a longer-lived one."""
    found = await dht.get(peers_key(run_id), latest=True)
    item = found.value.get(peer) if found is not None and isinstance(found.value, dict) else None
    expires = getattr(item, "expiration_time", 0.0)
    return float(expires) if isinstance(expires, int | float) else 0.0


async def read_heartbeats(dht: DHTNode, run_id: str) -> list[Heartbeat]:
    """The live, well-formed heartbeats of a run, sorted by peer id (malformed ones are dropped)."""
    drop_refused(dht, peers_key(run_id))
    found = await dht.get(peers_key(run_id), latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    now = dht_clock.now()
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
