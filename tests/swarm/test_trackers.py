"""Trackers fed from the event log (peer/trackers.py): a 2-peer swarm writes TensorBoard event files and an offline
W&B run per peer, grouped by the swarm's run id; what they hold is read back (TensorBoard's own reader, W&B's
offline run folder). Skips, saying so, where the ``trackers`` extra is not installed (.ci/run installs it)."""

from __future__ import annotations

import pytest
from test_peer import swarm_spec

pytestmark = pytest.mark.timeout(300)


def test_two_peers_write_tensorboard_scalars_and_offline_wandb_runs(tmp_path, launcher, monkeypatch):
    pytest.importorskip("tensorboard", reason="the trackers extra (pip install 'locomm[trackers]') is not installed")
    pytest.importorskip("wandb", reason="the trackers extra (pip install 'locomm[trackers]') is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = swarm_spec(tmp_path, inner_steps=5)
    tb, wb = tmp_path / "tb", tmp_path / "wandb"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wb), "WANDB_SILENT": "true"}
    wb.mkdir()
    args = ("--rounds", "4", "--tensorboard", str(tb), "--wandb", "locomm-test")
    a = launcher.start("a", *args, "--shard", "0/2", "--wait-for-peers", "2", config=cfg, env=env)
    b = launcher.start(
        "b", *args, "--shard", "1/2", "--wait-for-peers", "2", config=cfg, env=env, initial_peers=a.address()
    )
    for p in (a, b):
        assert p.wait(timeout=240) == 0, p.tail()
    run = a.events("started")[0]["run"]
    ids = {p.events("started")[0]["peer"] for p in (a, b)}
    # TensorBoard: one folder per peer under the run id, each with the rounds' losses.
    assert {d.name for d in (tb / run).iterdir()} == ids
    for peer in ids:
        acc = EventAccumulator(str(tb / run / peer))
        acc.Reload()
        assert {"loss", "val_loss", "tokens_per_s", "bytes_sent"} <= set(acc.Tags()["scalars"])
        losses = acc.Scalars("loss")
        assert [e.step for e in losses] == [1, 2, 3, 4] and all(e.value > 0 for e in losses)
    # W&B: one offline run per peer, in the project and the swarm's group, with the spec as its config and the
    # rounds' scalars (the run file is W&B's record log: the strings are in it as written).
    runs = sorted((wb / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    names = set()
    for r in runs:
        data = b"".join(f.read_bytes() for f in r.glob("run-*.wandb"))
        assert b"locomm-test" in data and run.encode() in data and b"noloco" in data, r
        assert data.count(b"val_loss") >= 4 and data.count(b"tokens_per_s") >= 4, r
        names |= {peer for peer in ids if peer.encode() in data}
    assert names == ids
