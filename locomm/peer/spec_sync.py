"""Which run spec a starting peer runs: its own, or the one the swarm it joins publishes.

- No ``--initial-peers``: the peer starts a swarm with its own spec.
- ``--initial-peers`` without ``--config``: the spec the named peers (their ``/p2p/ID``) sign, and nobody
  else's (``peer/transport/records.py``); they must agree. None found is an error (is --initial-peers right? a
  bootstrap node that trains nothing publishes a spec only when it was given one).
- ``--initial-peers`` with ``--config``: the swarm's spec must be this one. When the named peers publish
  none (a dedicated bootstrap node, ``locomm-peer bootstrap``, that trains nothing), this peer's own spec
  starts the swarm: it publishes it, and every later peer, with or without --config, finds it.
- Certificate mode (``--swarm-key member.cert``, optionally ``--swarm ID`` to check the founder): first the
  copies members store under the swarm's key, read through any DHT node (a bare ``hivemind-dht`` included);
  every copy carries a certificate of this peer's founder, and the spec most members store is the swarm's.
  None there: the initial peers' records, as above.

Whatever spec a peer runs, the host stores it again under the peer's own key every SPEC_TTL_S / 3
(``Host.publish_spec``), so the spec lives as long as any peer of the swarm does.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from locomm import PROTOCOL_VERSION
from locomm.config import RunSpec
from locomm.peer.options import NodeOptions, SpecMismatch
from locomm.peer.transport.records import SwarmKey, check_swarm_id
from locomm.peer.transport.swarm import fetch_spec, fetch_swarm_specs, peer_ids_of

__all__ = ["settle_spec"]

log = logging.getLogger(__name__)
FETCH_ATTEMPTS = 20
"""Reads of the initial peers' spec records, 0.5 s apart, before a peer decides the swarm has none."""


async def settle_spec(
    dht: Any, opts: NodeOptions, own: RunSpec, key: SwarmKey | None, event: Callable[..., Any]
) -> RunSpec:
    """The spec a starting peer runs (see the module docstring): ``own``, the one of ``opts``, or the swarm's read
    through ``dht``; ``key``: this peer's swarm key (None: an open swarm); ``event`` writes to its event log.
    Raises SpecMismatch for a swarm it cannot join, ConfigError for a ``--swarm`` its key is not of."""
    closed = key is not None
    swarm_id = key.swarm_id if key is not None else None
    if opts.swarm_id is not None:
        check_swarm_id(opts.swarm_id, key)
    if not opts.initial_peers:
        return own
    # With --config, an empty swarm is no error: fewer reads before this peer starts it with its own spec.
    attempts = 6 if opts.spec_from_user else FETCH_ATTEMPTS
    if swarm_id is not None:
        copies: dict[str, dict[str, Any]] = {}
        for _ in range(attempts if opts.swarm_id is not None else 2):
            copies = await _swarm_copies(dht, swarm_id)
            if copies:
                break
            await asyncio.sleep(0.5)
        if copies:
            votes = Counter((v["hash"], v["closed"], v["version"]) for v in copies.values()).most_common()
            if len(votes) > 1 and votes[0][1] == votes[1][1]:
                named = ", ".join(f"{p[-8:]}: {v['hash'][:12]}" for p, v in copies.items())
                raise SpecMismatch(
                    f"the members of swarm {swarm_id} store different run specs in equal numbers ({named})"
                )
            remote = next(v for v in copies.values() if (v["hash"], v["closed"], v["version"]) == votes[0][0])
            log.info(
                "run spec %s of swarm %s, stored by %d of %d member(s)",
                remote["hash"][:12],
                swarm_id,
                votes[0][1],
                len(copies),
            )
            return _adopt(remote, own, opts, closed)
    trusted = peer_ids_of(opts.initial_peers)
    if not trusted:
        raise SpecMismatch("--initial-peers must name the peer: a multiaddr ending in /p2p/<peer id>")
    found: dict[str, dict[str, Any]] = {}
    for attempt in range(attempts):
        for peer, spec in zip(trusted, await asyncio.gather(*(_fetch(dht, p) for p in trusted))):
            if spec is not None:
                found[peer] = spec
        if len(found) == len(trusted) or (found and attempt >= 3):  # an initial peer may be gone
            break
        await asyncio.sleep(0.5)
    if not found:
        if opts.spec_from_user:
            log.warning(
                "the peers in --initial-peers publish no run spec%s: this peer starts the swarm with its own "
                "(%s); peers joining after it find it",
                " that verifies with this --swarm-key" if closed else "",
                own.hash()[:12],
            )
            event("spec_published", hash=own.hash(), reason="none in the swarm")
            return own
        if swarm_id is not None:
            raise SpecMismatch(
                f"no member of swarm {swarm_id} stores a run spec that this peer can read (is --initial-peers a "
                "node of that swarm? has a member, with --config, started it?)"
            )
        if closed:
            raise SpecMismatch("no run spec in the swarm verifies with this --swarm-key (is it the swarm's key?)")
        raise SpecMismatch(
            "no run spec found in the swarm (is --initial-peers right? a bootstrap node publishes one only "
            "when started with --config; else pass --config)"
        )
    if len({(v["hash"], v["closed"]) for v in found.values()}) > 1:
        named = ", ".join(f"{p[-8:]}: {v['hash'][:12]}" for p, v in found.items())
        raise SpecMismatch(f"the peers in --initial-peers publish different run specs ({named}); join one swarm")
    return _adopt(next(iter(found.values())), own, opts, closed)


def _adopt(remote: dict[str, Any], own: RunSpec, opts: NodeOptions, closed: bool) -> RunSpec:
    """The swarm's spec from its record, after the checks every joiner makes."""
    if remote["closed"] and not closed:
        raise SpecMismatch("this swarm is closed: pass --swarm-key")
    if remote["version"] != PROTOCOL_VERSION:
        raise SpecMismatch(
            f"the swarm speaks protocol {remote['version']}, this peer {PROTOCOL_VERSION}; upgrade locomm"
        )
    if opts.spec_from_user and remote["hash"] != own.hash():
        raise SpecMismatch(
            f"the swarm's run spec {remote['hash'][:12]} differs from yours "
            f"{own.hash()[:12]}; join without --config to take the swarm's"
        )
    spec = RunSpec.from_toml(remote["toml"])
    if spec.hash() != remote["hash"]:
        raise SpecMismatch("the swarm's published spec does not match its own hash")
    if not opts.spec_from_user:
        spec.data.check_from_swarm()  # the swarm's spec never names a path on this disk
    return spec


async def _swarm_copies(dht: Any, swarm_id: str) -> dict[str, dict[str, Any]]:
    try:
        return await fetch_swarm_specs(dht, swarm_id)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # no copy readable now: the initial peers' records next
        log.debug("copies of swarm %s's spec: %s", swarm_id, e)
        return {}


async def _fetch(dht: Any, peer: str) -> dict[str, Any] | None:
    try:
        return await fetch_spec(dht, peer)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # one unreachable initial peer is not fatal
        log.debug("spec of %s: %s", peer[-8:], e)
        return None
