"""Known peers (peer/transport/peer_cache.py): what a restart adds to its DHT bootstrap, checked on the way in."""

from __future__ import annotations

import json

from locomm.peer.transport.peer_cache import (
    BOOT_ATTEMPTS,
    BOOT_PATIENCE_S,
    FILE_NAME,
    MAX_KNOWN,
    candidates,
    recall,
    remember,
    retry_in,
)
from locomm.protocol.membership import Heartbeat


def beat(peer: str, *maddrs: str, **kw) -> Heartbeat:
    return Heartbeat(peer=peer, maddrs=maddrs, started=kw.pop("started", True), **kw)


def test_live_started_peers_are_remembered_one_address_each_direct_first(tmp_path):
    beats = [
        beat("QmMe", "/ip4/1.1.1.1/tcp/1"),
        beat("QmA", "/ip4/2.2.2.2/tcp/2/p2p/QmR/p2p-circuit", "/ip4/2.2.2.2/tcp/3"),
        beat("QmGone", "/ip4/3.3.3.3/tcp/3", finished=True),
        beat("QmNew", "/ip4/4.4.4.4/tcp/4", started=False),
        beat("QmNoAddr"),
    ] + [beat(f"QmX{i}", f"/ip4/5.5.5.{i}/tcp/5") for i in range(20)]
    remember(tmp_path, beats, "QmMe")
    got = recall(tmp_path)
    assert got[0] == "/ip4/2.2.2.2/tcp/3/p2p/QmA" and len(got) == MAX_KNOWN
    assert not any("QmMe" in m or "QmGone" in m or "QmNew" in m for m in got)
    # what the host compares to decide a rewrite: a peer not written yet makes one
    assert candidates(beats, "QmMe") == {"QmA", *(f"QmX{i}" for i in range(20))}


def test_whatever_the_file_holds_is_checked(tmp_path):
    assert recall(tmp_path) == []  # no file
    (tmp_path / FILE_NAME).write_text("not json")
    assert recall(tmp_path) == []
    (tmp_path / FILE_NAME).write_text(json.dumps({"a": 1}))
    assert recall(tmp_path) == []
    junk = [1, "/ip4/1.1.1.1/tcp/1", "/ip4/1.1.1.1/tcp/1/p2p/" + "Q" * 400, "/ip4/1.1.1.1/tcp/1/p2p/QmOk"]
    (tmp_path / FILE_NAME).write_text(json.dumps(junk + ["/ip4/9.9.9.9/tcp/9/p2p/QmLate"] * 20))
    assert recall(tmp_path) == ["/ip4/1.1.1.1/tcp/1/p2p/QmOk", *["/ip4/9.9.9.9/tcp/9/p2p/QmLate"] * 4]


def test_a_first_join_gives_up_soon_and_a_restart_that_remembers_peers_keeps_trying_for_minutes():
    """A first join (only the user's address) gives up after BOOT_ATTEMPTS tries, about 40 s: a wrong address
    says so soon. A restart whose folder remembers peers keeps trying for BOOT_PATIENCE_S, 30 s apart at most
    (chaos seed 13: a restart exited 2 after 65 s while every live peer it knew was faulted at once)."""

    def schedule(remembered: bool) -> list[float]:
        waits, elapsed = [], 3.0  # each try itself takes a few seconds
        for attempt in range(1000):
            wait = retry_in(attempt, elapsed, remembered)
            if wait is None:
                return waits
            waits.append(wait)
            elapsed += wait + 3.0
        raise AssertionError("never gave up")

    first = schedule(False)
    assert first == [2.0, 4.0, 8.0, 16.0] and len(first) == BOOT_ATTEMPTS - 1
    restart = schedule(True)
    assert restart[:5] == [2.0, 4.0, 8.0, 16.0, 30.0] and max(restart) == 30.0
    assert BOOT_PATIENCE_S <= sum(restart) + 3.0 * (len(restart) + 1) <= BOOT_PATIENCE_S + 30.0 + 3.0
