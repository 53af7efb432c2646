"""Peers behind NAT: 4 real nano peers in network namespaces, the last two behind a MASQUERADE router each.

A NATed peer can dial out but nobody can dial in; both join through the first (open) peer with ``--reachability
private`` and reserve a libp2p circuit-relay (v2) slot on the open hosts (peer 0 and 3 bare relays, ``--relays
3``: go-libp2p's auto-relay waits for 4 candidates; each relay checks before it announces itself that a relayed
connection through it carries more than go-libp2p's default 128 KiB, through which no NAT-NAT payload arrives;
hivemind's p2pd served that one on 7 of 8 relay starts with Go's default thread count, and on none of 22 with
the one Go thread every relaying public p2pd now starts with: locomm/testing/relay.py, docs/results/nat.md).
NoLoCo with a group of 4 for 4 rounds: everyone exchanges with everyone every round, so the two NATed peers
exchange with each other every round, which only a relay (or a hole-punched connection) can carry. Every ordered
pair, the NAT-to-NAT one included, must exchange in all rounds but at most one, and at most one push per peer
may find no route: a partner can miss a round's ETA on busy cores and be skipped at its deadline (the daemon's
rule against stragglers), and in about 1 of 4 runs a NATed peer's relay slot comes up late, after a push to it
in the first rounds (measured: 48/48, 48/48, 48/48 and 45/48 with one unreachable; docs/results/nat.md). Every
payload's path (pushed / pulled, over a direct / relayed connection: ``locomm/peer/transport/paths.py``) is checked
against its pair: open-open direct, NAT-NAT relayed (or direct once hole-punched), and the NATed peers'
connections all outbound. The lab's bridge subnet is 11.77.X (``--wan``): libp2p treats a relay it reaches on a
private address as a LAN one and announces no relayed address through it. The open peers join with
``--reachability public`` (benchmarks/links.py ``--open-reachability public``), so they serve as relays from their
start: each must have checked its relay service, as the bare relays do. Runs benchmarks/links.py (the same
bench, so the two cannot drift) and reads its JSON. Skipped unless netlab (root, iproute2, iptables) is
available.
About 60 s on 2 cores, 100 s under load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from locomm.peer.transport.reach import RELAY_STARTS
from locomm.peer.transport.relay_check import PROBE_BYTES
from locomm.testing import netlab

ROOT = Path(__file__).resolve().parents[2]
OK, WHY = netlab.available(nat=True)
pytestmark = [pytest.mark.skipif(not OK, reason=f"netlab NAT unavailable: {WHY}"), pytest.mark.timeout(320)]

ROUNDS = 4
PEERS, NAT = 4, 2


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


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
    for err in sorted(logs.glob("relay*.err")):  # which relays checked their service, and what they carried
        lines.append(f"{err.stem}: " + " | ".join(ln[:200] for ln in err.read_text(errors="replace").splitlines()[:10]))
    for i in range(PEERS):
        checks = [e for e in _events(logs / f"peer{i}.jsonl") if e.get("event") == "relay_checked"]
        lines.append(f"peer {i} relay checks: {[(e.get('start'), e.get('carried')) for e in checks]}")
    return "\n".join(lines)


def test_four_peers_two_behind_nat_all_pairs_exchange(tmp_path):
    out = tmp_path / "nat.json"
    logs = tmp_path / "logs"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "links.py"),
        "--config",
        str(ROOT / "benchmarks" / "configs" / "links-nano-nat.toml"),
        "--peers",
        str(PEERS),
        "--nat",
        str(NAT),
        "--relays",
        "3",
        "--open-reachability",
        "public",
        "--wan",
        "11.77",
        "--rounds",
        str(ROUNDS),
        "--rate",
        "80mbit",
        "--timeout",
        "200",
        "--grace",
        "15",
        "--quiet",
        "--out",
        str(out),
        "--keep",
        str(logs),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        _, stderr = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.exists(), f"no result (exit {proc.returncode}):\n{stderr[-3000:]}"
    result = json.loads(out.read_text())
    why = _why(result, logs) + "\npaths: " + json.dumps(result.get("path_counts"))
    # nothing of the run is left behind: none of the bench's namespaces (named after its pid; other labs on the
    # machine may come and go meanwhile)
    left = [ns for ns in netlab.list_netns() if ns.startswith(f"{netlab.PREFIX}{proc.pid}x")]
    assert not left, f"the bench left namespaces behind: {left}"
    peers = result["per_peer"]
    assert [p["nat"] for p in peers] == [False, False, True, True], why
    for p in peers[2:]:
        assert p["ip"].startswith("192.168.") and p["public_ip"] != p["ip"], why
    assert result["error"] is None and not result["timed_out"], why
    for p in peers:
        s = p["summary"]
        assert p["returncode"] == 0, why
        assert s["rounds_completed"] == ROUNDS, why
        # A group of 4: every partner, every round. On busy cores a partner can miss a round's ETA and be
        # skipped (a deadline give-up, the daemon's rule against stragglers); never for want of a route.
        assert s["exchanges_ok"] + s["exchanges_failed"] == ROUNDS * (PEERS - 1), why
        assert s["exchanges_failed"] <= PEERS - 1, why
        assert p["extra_summary_keys"]["unreachable"] <= 1, why  # a push before the relay slot was reserved
        assert p["paths_source"] is not None, why
    # every payload that arrived has its path, and each pair's path is the one its kind allows
    rows = result["paths"]
    got = {(r["round"], r["receiver"], r["sender"]) for r in rows}
    assert len(got) == len(rows) == sum(p["summary"]["exchanges_ok"] for p in peers), why
    for i in range(PEERS):  # every ordered pair, the NAT-to-NAT one too, in all rounds but at most one
        for j in set(range(PEERS)) - {i}:
            assert sum((k, i, j) in got for k in range(ROUNDS)) >= ROUNDS - 1, (i, j, why)
    for r in rows:
        assert r["via"] in ("push", "pull"), why
        if r["pair"] == "open-open":
            assert r["conn"] == "direct", why
        elif r["pair"] == "nat-nat":  # no route between two NATs but a relay, or a hole punched through both
            assert r["conn"] in ("relay", "direct"), why
        else:  # the NATed peer's own outbound connection, or the relay
            assert r["conn"] in ("direct", "relay"), why
    nat_nat = [r for r in rows if r["pair"] == "nat-nat"]
    assert len(nat_nat) >= 2 * (ROUNDS - 1), why
    # the NATed peers' connections are all ones they opened: from their private address to open hosts
    for p in peers[2:]:
        conns = p["tcp_connections"]
        assert conns and all(c.startswith(p["ip"] + ":") for c in conns), why
    # the open peers join with --reachability public: each checked its relay service before it served
    # (peer/transport/relay_check.py), restarting p2pd while the limited one served, at most RELAY_STARTS times;
    # with one Go thread the wide one serves, so the last start must have carried the probe
    for i in (0, 1):
        checks = [e for e in _events(logs / f"peer{i}.jsonl") if e.get("event") == "relay_checked"]
        assert checks and [e["start"] for e in checks] == list(range(1, len(checks) + 1)), (i, checks, why)
        assert len(checks) <= RELAY_STARTS, (i, checks)
        assert all(e["carried"] < PROBE_BYTES for e in checks[:-1]), (i, checks)
        assert checks[-1]["carried"] >= PROBE_BYTES, (i, checks)
