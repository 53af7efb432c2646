"""Known peers (peer/transport/peer_cache.py): what a restart adds to its DHT bootstrap, checked on the way in."""

from __future__ import annotations

import json

from locomm.peer.transport.peer_cache import FILE_NAME, MAX_KNOWN, candidates, recall, remember
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
