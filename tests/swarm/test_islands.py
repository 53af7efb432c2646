"""Islands (``peer/island/``): peers that sync every step with SCAPE and meet the swarm through one representative.
Real ``locomm-peer`` processes on loopback, with ``LOCOMM_ISLAND_DIGEST=1`` (each member logs a hash of its weights
after every step)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from locomm.config import RunSpec
from locomm.testing.launcher import Launcher, wait_until

pytestmark = pytest.mark.timeout(420)
DIGEST = {"LOCOMM_ISLAND_DIGEST": "1"}


def events(path: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == kind]


def test_two_islands_of_two_sync_every_step_and_meet_by_noloco(tmp_path):
    """``swarm --islands 2x2``: each island's members are bit-identical after every step, the loss falls, the
    representatives exchange by NoLoCo and the followers land every round; inside an island a sparse step moves
    (1 - sparsity) of the dense values plus the mask."""
    keep, rounds, h = tmp_path / "keep", 3, 10
    cmd = [sys.executable, "-m", "locomm.cli.main", "swarm", "--islands", "2x2", "--rounds", str(rounds)]
    cmd += ["--inner-steps", str(h), "--keep", str(keep), "--json", "--plot", str(tmp_path / "p.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, **DIGEST})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rounds_completed"] == rounds and summary["final_loss"] < summary["initial_loss"] - 1.0
    outer = RunSpec.preset("nano").outer
    sparsity, dense = outer.scape_sparsity, max(2, outer.scape_dense_steps)
    assert dense < rounds * h, "no sparse step to check"
    finished = {i: events(keep / f"peer{i}.jsonl", "finished")[0] for i in range(4)}
    for a, b in ((0, 1), (2, 3)):
        steps = {i: {e["step"]: e for e in events(keep / f"peer{i}.jsonl", "island_step")} for i in (a, b)}
        assert sorted(steps[a]) == sorted(steps[b]) == list(range(rounds * h))
        for t in range(rounds * h):  # the same weights after every step
            assert steps[a][t]["digest"] == steps[b][t]["digest"], (a, b, t)
        isl = {i: finished[i]["island"] for i in (a, b)}
        rep, fol = (a, b) if isl[a]["leading"] else (b, a)
        assert not isl[fol]["leading"] and isl[rep]["leader"] == isl[fol]["leader"]
        assert isl[fol]["outer_applied"] == rounds and isl[fol]["failovers"] == 0
        assert finished[rep]["exchanges_ok"] >= 1  # the island met the other one
        for i in (a, b):
            assert finished[i]["final_loss"] < finished[i]["initial_loss"] - 1.0
        for t in range(dense):  # the dense warm-up (steps 0 and 1 at least: no first moment yet)
            assert steps[fol][t]["values"] == steps[fol][t]["dense"] // 4, steps[fol][t]
        for t in range(dense, rounds * h):  # then sparse
            e = steps[fol][t]
            n = e["dense"] // 4
            assert e["values"] <= math.ceil((1 - sparsity) * n) + 2, e
            assert 4 * e["values"] <= e["sent"] <= 4 * e["values"] + 6 * e["values"] // 2 + 8, e  # values + slice
            assert e["received"] <= 4 * e["values"] + 6 * e["values"] + 8, e  # values + the whole next mask
    # the followers are members of no round: the representatives' rounds name only the two of them
    reps = {i for i in range(4) if finished[i]["island"]["leading"]}
    ids = {finished[i]["peer"]: i for i in range(4)}
    for i in reps:
        for e in events(keep / f"peer{i}.jsonl", "round"):
            assert {ids[p] for p in e["member_ids"]} <= reps, e


def spec_file(tmp: Path) -> Path:
    spec = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=1.0, batch_size=8, seq_len=64)
        .replace("inner", name="adams")
        .replace("outer", algo="noloco", inner_steps=10)
        .replace("train", steps=100_000, eval_batches=2, eval_interval=0)  # runs until the test stops it
        .replace("network", request_timeout_s=6.0, stall_timeout_s=3.0, heartbeat_interval_s=1.0, heartbeat_ttl_s=4.0)
    )
    path = tmp / "run.toml"
    spec.save(path)
    return path


def test_island_goes_on_when_its_representative_dies(tmp_path, launcher: Launcher):
    """An island of 2 and a single peer; the island's representative is SIGKILLed mid-run: the other member
    takes over, leads the island's rounds with the single peer (``status`` shows it as the representative),
    and the loss keeps falling. The peers run until the test stops them: once the representative is gone a
    round takes well under a second, and a fixed round count could end before ``status`` reads the swarm."""
    cfg = spec_file(tmp_path)
    until = ("--wait-for-peers", "3", "--eval-every", "0")
    key = tmp_path / "island.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)  # a secret: locomm refuses one others can read
    isl = ("--island", "a", "--island-size", "2", "--island-key", str(key))  # a closed island
    p0 = launcher.start("p0", *until, *isl, "--shard", "0/3", config=cfg, env=DIGEST)
    first = p0.address()
    p1 = launcher.start("p1", *until, *isl, "--shard", "1/3", config=cfg, initial_peers=first, env=DIGEST)
    p2 = launcher.start("p2", *until, "--shard", "2/3", config=cfg, initial_peers=first)
    peers = [p0, p1, p2]
    wait_until(lambda: p0.events("island") and p1.events("island"), 120, "the island forms", peers)
    leader = p0.events("island")[0]["leader"]
    by_id = {}
    wait_until(lambda: all(p.events("started") for p in peers), 120, "all start", peers)
    for p in (p0, p1):
        by_id[p.events("started")[0]["peer"]] = p
    rep = by_id[leader]
    other = p1 if rep is p0 else p0

    wait_until(lambda: rep.round() >= 3, 180, "the representative reaches round 3", peers)
    steps_before = len(other.events("island_step"))
    rep.kill()
    wait_until(lambda: other.events("island_failover"), 60, "the other member takes over", [other, p2])
    fo = other.events("island_failover")[0]
    assert fo["old"] == leader and fo["leader"] == (new := other.events("started")[0]["peer"])

    def status() -> dict:
        cmd = [sys.executable, "-m", "locomm.cli.main", "status", "--initial-peers", other.address(), "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
        if out.returncode != 0 or not out.stdout.strip():
            return {"error": out.stderr[-500:]}
        return json.loads(out.stdout.strip().splitlines()[-1])

    snap: dict = {}

    def island_shown() -> bool:
        snap.clear()
        snap.update(status())
        return (snap.get("islands") or {}).get("a", {}).get("representative") == new

    try:
        wait_until(island_shown, 90, "status shows the island and its representative", [other, p2])
    except TimeoutError:
        raise AssertionError(f"status never showed island 'a' led by {new}: {snap}") from None
    assert new in snap["islands"]["a"]["members"]
    went_on = fo_round(other, fo) + 5
    wait_until(
        lambda: other.round() >= went_on and p2.round() >= went_on, 180, "5 rounds after the failover", [other, p2]
    )
    for p in (other, p2):
        p.send_signal(signal.SIGTERM)
    for p in (other, p2):
        assert p.wait(timeout=90) == 0, p.tail()
    done = other.events("finished")[0]
    assert done["island"]["leading"] and done["rounds_completed"] >= went_on
    assert len(other.events("island_step")) > steps_before + 30  # it went on training
    later = [e for e in other.events("round") if e["round"] >= fo_round(other, fo)]
    assert later and sum(e["answered"] for e in later) >= 1, later  # it exchanged with p2 as the island's voice
    assert done["final_loss"] < done["initial_loss"] - 0.5
    assert p2.events("finished")[0]["final_loss"] < p2.events("finished")[0]["initial_loss"] - 0.5


def fo_round(peer, fo: dict) -> int:
    """The round the peer was in when it took over (its first round event after the failover)."""
    rounds = defaultdict(float)
    for e in peer.events("round"):
        rounds[e["round"]] = e["time"]
    after = [r for r, t in rounds.items() if t >= fo["time"]]
    return min(after) if after else math.inf
