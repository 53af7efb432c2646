"""A swarm that outlives its spec's TTL and its first peers: issue 18's spec and leaving must-shows, on loopback.

One swarm, started the way hivemind and Petals swarms are: a dedicated bootstrap node (`locomm-peer
bootstrap`, no spec, trains nothing) and three peers that join through it with ``--config``. The spec
records live ``LOCOMM_SPEC_TTL_S`` = 4 s here (the test-only setting; every process of the swarm gets it).

- The first of them publishes its spec although it joined through ``--initial-peers`` (the bootstrap node
  has none), and the others take the same run.
- ``a`` leaves after 2 rounds: it hands its last payload over, then says it left. Its partners go on; in no
  round they plan once its goodbye is readable is ``a`` a partner or waited on until a deadline (a wait cut
  short by the goodbye counts as ``gone_skipped``).
- After ``a`` has left and more than 3 TTLs since any peer first stored its spec, a joiner without
  --config, naming ``a`` (gone) and ``b``, finds the spec (``b`` refreshed its record) and trains a round.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_peer import swarm_spec

from locomm.testing.launcher import Launcher, PeerProcess

pytestmark = pytest.mark.timeout(300)
TTL_S = 4.0
ENV = {"LOCOMM_SPEC_TTL_S": str(TTL_S)}
READ_S = 5.0


def _wait(cond, timeout: float, what: str, procs: list[PeerProcess]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None or p.name == "a", f"{p.name} exited ({p.returncode}) waiting for {what}: {p.tail()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s: " + " | ".join(p.tail(600) for p in procs)
        time.sleep(0.25)


def _bootstrap(tmp: Path) -> tuple[subprocess.Popen, str]:
    addr = tmp / "boot.addr"
    cmd = [sys.executable, "-m", "locomm.cli.main", "bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    err = (tmp / "boot.err").open("wb")
    proc = subprocess.Popen(
        [*cmd, "--announce-file", str(addr)], env={**os.environ, **ENV}, stderr=err, start_new_session=True
    )
    deadline = time.monotonic() + 60
    while not (addr.exists() and addr.read_text().strip()):
        assert proc.poll() is None, (tmp / "boot.err").read_text()
        assert time.monotonic() < deadline, "the bootstrap node did not come up"
        time.sleep(0.2)
    return proc, addr.read_text().split()[0]


def test_spec_outlives_ttls_and_its_creator_and_a_leaver_costs_no_wait(tmp_path: Path, launcher: Launcher) -> None:
    cfg = swarm_spec(tmp_path)
    boot, boot_addr = _bootstrap(tmp_path)
    try:
        long = ("--until-round", "100000")
        a = launcher.start("a", "--rounds", "2", "--shard", "0/3", config=cfg, initial_peers=boot_addr, env=ENV)
        t_first = time.monotonic()
        b = launcher.start("b", *long, "--shard", "1/3", config=cfg, initial_peers=boot_addr, env=ENV)
        c = launcher.start("c", *long, "--shard", "2/3", config=cfg, initial_peers=boot_addr, env=ENV)
        peers = [a, b, c]
        _wait(lambda: all(p.events("started") for p in peers), 120, "three started peers", peers)
        runs = {p.events("started")[0]["run"] for p in peers}
        assert len(runs) == 1, runs  # one swarm, though nobody started it without --initial-peers
        published = [p.name for p in peers if p.events("spec_published")]
        assert published, "nobody published a spec into the spec-less bootstrap node"

        # a leaves after its 2 rounds: cleanly, having handed its last payload over, then marked gone.
        assert a.wait(timeout=180) == 0, a.tail()
        (left,) = a.events("left")
        assert left["undelivered"] == [], left
        a_id = a.events("started")[0]["peer"]
        a_last = left["round"]
        # b and c go on past a's departure ...
        _wait(lambda: min(b.round(), c.round()) >= a_last + 3, 120, "rounds after a left", [b, c])

        # ... and a joiner without --config, 3 TTLs on, naming the departed a and b, finds the spec.
        time.sleep(max(0.0, 3 * TTL_S - (time.monotonic() - t_first)))
        d = launcher.start("d", *long, initial_peers=[a.address(), b.address()], env=ENV)
        _wait(lambda: bool(d.events("round")), 120, "a round of the late joiner", [b, c, d])
        assert d.events("started")[0]["run"] in runs
        assert time.monotonic() - t_first > 3 * TTL_S

        for p in (b, c, d):
            p.send_signal(signal.SIGTERM)
        for p in (b, c, d):
            assert p.wait(timeout=90) == 0, p.tail()
        # Rounds are not in step: b or c may have planned a round with a in it before a left (a was still a
        # member). What must hold is about the rounds each planned once a's goodbye could be read (a heartbeat
        # read is at most 1 s old here; READ_S leaves room for a slow read on busy cores).
        seen = left["time"] + READ_S
        for p in (b, c):
            (summary,) = p.events("finished")
            # A round's event is written just after that round's plan: round r + 1's event dates the plan of r.
            planned_at = {e["round"] - 1: e["time"] for e in p.events("round")}
            later = [(r, peer) for r, peer in summary["gave_up_on"] if peer == a_id and planned_at.get(r, 0) > seen]
            assert not later, (p.name, later)  # nobody waits on a departed peer until a deadline
            after = [e for e in p.events("round") if e["time"] > seen]
            assert after and all(a_id not in e["partners"] for e in after), (p.name, after)
            assert p.events("left"), p.name
    finally:
        os.killpg(boot.pid, signal.SIGTERM)
        try:
            boot.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(boot.pid, signal.SIGKILL)
            boot.wait()
