"""A peer behind NAT: 3 real nano peers in network namespaces, the last one behind a MASQUERADE router.

The NATed peer can dial out but nobody can dial in; it joins through the first (open) peer. Every
peer must finish its rounds with every exchange answered: the open peers reach the NATed one only
over connections it opened (libp2p reuses a live connection), or through whatever fallback the
daemon has. Runs benchmarks/links.py --nat 1 (the same bench, so the two cannot drift) and reads its
JSON. Skipped unless netlab (root, iproute2, iptables) is available. About 40 s on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from locomm.testing import netlab

ROOT = Path(__file__).resolve().parents[2]
OK, WHY = netlab.available(nat=True)
pytestmark = [pytest.mark.skipif(not OK, reason=f"netlab NAT unavailable: {WHY}"), pytest.mark.timeout(240)]

ROUNDS = 2


def _why(result: dict, logs: Path) -> str:
    """The evidence for a failure message: each peer's summary, links, connections and log lines."""
    lines = [f"error={result.get('error')} timed_out={result.get('timed_out')} totals={result.get('totals')}"]
    for p in result.get("per_peer", []):
        lines.append(
            f"peer {p['index']} nat={p['nat']} ip={p['ip']} rc={p['returncode']} summary={p['summary']} "
            f"extra={p.get('extra_summary_keys')} connections={p.get('tcp_connections')}"
        )
        err = logs / f"peer{p['index']}.err"
        if err.exists():
            tail = [ln for ln in err.read_text(errors="replace").splitlines() if ln.strip()][-25:]
            lines += ["    " + ln[:300] for ln in tail]
    return "\n".join(lines)


def test_three_peers_one_behind_nat(tmp_path):
    out = tmp_path / "nat.json"
    logs = tmp_path / "logs"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "links.py"),
        "--config",
        str(ROOT / "benchmarks" / "configs" / "links-nano.toml"),
        "--peers",
        "3",
        "--nat",
        "1",
        "--rounds",
        str(ROUNDS),
        "--rate",
        "80mbit",
        "--timeout",
        "150",
        "--grace",
        "15",
        "--quiet",
        "--out",
        str(out),
        "--keep",
        str(logs),
    ]
    before = set(netlab.list_netns())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert out.exists(), f"no result (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    why = _why(result, logs)
    # nothing of the run is left behind
    assert not set(netlab.list_netns()) - before, "the bench left namespaces behind"
    peers = result["per_peer"]
    assert [p["nat"] for p in peers] == [False, False, True], why
    assert peers[2]["ip"].startswith("192.168.") and peers[2]["public_ip"] != peers[2]["ip"], why
    assert result["error"] is None and not result["timed_out"], why
    for p in peers:
        s = p["summary"]
        assert p["returncode"] == 0, why
        assert s["rounds_completed"] == ROUNDS, why
        assert s["exchanges_ok"] > 0, why
        assert s["exchanges_failed"] == 0, why
    # the NATed peer's connections are all ones it opened: from its private address to the open peers
    nat_conns = peers[2]["tcp_connections"]
    assert nat_conns and all(c.startswith(peers[2]["ip"] + ":") for c in nat_conns), why
