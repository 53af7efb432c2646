"""A restart whose one --initial-peers address is gone joins through the peers it saw last (peer_cache).

benchmarks/chaos.py found restarts that exited 2 ("none of the initial_peers responded to a ping") while the
swarm was there: their one initial peer was out of reach. Real `locomm-peer join` processes on loopback: b and
c join through a; b keeps a checkpoint folder, where its host writes the peers it read; b stops, a is killed,
b restarts naming only a. Before: exit 2 after its tries. Now: it bootstraps through c and trains with it.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from locomm.config import RunSpec
from locomm.peer.transport.peer_cache import FILE_NAME
from locomm.testing.launcher import Launcher, wait_until

pytestmark = pytest.mark.timeout(300)


def test_a_restart_whose_initial_peer_is_gone_joins_through_the_peers_it_saw(tmp_path: Path, launcher: Launcher):
    spec = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=1.0, batch_size=8, seq_len=64)
        .replace("outer", algo="noloco", inner_steps=10)
        .replace("train", steps=100_000, eval_batches=2, eval_interval=0)
        .replace("network", heartbeat_interval_s=1.0, heartbeat_ttl_s=4.0)
    )
    cfg = tmp_path / "run.toml"
    spec.save(cfg)
    ckpt = tmp_path / "ckpt-b"
    a = launcher.start("a", "--shard", "0/3", "--wait-for-peers", "3", config=cfg)
    boot = a.address()
    b_args = ("--shard", "1/3", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1")
    b = launcher.start("b", *b_args, "--wait-for-peers", "3", config=cfg, initial_peers=boot)
    c = launcher.start("c", "--shard", "2/3", "--wait-for-peers", "3", config=cfg, initial_peers=boot)
    c_id = c.address().rsplit("/p2p/", 1)[1]

    def remembers_c() -> bool:  # written within a heartbeat of b first seeing c alive, which a loaded machine delays
        return (ckpt / FILE_NAME).exists() and any(m.endswith(c_id) for m in json.loads((ckpt / FILE_NAME).read_text()))

    wait_until(lambda: b.round() >= 2 and remembers_c(), 120, "b remembers c", [a, b, c])
    b.send_signal(signal.SIGTERM)
    assert b.wait(60) == 0, b.tail()
    a.send_signal(signal.SIGKILL, group=True)
    a.wait(30)
    again = launcher.start("b2", *b_args, config=cfg, initial_peers=boot)  # only a, which is gone
    wait_until(lambda: again.events("started"), 120, "b is back", [again, c])
    assert again.poll() is None, again.tail()
    start = again.events("started")[0]["round"]
    wait_until(lambda: again.round() >= start + 2, 120, "b trains on", [again, c])
    assert any(e.get("members", 0) >= 2 for e in again.events("round")), again.tail()
