"""Bulk TCP transfer between two locomm containers with shaped links: does LINK_RATE hold?

Starts a private Docker network and two containers of the image (cap_add NET_ADMIN, shaped by
docker/entrypoint.sh exactly as in docker-compose.yml), sends --mb megabytes from one to the other
over one TCP stream, and reports the receiver's goodput from its first byte to its last. Four cases
tell the two shaping directions apart:

    upload     sender shaped, receiver not     (tbf on the sender's eth0)
    download   receiver shaped, sender not     (tbf on the receiver's ifb0, fed by its eth0 ingress)
    both       both shaped                     (what two compose peers see)
    unshaped   neither

    python benchmarks/docker_link.py --rate 80mbit --mb 64 [--image locomm:latest] [--out FILE.json]

Prints a table and writes JSON. Everything it starts (2 containers, 1 network) is removed at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import _harness

RECEIVER = r"""
import json, socket, time
s = socket.create_server(("0.0.0.0", 5001))
c, _ = s.accept()
n, t0, t1 = 0, None, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += len(b)
    t1 = time.perf_counter()
print(json.dumps({"bytes": n, "seconds": t1 - t0}))
"""

SENDER = r"""
import socket, sys, time
host, total = sys.argv[1], int(sys.argv[2])
for _ in range(300):
    try:
        c = socket.create_connection((host, 5001), timeout=5)
        break
    except OSError:
        time.sleep(0.2)
else:
    sys.exit("receiver never answered")
buf = b"\0" * (1 << 20)
left = total
while left > 0:
    left -= c.send(buf[: min(left, len(buf))])
c.shutdown(socket.SHUT_WR)
c.recv(1)
c.close()
"""


def docker(*args: str, timeout: float = 300, check: bool = True) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise SystemExit(f"docker {' '.join(args[:3])}...: {r.stderr.strip()[-500:]}")
    return r.stdout


def one(image: str, net: str, tag: str, send_rate: str, recv_rate: str, nbytes: int) -> dict:
    recv, send = f"{tag}-recv", f"{tag}-send"
    common = ["--network", net, "--cap-add", "NET_ADMIN", "-e", "OMP_NUM_THREADS=1"]
    try:
        docker(
            "run",
            "-d",
            "--name",
            recv,
            *common,
            "-e",
            f"LINK_RATE={recv_rate}",
            image,
            "exec",
            "python3",
            "-c",
            RECEIVER,
        )
        docker(
            "run",
            "--name",
            send,
            *common,
            "-e",
            f"LINK_RATE={send_rate}",
            image,
            "exec",
            "python3",
            "-c",
            SENDER,
            recv,
            str(nbytes),
            timeout=900,
        )
        docker("wait", recv, timeout=120)
        out = docker("logs", recv).strip().splitlines()
        shaping = [
            line for name in (send, recv) for line in docker("logs", name).strip().splitlines() if "link shaped" in line
        ]
        got = json.loads(out[-1])
    finally:
        for name in (send, recv):
            docker("rm", "-f", name, check=False)
    mbit = got["bytes"] * 8 / got["seconds"] / 1e6
    return {
        "sender": send_rate or "unshaped",
        "receiver": recv_rate or "unshaped",
        "mb": got["bytes"] / 1e6,
        "seconds": got["seconds"],
        "mbit_s": mbit,
        "shaping": shaping,
    }


def main() -> None:
    ap = _harness.parser(__doc__, summary=True)
    ap.add_argument("--image", default=os.environ.get("LOCOMM_IMAGE", "locomm:latest"))
    ap.add_argument("--rate", default="80mbit")
    ap.add_argument("--mb", type=float, default=64.0, help="megabytes (10^6) per transfer")
    ap.add_argument(
        "--cases",
        nargs="+",
        default=["upload", "download", "both", "unshaped"],
        choices=["upload", "download", "both", "unshaped"],
    )
    args = ap.parse_args()
    if args.mb <= 0:
        sys.exit("--mb: must be > 0")
    docker("image", "inspect", args.image)
    tag = f"locomm-linkbench-{os.getpid()}"
    docker("network", "create", tag)
    rates = {
        "upload": (args.rate, ""),
        "download": ("", args.rate),
        "both": (args.rate, args.rate),
        "unshaped": ("", ""),
    }
    rows = []
    try:
        for case in args.cases:
            t0 = time.perf_counter()
            row = {"case": case, **one(args.image, tag, f"{tag}-{case}", *rates[case], int(args.mb * 1e6))}
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(
                f"{case:9s} sender {row['sender']:9s} receiver {row['receiver']:9s} "
                f"{row['mb']:6.1f} MB in {row['seconds']:6.2f} s = {row['mbit_s']:8.1f} Mbit/s",
                flush=True,
            )
    finally:
        docker("network", "rm", tag, check=False)
    result = {"image": args.image, "rate": args.rate, "rows": rows}
    if args.out:
        _harness.write_json(args.out, result, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
