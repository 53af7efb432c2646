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

How long a start keeps trying to reach the swarm (:func:`retry_in`) depends on it too: a first join names only
what the user typed, and a wrong address should say so soon; a restart that remembers peers it trained with
keeps trying for minutes, since every peer it knows may be out of reach together for a while (a home link
down; in a chaos run every live peer was faulted at once, and a restart exited 2 after 65 s).
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
BOOT_ATTEMPTS = 5
"""Tries at reaching the swarm (2, 4, 8 and 16 s apart: about 40 s) before a first join gives up with a one-line
error. Three (6 s) let a restart whose one initial peer was briefly out of reach (its link at 1 Mbit/s, its
machine frozen: benchmarks/chaos.py) exit 2 where waiting half a minute more would have joined."""
BOOT_PATIENCE_S = 300.0
"""How long a restart that remembers peers keeps trying, at least (BOOT_BACKOFF_MAX_S apart once past 30 s)."""
BOOT_BACKOFF_MAX_S = 30.0


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


def retry_in(attempt: int, elapsed_s: float, remembered: bool) -> float | None:
    """After failed try ``attempt`` (0-based), ``elapsed_s`` after the first began: the seconds until the next
    one, or None to give up. ``remembered``: the checkpoint folder named peers this identity trained with."""
    if attempt + 1 >= BOOT_ATTEMPTS and (not remembered or elapsed_s >= BOOT_PATIENCE_S):
        return None
    return min(float(2 << min(attempt, 8)), BOOT_BACKOFF_MAX_S)
