"""`locomm-peer doctor` against a real peer on loopback: every swarm check runs and measures something."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from locomm.config import RunSpec
from locomm.testing.launcher import Launcher

pytestmark = pytest.mark.timeout(120)


def doctor(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "locomm.cli.main", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_doctor_against_a_live_peer(tmp_path: Path, launcher: Launcher) -> None:
    spec = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=0.5, batch_size=4, seq_len=32)
        .replace("outer", algo="noloco", inner_steps=5)
        .replace("train", steps=100000, eval_batches=1, eval_interval=0)
        .replace("network", heartbeat_interval_s=1.0, heartbeat_ttl_s=4.0)
    )
    cfg = tmp_path / "run.toml"
    spec.save(cfg)
    peer = launcher.start("a", config=cfg, initial_peers=None)
    boot = peer.address()
    deadline = time.monotonic() + 60
    while peer.round() < 1:  # a state snapshot to download exists from the first round boundary on
        assert peer.poll() is None, peer.tail()
        assert time.monotonic() < deadline, peer.tail()
        time.sleep(0.2)
    ckpt = tmp_path / "ck" / "not-yet"
    res = doctor(
        "--initial-peers",
        boot,
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--checkpoint-dir",
        str(ckpt),
        "--device",
        "cpu",
        "--json",
    )
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    checks = {c["name"]: c for c in out["checks"]}
    assert out["ok"] is True
    assert set(checks) >= {"listen", "swarm", "addresses", "dial-back", "clock", "throughput", "disk", "device"}
    assert checks["swarm"]["status"] == "OK" and checks["swarm"]["value"] == 1
    # the peer itself opened a fresh connection to the probe's loopback port
    assert checks["dial-back"]["status"] == "OK", checks["dial-back"]
    # loopback: honest about who can dial it
    assert checks["addresses"]["status"] == "WARN" and "loopback" in checks["addresses"]["detail"]
    # same machine, same clock: the NTP-style offset is within the ping's own error
    assert checks["clock"]["status"] == "OK" and abs(checks["clock"]["value"]) < 0.25, checks["clock"]
    # real state bytes over the state-sync RPC
    assert checks["throughput"]["status"] == "OK" and checks["throughput"]["value"] > 0.1, checks["throughput"]
    assert "MB of state" in checks["throughput"]["detail"]
    assert checks["disk"]["value"] > 0 and str(tmp_path) in checks["disk"]["detail"]  # the nearest existing folder
    assert checks["device"]["value"] > 0 and "CPU" in checks["device"]["detail"]
    assert peer.poll() is None, "the doctor must not disturb the peer"

    # the same port the peer holds: the listen check FAILs, exit status 1
    port = next(a for a in peer.addresses() if "/127.0.0.1/" in a).split("/p2p/")[0]
    busy = doctor("--initial-peers", boot, "--host-maddrs", port, "--json")
    out = json.loads(busy.stdout.strip().splitlines()[-1])
    assert busy.returncode == 1 and out["ok"] is False
    assert [c["status"] for c in out["checks"] if c["name"] == "listen"] == ["FAIL"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--initial-peers", "/ip4/127.0.0.1/tcp/4001"], "/p2p/<peer id>"),
        (["--announce-maddrs", "/ip4/1.2.3.4/tcp/0"], "real port"),
    ],
)
def test_doctor_bad_input_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    res = doctor(*args, timeout=30)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: ") and says in res.stderr, res.stderr
