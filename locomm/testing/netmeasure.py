"""Measuring an emulated link from inside its namespaces: one TCP flow's goodput, reachability, NAT's view.

Stdlib only. Each helper starts a tiny Python script (``python -I -S -c``) in a host's namespace through
:meth:`locomm.testing.netlab.Host.popen` / ``run``, so the lab stops whatever is left.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from locomm.testing.netns import NetlabError


class Host(Protocol):
    """What a measurement needs of a lab host (``netlab.Host``): its name, its address, and commands run in it."""

    name: str
    ip: str

    def popen(self, cmd: Sequence[str] | str, **kw: Any) -> subprocess.Popen: ...

    def run(
        self, cmd: Sequence[str] | str, *, check: bool = True, timeout: float = 60.0, **kw: Any
    ) -> subprocess.CompletedProcess: ...


_XFER = r"""
import signal; signal.signal(signal.SIGINT, signal.SIG_DFL)
import json, socket, sys, time
role, action, host, port, nbytes, timeout = sys.argv[1:7]
port, nbytes, timeout = int(port), int(nbytes), float(timeout)
if role == "listen":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port)); s.listen(8); s.settimeout(timeout)
    print(s.getsockname()[1], flush=True)
    c, _ = s.accept()
else:
    c = socket.create_connection((host, port), timeout=timeout)
c.settimeout(timeout)
if action == "send":
    left, chunk = nbytes, b"\0" * (1 << 20)
    while left > 0:
        k = min(left, len(chunk)); c.sendall(chunk[:k]); left -= k
    c.shutdown(socket.SHUT_WR); c.recv(1)
else:
    n, t0, buf = 0, None, bytearray(1 << 20)
    while True:
        k = c.recv_into(buf)
        if not k:
            break
        if t0 is None:
            t0 = time.perf_counter()
        n += k
    t1 = time.perf_counter()
    print(json.dumps({"bytes": n, "seconds": t1 - (t0 or t1)}), flush=True)
c.close()
"""

_ECHO = r"""
import signal; signal.signal(signal.SIGINT, signal.SIG_DFL)
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8)
print(s.getsockname()[1], flush=True)
while True:
    c, addr = s.accept()
    c.sendall(("hello " + addr[0] + "\n").encode()); c.close()
    print(addr[0], flush=True)
"""

_PROBE = r"""
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print(c.recv(200).decode().strip() or "connected")
except OSError as e:
    print("FAILED", type(e).__name__, e)
"""


def _py(script: str, *args: Any) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", script, *map(str, args)]


def measure_tcp(src: Host, dst: Host, nbytes: int = 4_000_000, *, timeout: float = 60.0, dialer: str = "src") -> float:
    """Bits per second of one TCP flow carrying ``nbytes`` from ``src`` to ``dst``: ``src``'s upload and
    ``dst``'s download. Timed at the receiver from its first byte to the end (start-up excluded).

    ``dialer``: who opens the connection, "src" (the sender; ``dst`` must be reachable) or "dst" (the
    receiver dials the sender: how a NATed host's download is measured).
    """
    if dialer not in ("src", "dst"):
        raise ValueError(f"dialer must be 'src' or 'dst', got {dialer!r}")
    listener, dialing = (dst, src) if dialer == "src" else (src, dst)
    l_action, d_action = ("recv", "send") if dialer == "src" else ("send", "recv")
    server = listener.popen(
        _py(_XFER, "listen", l_action, "0.0.0.0", 0, nbytes, timeout),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(_readline(server, timeout))
        client = dialing.run(
            _py(_XFER, "connect", d_action, listener.ip, port, nbytes, timeout), timeout=timeout + 5, check=False
        )
        if client.returncode != 0:
            raise NetlabError(f"measure_tcp {src.name}->{dst.name}: {client.stderr.strip()[-300:]}")
        out, _ = server.communicate(timeout=timeout)
        text = out if l_action == "recv" else client.stdout
        r = json.loads(text.strip().splitlines()[-1])
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    if r["bytes"] != nbytes or r["seconds"] <= 0:
        raise NetlabError(f"measure_tcp {src.name}->{dst.name}: got {r['bytes']} of {nbytes} bytes")
    return 8 * r["bytes"] / r["seconds"]


def _readline(p: subprocess.Popen, timeout: float) -> str:
    """One stdout line from ``p`` within ``timeout`` (a thread reads it: pipes have no timeout)."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout)
    if not box or not box[0].strip():
        raise NetlabError(f"no output from {p.args!r} within {timeout:g} s")
    return box[0].strip()


def tcp_listen(host: Host, port: int = 0) -> tuple[subprocess.Popen, int]:
    """A TCP server in ``host`` that answers each connection with ``hello <client ip>`` and prints the
    client's ip on its stdout (one line each). Returns (process, port); the lab stops it."""
    p = host.popen(_py(_ECHO, "0.0.0.0", port), stdout=subprocess.PIPE, text=True)
    return p, int(_readline(p, 30.0))


def tcp_probe(src: Host, ip: str, port: int, timeout: float = 3.0) -> str | None:
    """Connect from ``src`` to ip:port; the server's greeting (``hello <ip seen>``), or None on failure."""
    out = src.run(_py(_PROBE, ip, port, timeout), timeout=timeout + 15, check=False).stdout.strip()
    return None if not out or out.startswith("FAILED") else out


def ping(src: Host, ip: str, timeout: float = 5.0) -> bool:
    """Is ``ip`` reachable from ``src``: ``ping -c1`` when ping exists, else a TCP probe to port 9.

    A refusal is an answer."""
    if shutil.which("ping"):
        return (
            src.run(
                ["ping", "-c", "1", "-W", str(max(1, int(timeout))), ip], check=False, timeout=timeout + 5
            ).returncode
            == 0
        )
    out = src.run(_py(_PROBE, ip, 9, timeout), timeout=timeout + 15, check=False).stdout
    return "ConnectionRefused" in out  # a refusal proves the host answered
