"""The commands a :class:`locomm.testing.netlab.Lab` is built from: namespaces, veth pairs, tbf, NAT rules.

Stdlib only. Every function runs ``ip``, ``tc`` or ``iptables`` (as root) and raises :class:`NetlabError`
with the command's stderr when one fails. This module also holds what every lab of the process shares:
the namespace naming scheme (``lnl<pid>x<seq>-<host>``, how :func:`cleanup_stale` recognises leftovers of
dead runs), the set of labs still open, and the cached answer of :func:`available`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

PREFIX = "lnl"
"""Namespace names start with this, then the creating pid: ``lnl<pid>x<seq>-<host>``."""
LATENCY_MS = 50.0
"""tbf queue size, in milliseconds at the shaped rate."""
MIN_BURST = 64 * 1024
"""Smallest tbf burst (bytes): one TSO/GSO super-packet."""
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?(/s)?\s*$", re.IGNORECASE)
_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_ESTABLISHED = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
"""iptables match and target: accept packets of connections already open (a NAT router's wan -> lan rule)."""
_TBF_PROBE = ["rate", "1mbit", "burst", "64kb", "latency", "50ms"]
_seq = 0
_seq_lock = threading.Lock()
_live_runs: set[str] = set()
_probe_cache: dict[bool, tuple[bool, str]] = {}


class NetlabError(RuntimeError):
    """A command that builds the lab failed (the message holds its stderr)."""


class NetlabUnavailable(NetlabError):
    """This machine cannot build a lab (not root, no iproute2, no namespaces...)."""


def parse_rate(rate: str | float | int | None) -> int | None:
    """'80mbit', '1gbit', '500kbit', 2e7 -> bits per second (int); None / 'none' / 0 -> None (unshaped).

    Units are bits, as in ``locomm-peer simulate --link`` ('mbps' is read as megabits, unlike tc).
    """
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        return int(rate) if rate > 0 else None
    if rate.strip().lower() in ("none", "", "0", "unshaped", "off"):
        return None
    m = _RATE_RE.match(rate)
    if not m:
        raise ValueError(f"cannot read rate {rate!r}; write e.g. 80mbit, 1gbit, 500kbit or none")
    bps = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if bps < 8000:
        raise ValueError(f"rate {rate!r} is below 8 kbit/s")
    return bps


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise NetlabError(f"{' '.join(argv)}: exit {p.returncode}: {(p.stderr or p.stdout).strip()}")
    return p


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_netns() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    p = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _netns_pids(ns: str) -> list[int]:
    p = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _kill_netns(ns: str) -> None:
    """SIGKILL every process inside ``ns``, then delete it (idempotent)."""
    for _ in range(3):
        pids = _netns_pids(ns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    if ns in list_netns():
        _run(["ip", "netns", "del", ns], check=False)


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces left by dead runs: ``<prefix><pid>x<seq>-*`` whose pid no longer exists
    (or, for this process's own pid, whose lab is no longer open). Returns the names removed."""
    removed = []
    pat = re.compile(rf"^{re.escape(prefix)}(\d+)x(\d+)-")
    for ns in list_netns():
        m = pat.match(ns)
        if not m:
            continue
        pid, run = int(m.group(1)), f"{prefix}{m.group(1)}x{m.group(2)}"
        stale = (run not in _live_runs) if pid == os.getpid() else not _pid_alive(pid)
        if stale:
            _kill_netns(ns)
            removed.append(ns)
    return removed


def available(nat: bool = False) -> tuple[bool, str]:
    """(True, "") when this machine can build labs (NAT hosts too with ``nat=True``), else (False, why).

    Checks root, the tools, then really builds a throwaway namespace with a veth pair and a tbf
    qdisc (and a MASQUERADE rule for ``nat``), since containers often lack the capabilities.
    """
    if nat in _probe_cache:
        return _probe_cache[nat]
    result = _probe(nat)
    _probe_cache[nat] = result
    return result


def _probe(nat: bool) -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "needs root (network namespaces, tc, iptables); run as root"
    tools = ["ip", "tc"] + (["iptables"] if nat else [])
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return False, f"missing tool(s): {', '.join(missing)} (apt-get install iproute2" + (
            " iptables)" if nat else ")"
        )
    ns = f"{PREFIX}{os.getpid()}x{_next_seq()}-probe"
    try:
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", "p0", "root", "tbf"] + _TBF_PROBE)
        if nat:
            ex = ["ip", "netns", "exec", ns]
            _run(ex + ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "p0", "-j", "MASQUERADE"])
            _run(ex + ["iptables", "-A", "FORWARD", *_ESTABLISHED])
    except (NetlabError, OSError, subprocess.TimeoutExpired) as e:
        return False, f"cannot build a namespace lab here: {e}"
    finally:
        with contextlib.suppress(Exception):
            _run(["ip", "netns", "del", ns], check=False)
    return True, ""


CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run the calling thread inside namespace ``ns`` for the ``with`` body (``setns(2)``), then back in its own:
    sockets it opens and processes it starts there (an in-process ``hivemind.P2P``'s p2pd) live in ``ns``. Other
    threads, and sockets opened before, stay where they were. Linux, root."""
    import ctypes  # noqa: PLC0415 - only this helper needs it

    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise NetlabError(f"setns into {ns}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:  # a thread left in a lab's namespace would outlive it
                raise NetlabError(f"setns back from {ns}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(own)


def _next_seq() -> int:
    global _seq
    with _seq_lock:
        _seq += 1
        return _seq


# ------------------------------------------------------------------------------ building


def shape(ns: str, ifname: str, bps: int | None, *, latency_ms: float = LATENCY_MS) -> None:
    """tbf on the egress of ``ifname`` in ``ns`` at ``bps`` (None: unshaped). ``burst = max(rate / 100 Hz,
    64 KiB)``: tbf needs at least rate/HZ, and a veth hands it GSO super-packets of up to 64 KiB."""
    if bps is None:
        _run(["tc", "-n", ns, "qdisc", "del", "dev", ifname, "root"], check=False)
        return
    burst = max(bps // 8 // 100, MIN_BURST)
    _run(
        ["tc", "-n", ns, "qdisc", "replace", "dev", ifname, "root", "tbf"]
        + ["rate", f"{bps}bit", "burst", str(burst), "latency", f"{latency_ms:g}ms"]
    )


def add_nat_router(router: str, ns: str, lan: str) -> None:
    """Put host namespace ``ns`` in the private subnet ``<lan>.0/24`` behind namespace ``router`` (whose
    ``eth0`` is on the bridge): the host is ``<lan>.2`` with a default route via ``<lan>.1``; the router
    masquerades what leaves ``eth0`` and forwards lan -> wan, and wan -> lan only for connections the host
    opened (it can dial out, nobody can dial in)."""
    for args in (
        (router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", ns),
        (router, "addr", "add", f"{lan}.1/24", "dev", "lan0"),
        (router, "link", "set", "lan0", "up"),
        (ns, "addr", "add", f"{lan}.2/24", "dev", "eth0"),
        (ns, "link", "set", "eth0", "up"),
        (ns, "route", "add", "default", "via", f"{lan}.1"),
    ):
        _run(["ip", "-n", *args])
    ex = ["ip", "netns", "exec", router]
    _run(ex + ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
    _run(ex + ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE"])
    _run(ex + ["iptables", "-P", "FORWARD", "DROP"])
    _run(ex + ["iptables", "-A", "FORWARD", "-i", "lan0", "-o", "eth0", "-j", "ACCEPT"])
    _run(ex + ["iptables", "-A", "FORWARD", "-i", "eth0", "-o", "lan0", *_ESTABLISHED])


def signal_proc(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        if getattr(p, "_netlab_group", False):
            os.killpg(p.pid, sig)
        elif p.poll() is None:
            p.send_signal(sig)
