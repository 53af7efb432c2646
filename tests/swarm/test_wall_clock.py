"""A peer whose wall clock is off: real `locomm-peer join` processes on loopback, one of them stepped.

hivemind's DHT bootstrap asks the initial peer for its time and, strict by default, refuses to start when
the two differ by over 3 s (``MAX_DHT_TIME_DISCREPANCY_SECONDS``): one peer with a wrong clock kept every
newcomer that named it as initial peer out of the swarm (benchmarks/chaos.py's clock_step found it: joiners
exited 2, "local time must be within 3 seconds of others"). The peer's clock is stepped by the LD_PRELOAD
shim of locomm/testing/wallclock.py (CLOCK_REALTIME only, as an NTP step); skipped without a C compiler.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from locomm.config import RunSpec
from locomm.testing import wallclock
from locomm.testing.launcher import Launcher, wait_until

pytestmark = pytest.mark.timeout(240)


def _setup(tmp_path: Path, spec: RunSpec, steps: int = 400) -> tuple[Path, Path]:
    """The clock shim (or the test is skipped) and a small nano run spec's file."""
    shim, why = wallclock.build(tmp_path)
    if shim is None:
        pytest.skip(why)
    spec = (
        spec.replace("data", max_corpus_mb=1.0, batch_size=8, seq_len=64)
        .replace("outer", algo="noloco", inner_steps=10)
        .replace("train", steps=steps, eval_batches=2, eval_interval=0)
    )
    cfg = tmp_path / "run.toml"
    spec.save(cfg)
    return shim, cfg


def test_a_newcomer_without_config_joins_through_a_peer_whose_clock_is_30_s_behind(
    tmp_path: Path, launcher: Launcher
) -> None:
    """A writer 30 s behind stamps its records to expire 30 s early by its readers' clocks: with short lifetimes
    (a 20 s spec record, 12 s heartbeats, as benchmarks/chaos.py runs) every record of it had expired for every
    reader when it was stored. Before writers added MAX_CLOCK_SKEW_S to every lifetime, b started but never
    counted a as a member (this test timed out at "b sees a"). hivemind's bootstrap refuses the 30 s as well
    (strict): the host joins anyway."""
    short_beats = RunSpec.preset("nano").replace("network", heartbeat_interval_s=3.0, heartbeat_ttl_s=12.0)
    shim, cfg = _setup(tmp_path, short_beats)
    behind = wallclock.Clock(shim, tmp_path / "a.clock")
    behind.step(-30.0)
    short = {"LOCOMM_SPEC_TTL_S": "20"}
    wait = ("--wait-for-peers", "2")
    a = launcher.start("a", "--shard", "0/2", *wait, config=cfg, env={**behind.env(), **short})
    boot = a.address()
    b = launcher.start("b", "--shard", "1/2", *wait, initial_peers=boot, env=short)
    wait_until(lambda: b.events("started"), 120, "b is up", [a, b])
    assert b.poll() is None, b.tail()
    err = b.err.read_text(errors="replace")
    assert "the initial peer's clock differs from ours by over 3 s" in err, err[-2000:]
    # a's heartbeats are read: b counts it a member and exchanges with it
    wait_until(lambda: any(e.get("members", 0) >= 2 for e in b.events("round")), 120, "b sees a", [a, b])


def test_a_newcomer_without_config_joins_through_a_peer_whose_clock_is_30_s_ahead(
    tmp_path: Path, launcher: Launcher
) -> None:
    """A writer 30 s ahead stamps its records 30 s later than the reader expects: with short lifetimes (a
    20 s spec record, 12 s heartbeats, as benchmarks/chaos.py runs) every record of it was refused (past
    now + 2 x TTL), so a newcomer without --config that named it found no spec and exited 2. The validator
    now allows the writer's clock MAX_CLOCK_SKEW_S ahead."""
    short_beats = RunSpec.preset("nano").replace("network", heartbeat_interval_s=3.0, heartbeat_ttl_s=12.0)
    shim, cfg = _setup(tmp_path, short_beats)
    ahead = wallclock.Clock(shim, tmp_path / "a.clock")
    ahead.step(30.0)
    short = {"LOCOMM_SPEC_TTL_S": "20"}
    wait = ("--wait-for-peers", "2")  # a trains only once b is there
    a = launcher.start("a", "--shard", "0/2", *wait, config=cfg, env={**ahead.env(), **short})
    boot = a.address()
    b = launcher.start("b", "--shard", "1/2", *wait, initial_peers=boot, env=short)
    wait_until(lambda: b.events("started"), 120, "b is up", [a, b])
    assert b.poll() is None, b.tail()
    # a's heartbeats are stored and read: b counts it a member and exchanges with it
    wait_until(lambda: any(e.get("members", 0) >= 2 for e in b.events("round")), 120, "b sees a", [a, b])


def test_a_peer_whose_clock_steps_follows_the_swarms_time_and_comes_back(tmp_path: Path, launcher: Launcher) -> None:
    """c's clock is 30 s ahead of a's and b's: within a clock check (dht_clock.CHECK_S) its DHT time follows the
    median of theirs and its own (peer/transport/dht_clock.py), while a and b, a majority with their own clock,
    never move; once c's clock is stepped back, c's DHT time is its wall clock again. Before the DHT clock, c's
    records were 30 s off everyone's, and two peers stepped opposite ways were 60 s apart, past the skew records
    tolerate. Its bootstrap through a and b leaves no traceback of hivemind's refused pings (Host's loop handler)."""
    short_beats = RunSpec.preset("nano").replace("network", heartbeat_interval_s=3.0, heartbeat_ttl_s=12.0)
    shim, cfg = _setup(tmp_path, short_beats, steps=10_000)  # training outlasts the test, which stops the peers
    ahead = wallclock.Clock(shim, tmp_path / "c.clock")
    ahead.step(30.0)
    wait = ("--wait-for-peers", "3")
    a = launcher.start("a", "--shard", "0/3", *wait, config=cfg)
    boot = a.address()
    b = launcher.start("b", "--shard", "1/3", *wait, initial_peers=boot, config=cfg)
    both = [boot, b.address()]  # hivemind's strict bootstrap pings both: one refusal raised, the other unretrieved
    c = launcher.start("c", "--shard", "2/3", *wait, initial_peers=both, config=cfg, env=ahead.env())
    peers = [a, b, c]
    wait_until(lambda: c.events("dht_clock"), 120, "c follows the swarm's time", peers)
    first = c.events("dht_clock")[0]
    assert -31.0 <= first["offset_s"] <= -29.0, first
    wait_until(lambda: any(e.get("members", 0) >= 3 for e in b.events("round")), 120, "b counts c", peers)
    ahead.step(0.0)
    wait_until(lambda: len(c.events("dht_clock")) >= 2, 60, "c's clock is back", peers)
    assert abs(c.events("dht_clock")[-1]["offset_s"]) < 1.0, c.events("dht_clock")
    assert not a.events("dht_clock") and not b.events("dht_clock"), (a.events("dht_clock"), b.events("dht_clock"))
    assert "never retrieved" not in c.err.read_text(errors="replace")  # the refused pings: one warning, no traceback
