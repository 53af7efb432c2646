"""Swarm tests of a volunteer's controls: pause and resume a peer in a running swarm, and restart a whole swarm
from its peers' checkpoints after every peer stopped. Real `locomm-peer join` processes on loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from locomm.config import RunSpec
from locomm.testing.launcher import Launcher, PeerProcess, wait_until

pytestmark = pytest.mark.timeout(420)


def spec_file(tmp: Path, steps: int = 400) -> Path:
    spec = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=1.0, batch_size=8, seq_len=64)
        .replace("outer", algo="noloco", inner_steps=10)
        .replace("train", steps=steps, eval_batches=2, eval_interval=0)
        .replace(
            "network",
            request_timeout_s=6.0,
            stall_timeout_s=3.0,
            heartbeat_interval_s=1.0,
            heartbeat_ttl_s=4.0,
        )
    )
    path = tmp / "run.toml"
    spec.save(path)
    return path


def start_three(launcher: Launcher, cfg: Path, dirs: list[Path], until: int) -> list[PeerProcess]:
    """Three peers (shards i/3, a checkpoint folder each) that start together and train to round ``until``."""
    end = ("--until-round", str(until), "--wait-for-peers", "3", "--eval-every", "0")
    peers: list[PeerProcess] = []
    for i in range(3):
        args = (*end, "--checkpoint-dir", str(dirs[i]), "--shard", f"{i}/3")
        peers.append(launcher.start(f"p{i}", *args, config=cfg, initial_peers=peers[0].address() if peers else None))
    return peers


def control(cmd: str, checkpoint_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "locomm.cli.main", cmd, "--checkpoint-dir", str(checkpoint_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def wait_per_round(peer: PeerProcess, lo: int, hi: int) -> list[float]:
    """The seconds ``peer`` waited on exchanges in each round in [lo, hi) (round events carry the running sum)."""
    total = {e["round"]: e["wait_s"] for e in peer.events("round")}
    return [total[r] - total[r - 1] for r in range(lo, hi) if r in total and r - 1 in total]


def test_pause_and_resume(tmp_path, launcher):
    """A paused peer stops training, says so, and nobody waits for it; resumed, it enters again and finishes."""
    cfg = spec_file(tmp_path)
    dirs = [tmp_path / f"c{i}" for i in range(3)]
    # 40 rounds: the other two must still be training (donors) when peer 2 resumes, however loaded the machine.
    peers = start_three(launcher, cfg, dirs, 40)
    wait_until(lambda: min(p.round() for p in peers) >= 3, 180, "3 peers reach round 3", peers)

    bad = control("pause", tmp_path / "nowhere")
    assert bad.returncode == 2 and "no running peer" in bad.stderr
    out = control("pause", dirs[2])
    assert out.returncode == 0, out.stderr
    wait_until(lambda: peers[2].events("paused"), 60, "p2 pauses", peers)
    paused_at = peers[2].events("paused")[0]["round"]
    # While it is paused the other two go on without it: 4 rounds, and p2 trains none of them.
    start = max(p.round() for p in peers[:2])
    wait_until(lambda: min(p.round() for p in peers[:2]) >= start + 4, 120, "the others go on", peers)
    assert peers[2].round() <= paused_at
    # Rounds that began after the pause was published: no partner waited on p2 (no round waited for a deadline).
    for p in peers[:2]:
        waits = wait_per_round(p, start + 2, start + 4)
        assert waits and max(waits) < 3.0, (p.name, waits)
        late = [e for e in p.events("round") if e["round"] > start + 1]
        assert late and all(peers[2].events("started")[0]["peer"] not in e["member_ids"] for e in late), late

    out = control("resume", dirs[2])
    assert out.returncode == 0, out.stderr
    wait_until(lambda: peers[2].events("resumed"), 60, "p2 resumes", peers)
    resumed = peers[2].events("resumed")[0]
    assert resumed["round"] > paused_at  # it entered again ahead of the swarm, with the swarm's state
    assert peers[2].events("synced"), ("a peer resumed rounds behind takes the swarm's state", peers[2].events()[-8:])
    for p in peers:
        assert p.wait(timeout=240) == 0, p.tail()
    assert peers[2].events("finished")[0]["rounds_completed"] == 40
    assert not (dirs[2] / "control.sock").exists()  # the socket goes with the peer


def test_swarm_restarts_from_checkpoints(tmp_path):
    """3 peers train to round 4 and all stop; 2 restart from their checkpoints (the first with --resume-from and
    no spec): the round counter continues and the loss continues from where it was, not from scratch."""
    cfg = spec_file(tmp_path)
    dirs = [tmp_path / f"c{i}" for i in range(3)]
    with Launcher(tmp_path / "first", grace_s=5.0) as first:
        peers = start_three(first, cfg, dirs, 4)
        for p in peers:
            assert p.wait(timeout=240) == 0, p.tail()
    stopped = {p.name: p.events("finished")[0] for p in peers}
    assert all(f["rounds_completed"] == 4 for f in stopped.values())

    with Launcher(tmp_path / "again", grace_s=5.0) as again:
        end = ("--until-round", "7", "--eval-every", "0")
        a = again.start("p0", *end, "--resume-from", str(dirs[0]), "--wait-for-peers", "2")
        b = again.start(
            "p1", *end, "--checkpoint-dir", str(dirs[1]), "--wait-for-peers", "2", initial_peers=a.address()
        )
        for p in (a, b):
            assert p.wait(timeout=240) == 0, p.tail()
    for p, before in ((a, stopped["p0"]), (b, stopped["p1"])):
        up, fin = p.events("started")[0], p.events("finished")[0]
        assert up["resumed"] and up["round"] == 4, up  # both continue at the stopped round, together
        # The first evaluation after the restart is the one before the stop, within 2%.
        assert abs(fin["initial_loss"] - before["final_loss"]) <= 0.02 * before["final_loss"], (fin, before)
        assert fin["final_loss"] < before["final_loss"]
        assert fin["rounds_completed"] == 7 and fin["exchanges_ok"] > 0


def pipeline_spec_file(tmp: Path) -> Path:
    spec = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=1.0, batch_size=8, seq_len=64)
        .replace("outer", algo="noloco", inner_steps=40)  # rounds of seconds, heartbeats every second
        .replace("train", steps=4000, eval_batches=2, eval_interval=0)  # stopped by the test long before
        .replace("network", request_timeout_s=10.0, stall_timeout_s=10.0, heartbeat_interval_s=1.0, heartbeat_ttl_s=6.0)
        .replace("pipeline", stages=2, micro_batch_size=4, in_flight=2, stage_timeout_s=20.0)
    )
    path = tmp / "pipe.toml"
    spec.save(path)
    return path


def test_pipeline_stage_pause_and_resume(tmp_path, launcher):
    """A 2-stage pipeline, one stage-0 replica and two of stage 1. A paused stage-1 replica leaves every route
    (its sibling takes all micro-batches, none is lost) and every replica-sync round; the last unpaused replica of
    a stage may not pause; resumed, the paused one takes the stage's newer state and serves again."""
    cfg = pipeline_spec_file(tmp_path)
    dirs = [tmp_path / f"c{i}" for i in range(3)]
    common = ("--wait-for-peers", "3", "--eval-every", "0")
    s0 = launcher.start("s0", "--stage", "0", "--checkpoint-dir", str(dirs[0]), *common, config=cfg)
    s1, s2 = (
        launcher.start(
            f"s{i}", "--stage", "1", "--checkpoint-dir", str(dirs[i]), *common, config=cfg, initial_peers=s0.address()
        )
        for i in (1, 2)
    )
    peers = [s0, s1, s2]

    def steps() -> int:
        return max((e["step"] for e in s0.events("step")), default=0)

    def syncs(p: PeerProcess) -> list[dict]:
        return p.events("replica_sync")

    wait_until(lambda: len(syncs(s2)) >= 2, 180, "s2 takes part in two replica-sync rounds", peers)
    out = control("pause", dirs[2])
    assert out.returncode == 0, out.stderr
    wait_until(lambda: s2.events("paused"), 60, "s2 pauses", peers)
    paused = s2.events("paused")[0]
    me2 = s2.events("started")[0]["peer"]
    # The last unpaused replica of stage 1 may not pause: the pipeline would lose every micro-batch.
    refused = control("pause", dirs[1])
    assert refused.returncode != 0 and "only replica of stage 1" in refused.stderr, refused.stderr
    # While s2 is paused the pipeline goes on through s1 alone: three more rounds, no micro-batch lost for s2.
    first = max(e["round"] for e in syncs(s1))
    wait_until(lambda: max(e["round"] for e in syncs(s1)) >= first + 3, 180, "s1 syncs 3 more rounds", peers)
    assert not [e for e in s0.events("lost") if "paused" in e["why"]], s0.events("lost")
    assert not [e for e in syncs(s2) if e["round"] >= paused["round"]], syncs(s2)[-3:]
    # s1 leaves s2 out of its rounds once it has read the paused heartbeat (read every second; a round may
    # start just before that read, and s1 then stops waiting on s2 when it reads it).
    late = [e for e in syncs(s1) if e["round"] >= paused["round"] + 2]
    assert late and all(me2 not in e["member_ids"] for e in late), late

    out = control("resume", dirs[2])
    assert out.returncode == 0, out.stderr
    wait_until(lambda: s2.events("resumed"), 60, "s2 resumes", peers)
    resumed = s2.events("resumed")[0]
    assert resumed["round"] > paused["round"], (paused, resumed)
    assert s2.events("synced"), ("a replica resumed rounds behind takes the stage's state", s2.events()[-8:])
    # It serves again: micro-batches reach it, so its data clock moves it through replica-sync rounds.
    wait_until(
        lambda: [e for e in syncs(s2) if e["round"] >= resumed["round"]], 180, "s2 syncs after the resume", peers
    )
    # Stage 0's replica may pause (the pipeline idles, nothing is lost): it stops at a step boundary.
    out = control("pause", dirs[0])
    assert out.returncode == 0, out.stderr
    wait_until(lambda: s0.events("paused"), 60, "s0 pauses", peers)
    at = steps()
    assert at == s0.events("paused")[0]["step"]
    time.sleep(2.0)
    assert steps() == at  # no step while paused
    assert control("resume", dirs[0]).returncode == 0
    wait_until(lambda: steps() > at, 60, "s0 trains again", peers)
    # A later stage that is paused when stage 0 ends the run ends with it.
    assert control("pause", dirs[2]).returncode == 0
    wait_until(lambda: len(s2.events("paused")) == 2, 60, "s2 pauses again", peers)
    s0.send_signal(signal.SIGTERM)  # stage 0 ends the run: the later stages finish once it has
    for p in peers:
        assert p.wait(timeout=120) == 0, p.tail()
    assert s0.events("finished") and s2.events("finished")


def test_join_plan_with_initial_peers_plans_the_swarms_signed_spec(tmp_path, launcher):
    """`join --plan --initial-peers` plans the batch of the swarm one is about to join (its signed spec: here
    batch 8 x 64), not the local preset (nano: a different batch), and trains nothing: no heartbeat, no member."""
    cfg = spec_file(tmp_path)
    peer = launcher.start("p0", "--until-round", "100000", config=cfg)
    boot = peer.address()
    r = subprocess.run(
        [sys.executable, "-m", "locomm.cli.main", "join", "--plan", "--initial-peers", boot]
        + ["--device", "cpu", "--max-memory", "8GiB", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout.strip().splitlines()[-1])
    swarm, local = RunSpec.load(cfg), RunSpec.preset("nano")
    assert (plan["batch_size"], plan["seq_len"]) == (swarm.data.batch_size, swarm.data.seq_len) == (8, 64)
    assert (local.data.batch_size, local.data.seq_len) != (8, 64)
    status = subprocess.run(
        [sys.executable, "-m", "locomm.cli.main", "status", "--initial-peers", boot, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert len(json.loads(status.stdout.strip().splitlines()[-1])["peers"]) == 1  # it joined nothing
