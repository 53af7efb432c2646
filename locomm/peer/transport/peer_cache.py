"""Known peers: the addresses a peer saw last, kept in its checkpoint folder as bootstrap candidates.

A peer restarted from its checkpoint usually names one ``--initial-peers`` address; when that one peer is out of
reach at the time (its machine frozen, its link saturated or down), the restart could not join although the
swarm was there (benchmarks/chaos.py: restarts exited 2, "none of the initial_peers responded to a ping").
The host writes the multiaddrs of up to ``MAX_KNOWN`` live peers it read to ``known_peers.json`` in the
checkpoint folder when it reads a peer the file does not name yet, and at least once every ``REMEMBER_EVERY_S``
(a restart soon after joining finds the peers it met, not an empty list); a restart with ``--initial-peers`` adds them
after the user's to the DHT bootstrap. They are candidates to reach the DHT through, never trusted for the
run spec (only the user's ``--initial-peers`` are, peer/spec_sync.py). Whatever is in the file is checked:
at most ``MAX_KNOWN`` entries, each a short string with a ``/p2p/`` id; anything else is ignored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from locomm.atomic import atomic_write_text
from locomm.protocol.membership import Heartbeat

log = logging.getLogger(__name__)
FILE_NAME = "known_peers.json"
MAX_KNOWN = 8
REMEMBER_EVERY_S = 60.0
MAX_ADDR_CHARS = 300


def _usable(maddr: object, me: str) -> bool:
    return (
        isinstance(maddr, str)
        and len(maddr) <= MAX_ADDR_CHARS
        and "/p2p/" in maddr
        and not (me and maddr.endswith(f"/p2p/{me}"))
    )


def _candidate(b: Heartbeat, me: str) -> bool:
    return b.peer != me and not b.finished and b.started and bool(b.maddrs)


def candidates(beats: Iterable[Heartbeat], me: str) -> frozenset[str]:
    """The peers :func:`remember` would write: live, started, with an address."""
    return frozenset(b.peer for b in beats if _candidate(b, me))


def remember(folder: Path, beats: Iterable[Heartbeat], me: str) -> None:
    """Write the addresses of up to MAX_KNOWN live, started peers (one address each, relayed ones last)."""
    addrs: list[str] = []
    for b in beats:
        if not _candidate(b, me):
            continue
        ordered = sorted(b.maddrs, key=lambda m: "p2p-circuit" in m)
        m = ordered[0] if "/p2p/" in ordered[0] else f"{ordered[0]}/p2p/{b.peer}"
        if _usable(m, me):
            addrs.append(m)
        if len(addrs) == MAX_KNOWN:
            break
    if addrs:
        atomic_write_text(folder / FILE_NAME, json.dumps(addrs))


def recall(folder: Path) -> list[str]:
    """The addresses :func:`remember` wrote (checked), or none."""
    try:
        data = json.loads((folder / FILE_NAME).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, list):
        return []
    return [m for m in data[:MAX_KNOWN] if _usable(m, "")]
