"""DiLoCo across machines: 2 real nano peers in 2 network namespaces all-reduce over hivemind's averager.

The DiLoCo baseline's averager runs its own hivemind.DHT (a second p2pd per peer,
peer/dataparallel/averaging.py).
It used to listen on 127.0.0.1 only, so two machines could never average; it now binds the node's host
addresses' IPs (and announces its announce addresses, with the node's relay settings). Runs
benchmarks/links.py --algo diloco with 2 peers for 2 rounds, each in its own namespace (no loopback
between them), and checks that every round's all-reduce averaged both peers. Skipped unless netlab (root,
iproute2) is available. About 45 s on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from locomm.testing import netlab

ROOT = Path(__file__).resolve().parents[2]
OK, WHY = netlab.available()
pytestmark = [pytest.mark.skipif(not OK, reason=f"netlab unavailable: {WHY}"), pytest.mark.timeout(300)]

ROUNDS = 2


def test_two_diloco_peers_in_two_namespaces_average_every_round(tmp_path):
    out = tmp_path / "diloco.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "links.py"),
        "--config",
        str(ROOT / "benchmarks" / "configs" / "links-nano.toml"),
        "--algo",
        "diloco",
        "--peers",
        "2",
        "--rounds",
        str(ROUNDS),
        "--rate",
        "none",
        "--timeout",
        "200",
        "--grace",
        "15",
        "--quiet",
        "--out",
        str(out),
    ]
    before = set(netlab.list_netns())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=260, cwd=ROOT)
    assert out.exists(), f"no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert not set(netlab.list_netns()) - before, "the bench left namespaces behind"
    peers = result["per_peer"]
    why = json.dumps(
        [{k: p.get(k) for k in ("index", "ip", "returncode", "summary", "stderr_tail")} for p in peers], default=str
    )[-6000:]
    assert result["algo"] == "diloco" and result["error"] is None and not result["timed_out"], why
    assert len({p["ip"] for p in peers}) == 2, why
    for p in peers:
        s = p["summary"]
        assert p["returncode"] == 0, why
        assert s["rounds_completed"] == ROUNDS, why
        # each round's all-reduce averaged with the other peer (a group of 2: one partner per round)
        assert s["exchanges_ok"] == ROUNDS and s["exchanges_failed"] == 0, why
        # a round event reports the round before it (the exchange is applied one round late): all of them 1
        answered = [e.get("answered") for e in p["events"] if e.get("event") == "round"]
        assert answered[1:] == [1] * (ROUNDS - 1), why
