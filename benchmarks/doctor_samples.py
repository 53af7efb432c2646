"""Two real ``locomm-peer doctor`` outputs for docs/doctor.md: an open host, and one behind a NAT router.

A netlab (locomm/testing/netlab.py; root, iproute2, iptables): host ``seed`` runs ``locomm-peer join`` on
the bridge; host ``open`` (on the bridge) and host ``natd`` (behind its own MASQUERADE router: it can dial
out, nobody can dial in) each run ``locomm-peer doctor --initial-peers <seed>``. Every link is shaped to
20 Mbit/s. Writes docs/results/doctor_samples.txt. About a minute on 2 cores.

    sudo .venv/bin/python benchmarks/doctor_samples.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from locomm.config import RunSpec
from locomm.testing import netlab
from locomm.testing.launcher import Launcher

OUT = Path(__file__).resolve().parent.parent / "docs" / "results" / "doctor_samples.txt"
RATE = "20mbit"


def main() -> None:
    ok, why = netlab.available(nat=True)
    if not ok:
        sys.exit(f"netlab unavailable: {why}")
    spec = (
        RunSpec.preset("nano")
        .replace("data", max_corpus_mb=0.5, batch_size=4, seq_len=32)
        .replace("outer", algo="noloco", inner_steps=5)
        .replace("train", steps=100000, eval_batches=1, eval_interval=0)
        .replace("network", heartbeat_interval_s=2.0, heartbeat_ttl_s=8.0)
    )
    sections = []
    with tempfile.TemporaryDirectory() as tmp, netlab.Lab() as lab, Launcher(Path(tmp)) as peers:
        cfg = Path(tmp) / "run.toml"
        spec.save(cfg)
        seed = lab.add_host("seed", rate=RATE)
        hosts = {"open": lab.add_host("open", rate=RATE), "natd": lab.add_host("natd", rate=RATE, nat=True)}
        peer = peers.start("seed", "--host-maddrs", "/ip4/0.0.0.0/tcp/0", config=cfg, spawn=seed.popen)
        boot = peer.address(ip=seed.ip)
        deadline = time.monotonic() + 90
        while peer.round() < 1:
            if peer.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the seed peer did not reach round 1:\n{peer.tail()}")
            time.sleep(0.5)
        for name, host in hosts.items():
            cmd = [
                sys.executable,
                "-m",
                "locomm.cli.main",
                "doctor",
                "--initial-peers",
                boot,
                "--host-maddrs",
                "/ip4/0.0.0.0/tcp/31337",
                "--checkpoint-dir",
                f"{tmp}/ck",
                "--device",
                "cpu",
            ]
            t0 = time.monotonic()
            res = host.run(cmd, check=False, timeout=180)
            where = f"{host.ip} behind a NAT router ({host.public_ip})" if host.nat else f"{host.ip}, on the bridge"
            shown = " ".join(c if c != sys.executable else "locomm-peer" for c in cmd[3:])
            sections.append(
                f"## {name}: {where}; links {RATE}\n$ locomm-peer {shown.replace(tmp, '/tmp/x')}\n"
                f"{res.stdout.replace(tmp, '/tmp/x').rstrip()}\n(exit status {res.returncode}, "
                f"{time.monotonic() - t0:.0f} s)\n"
            )
            print(sections[-1], flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("# locomm-peer doctor on a netlab (benchmarks/doctor_samples.py)\n\n" + "\n".join(sections))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
