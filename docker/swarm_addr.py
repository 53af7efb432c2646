"""Addresses of the compose swarm, for docker/entrypoint.sh.

Two commands:
- ``identity KEY ID_FILE``: create the libp2p private key KEY if it does not exist (as hivemind's
  ``P2P.create(identity_path=...)`` would), then write its peer id to ID_FILE (public: the key stays in
  the bootstrap's own volume). The bootstrap's peer id is then fixed for the life of its volume.
- ``maddr HOST PORT ID_FILE [TIMEOUT_S]``: wait until ID_FILE exists and HOST resolves (the bootstrap may
  still be starting), then print ``/ip4/IP/tcp/PORT/p2p/ID``. hivemind dials /ip4 addresses, so the
  service name is resolved here, at start, through the compose network's DNS.

Errors print one line and exit with status 2.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path


def fail(msg: str) -> None:
    print(f"swarm_addr: {msg}", file=sys.stderr)
    sys.exit(2)


def identity(key: Path, id_file: Path) -> str:
    from hivemind.p2p import P2P  # noqa: PLC0415 - heavy, and only the bootstrap needs it
    from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID  # noqa: PLC0415

    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(key))
    peer_id = PeerID.from_identity(key.read_bytes()).to_base58()
    id_file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=id_file.parent, prefix=f".{id_file.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(peer_id + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, id_file)  # readers see the old id or the new one, never half a line
    return peer_id


def maddr(host: str, port: int, id_file: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    peer_id, ip, why = "", "", ""
    while time.monotonic() < deadline:
        if not peer_id and id_file.exists():
            peer_id = id_file.read_text().strip()
        if not ip:
            try:
                ip = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
            except OSError as e:
                why = f"{host} does not resolve ({e})"
        if peer_id and ip:
            return f"/ip4/{ip}/tcp/{port}/p2p/{peer_id}"
        time.sleep(0.5)
    fail(f"gave up after {timeout_s:.0f} s: " + (why if not ip else f"no bootstrap peer id in {id_file}"))
    return ""


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[0] == "identity":
        print(identity(Path(argv[1]), Path(argv[2])))
    elif len(argv) in (4, 5) and argv[0] == "maddr":
        try:
            port = int(argv[2])
            timeout_s = float(argv[4]) if len(argv) == 5 else 180.0
        except ValueError:
            fail(f"PORT and TIMEOUT_S must be numbers, got {argv[2:]}")
        print(maddr(argv[1], port, Path(argv[3]), timeout_s))
    else:
        fail("usage: swarm_addr.py identity KEY ID_FILE | maddr HOST PORT ID_FILE [TIMEOUT_S]")


if __name__ == "__main__":
    main(sys.argv[1:])
