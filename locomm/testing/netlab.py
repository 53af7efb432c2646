r"""Emulated consumer links on one Linux machine: network namespaces, a bridge, tc tbf shaping, NAT.

Stdlib only (no torch), so tests and benchmarks can import it cheaply. Needs root, ``ip`` and ``tc``
(iproute2); NAT hosts also need ``iptables``. :func:`available` says whether this machine can run it
and, if not, why.

Topology of one :class:`Lab`::

          host ns "<run>-a"          hub ns "<run>-hub"              host ns "<run>-b"
        +----------------+      +------------------------+      +----------------+
        | eth0 10.77.X.10|======| v0 --+            +-- v1|======|eth0 10.77.X.11 |
        +----------------+ veth |      \  br0  /         | veth +----------------+
                                |       \     /          |
          router ns "<run>-c-gw"|        +---+--- v2     |
        +-------------------+   +------------||----------+
        | eth0 10.77.X.12   |================++  (veth)
        | lan0 192.168.2.1  |  MASQUERADE out eth0, FORWARD: lan->wan, wan->lan only ESTABLISHED
        +--------||---------+
        +--------||---------+
        | eth0 192.168.2.2  |  host ns "<run>-c" (NATed), default route via 192.168.2.1
        +-------------------+

Every host (or a NATed host's router) is one veth pair away from the bridge. Veth pairs are
created directly inside their two namespaces (``ip link add ... netns A type veth peer ... netns B``),
so nothing is ever put in the root namespace: deleting a lab's namespaces removes everything it
made, and concurrent labs cannot collide on interface names or addresses (every lab has its own
bridge in its own hub namespace; the per-run X in 10.77.X.0/24 is only to tell runs apart in
captures). Namespace names carry the creating process's pid (``lnl<pid>x<seq>-...``), which is how
:func:`cleanup_stale` recognises leftovers of dead runs.

Shaping (no ifb, no netem): tc's ``tbf`` on the EGRESS of each end of the host's veth pair.

- the host-side end (in the host's namespace, or in its router's for a NATed host) shapes what the
  host sends: its **upload**;
- the hub-side end (in the hub namespace, where the bridge forwards frames *to* the host) shapes
  what the host receives: its **download**.

A flow from A to B thus crosses A's upload and then B's download, as on the internet with an
uncongested core. tbf parameters: ``burst = max(rate / 100 Hz, 64 KiB)`` (tbf needs at least
rate/HZ, and a veth hands tbf TSO/GSO super-packets of up to 64 KiB, which must fit one burst or
tbf has to re-segment them), ``latency`` 50 ms of queue (a consumer modem's buffer; TCP then fills
the link instead of losing packets to a tiny queue). GSO/TSO stay on (no ethtool needed).
Measured on this project's 2-core machine with :func:`measure_tcp` (one TCP flow, 4-16 MB, against
an unshaped host; upload / download): 5mbit 4.9 / 4.9, 20mbit 19.2-19.5 / 19.2-19.4, 80mbit
77.0-77.7 / 76.0-77.5, 300mbit 294 / 294, 1gbit 1034 / 1035 Mbit/s (the burst shows at this rate),
unshaped 27-30 Gbit/s. One flow's goodput is ~96% of the rate because tbf counts Ethernet frames
(1514 bytes carry 1448 of payload).
There is no added propagation delay (netem is not assumed to be available); RTTs are the
machine's own (tens of microseconds) plus queueing in tbf.

Cleanup is unconditional: :meth:`Lab.close` (run by ``__exit__``, on SIGINT/SIGTERM through the
handlers the lab installs, and by ``atexit``) stops what the lab started (the stop signal to each
process group, ``grace_s`` to exit, then SIGKILL), kills whatever is still inside the namespaces
(``ip netns pids``) and deletes them. After cleaning up, a signal handler chains to the previous
handler (so SIGINT still raises KeyboardInterrupt; SIGTERM with no Python handler raises
``SystemExit(143)``). A second Ctrl-C during the grace period skips the rest of it.

The lab is three modules: this one (the :class:`Lab` and its :class:`Host` objects: lifecycle and
topology), :mod:`locomm.testing.netns` (the ``ip``/``tc``/``iptables`` commands, the availability
probe, stale-namespace cleanup) and :mod:`locomm.testing.netmeasure` (goodput and reachability); every
public name is importable from here.

    from locomm.testing import netlab
    ok, why = netlab.available()
    with netlab.Lab() as lab:
        a = lab.add_host("a", rate="20mbit")            # 20 Mbit/s up and down
        b = lab.add_host("b", up="10mbit", down="50mbit")
        c = lab.add_host("c", rate="20mbit", nat=True)  # behind a NAT router
        p = b.popen(["python3", "-m", "http.server", "--bind", b.ip, "8000"])
        a.run(["curl", f"http://{b.ip}:8000/"])
        print(netlab.measure_tcp(a, b, 4_000_000) / 1e6, "Mbit/s")
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from locomm.testing.netmeasure import measure_tcp, ping, tcp_listen, tcp_probe
from locomm.testing.netns import (
    LATENCY_MS,
    MIN_BURST,
    PREFIX,
    NetlabError,
    NetlabUnavailable,
    _kill_netns,
    _live_runs,
    _next_seq,
    _run,
    add_nat_router,
    available,
    cleanup_stale,
    entered,
    list_netns,
    parse_rate,
    shape,
    signal_proc,
)

__all__ = [
    "LATENCY_MS",
    "MAX_HOSTS",
    "MIN_BURST",
    "PREFIX",
    "Host",
    "Lab",
    "NetlabError",
    "NetlabUnavailable",
    "available",
    "cleanup_stale",
    "entered",
    "list_netns",
    "measure_tcp",
    "parse_rate",
    "ping",
    "tcp_listen",
    "tcp_probe",
]

MAX_HOSTS = 190
_NAME_RE = re.compile(r"^[a-z0-9]{1,12}$")


# --------------------------------------------------------------------------------- hosts


@dataclass
class Host:
    """One emulated machine: a namespace one (shaped) veth pair away from the lab's bridge."""

    lab: Lab
    name: str
    index: int
    netns: str
    ip: str
    """This host's own address (a private 192.168.* one for a NATed host)."""
    public_ip: str
    """The address others see its connections come from (its router's, for a NATed host)."""
    nat: bool = False
    router_netns: str | None = None
    up_bps: int | None = None
    down_bps: int | None = None
    up_dev: tuple[str, str] = ("", "")
    """(namespace, interface) whose egress is this host's upload."""
    down_dev: tuple[str, str] = ("", "")
    """(namespace, interface) whose egress is this host's download."""
    procs: list[subprocess.Popen] = field(default_factory=list)

    def argv(self, cmd: Sequence[str] | str) -> list[str]:
        """``cmd`` prefixed to run inside this host's namespace."""
        if isinstance(cmd, str):
            cmd = ["sh", "-c", cmd]
        return ["ip", "netns", "exec", self.netns, *cmd]

    def popen(self, cmd: Sequence[str] | str, **kw: Any) -> subprocess.Popen:
        """Start ``cmd`` in this namespace (its own session/process group unless told otherwise);
        the lab stops it on exit. Keyword arguments go to :class:`subprocess.Popen`."""
        return self.lab._popen(self, cmd, **kw)

    def run(
        self, cmd: Sequence[str] | str, *, check: bool = True, timeout: float = 60.0, **kw: Any
    ) -> subprocess.CompletedProcess:
        """Run ``cmd`` here to completion (output captured as text unless told otherwise)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.argv(cmd), check=check, timeout=timeout, **kw)

    def shape(self, *, up: str | int | None = None, down: str | int | None = None) -> None:
        """(Re)set this host's upload and download rates (None: unshaped)."""
        self.up_bps, self.down_bps = parse_rate(up), parse_rate(down)
        self.lab._shape(self.up_dev, self.up_bps)
        self.lab._shape(self.down_dev, self.down_bps)

    def __repr__(self) -> str:
        rate = lambda b: "unshaped" if b is None else f"{b / 1e6:g}mbit"  # noqa: E731
        return (
            f"Host({self.name!r}, {self.ip}{' via NAT ' + self.public_ip if self.nat else ''}, "
            f"up {rate(self.up_bps)}, down {rate(self.down_bps)})"
        )


# ----------------------------------------------------------------------------------- lab


class Lab:
    """A set of emulated hosts on one bridge; a context manager that always cleans up.

    ``grace_s``: how long processes get to exit after ``stop_signal`` before SIGKILL.
    ``signals``: install SIGINT/SIGTERM handlers (main thread only) that clean up, then chain.
    ``wan``: the first two octets of the bridge's subnet (``<wan>.X.0/24``). The default 10.77 is private
    (RFC 1918); libp2p treats such addresses as LAN ones: its auto-relay announces no relay addresses through
    a relay it can only reach on a private address, and hole punching waits for a public address. ``"198.18"``
    (RFC 2544's benchmarking range, never routed on the internet, and public to libp2p) lets both run here.
    """

    def __init__(
        self,
        *,
        prefix: str = PREFIX,
        grace_s: float = 5.0,
        stop_signal: int = signal.SIGINT,
        latency_ms: float = LATENCY_MS,
        signals: bool = True,
        clean_stale: bool = True,
        wan: str = "10.77",
    ) -> None:
        if not re.fullmatch(r"[a-z]{1,4}", prefix):
            raise ValueError(f"prefix must be 1-4 lowercase letters, got {prefix!r}")
        self.prefix = prefix
        seq = _next_seq()
        self.run_name = f"{prefix}{os.getpid()}x{seq}"
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}", wan):
            raise ValueError(f"wan must be the first two octets, e.g. '10.77', got {wan!r}")
        self.subnet = f"{wan}.{(os.getpid() * 7 + seq) % 250 + 1}"
        self.hub = f"{self.run_name}-hub"
        self.grace_s = grace_s
        self.stop_signal = stop_signal
        self.latency_ms = latency_ms
        self.hosts: dict[str, Host] = {}
        self._netns: list[str] = []  # recorded BEFORE each is created, so a half-built lab is cleaned too
        self._procs: list[subprocess.Popen] = []
        self._signals = signals
        self._clean_stale = clean_stale
        self._old_handlers: dict[int, Any] = {}
        self._open = False
        self._closing = False
        self._hurry = threading.Event()
        self._lock = threading.RLock()

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        self.open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def open(self) -> None:
        ok, why = available()
        if not ok:
            raise NetlabUnavailable(why)
        if self._clean_stale:
            cleanup_stale(self.prefix)
        _live_runs.add(self.run_name)
        self._open = True
        atexit.register(self.close)
        if self._signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._add_netns(self.hub)
            self._ip(self.hub, "link", "add", "br0", "type", "bridge")
            self._ip(self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._closing:  # a second Ctrl-C while stopping: skip the rest of the grace period
            self._hurry.set()
            return
        self.close()
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        if callable(old):
            old(signum, frame)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def close(self) -> None:
        """Stop every process the lab started and delete every namespace it made (idempotent)."""
        with self._lock:
            if not self._open or self._closing:
                return
            self._closing = True
            try:
                self._stop_procs()
                for ns in reversed(self._netns):
                    with contextlib.suppress(Exception):
                        _kill_netns(ns)
            finally:
                self._open = False
                self._closing = False
                _live_runs.discard(self.run_name)
                with contextlib.suppress(Exception):
                    atexit.unregister(self.close)
                if threading.current_thread() is threading.main_thread():
                    for sig, old in self._old_handlers.items():
                        with contextlib.suppress(Exception):
                            if signal.getsignal(sig) == self._on_signal:
                                signal.signal(sig, old)
                self._old_handlers.clear()

    def _stop_procs(self) -> None:
        alive = [p for p in self._procs if p.poll() is None]
        for p in alive:
            signal_proc(p, self.stop_signal)
        deadline = time.monotonic() + self.grace_s
        while alive and time.monotonic() < deadline and not self._hurry.is_set():
            alive = [p for p in alive if p.poll() is None]
            if alive:
                time.sleep(0.05)
        for p in self._procs:  # whatever is left in each group (a child that ignored the signal)
            signal_proc(p, signal.SIGKILL)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            for f in (p.stdin, p.stdout, p.stderr):  # pipes the caller asked for
                if f is not None:
                    with contextlib.suppress(Exception):
                        f.close()

    @property
    def namespaces(self) -> list[str]:
        return list(self._netns)

    # -- building -----------------------------------------------------------------------------

    def add_host(
        self,
        name: str | None = None,
        *,
        rate: str | int | None = None,
        up: str | int | None = None,
        down: str | int | None = None,
        nat: bool = False,
    ) -> Host:
        """A new host on the bridge. ``rate`` sets upload and download alike; ``up``/``down`` override it.
        ``nat``: the host sits in a private subnet behind its own router (it can dial out, nobody in)."""
        if not self._open:
            raise NetlabError("the lab is not open (use it as a context manager)")
        i = len(self.hosts)
        name = name or f"h{i}"
        if not _NAME_RE.match(name):
            raise ValueError(f"host name must be 1-12 of [a-z0-9], got {name!r}")
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        if i >= MAX_HOSTS:
            raise ValueError(f"at most {MAX_HOSTS} hosts per lab")
        if nat:
            ok, why = available(nat=True)
            if not ok:
                raise NetlabUnavailable(why)
        up_bps = parse_rate(up if up is not None else rate)
        down_bps = parse_rate(down if down is not None else rate)
        ns = f"{self.run_name}-{name}"
        wan_ip = f"{self.subnet}.{10 + i}"
        hub_if = f"v{i}"
        edge = f"{ns}-gw" if nat else ns  # the namespace whose eth0 sits on the bridge
        self._add_netns(ns)
        if nat:
            self._add_netns(edge)
        self._ip(self.hub, "link", "add", hub_if, "type", "veth", "peer", "name", "eth0", "netns", edge)
        self._ip(self.hub, "link", "set", hub_if, "master", "br0", "up")
        self._ip(edge, "addr", "add", f"{wan_ip}/24", "dev", "eth0")
        self._ip(edge, "link", "set", "eth0", "up")
        if nat:
            lan = f"192.168.{i}"
            add_nat_router(edge, ns, lan)
            host_ip = f"{lan}.2"
        else:
            host_ip = wan_ip
        host = Host(
            lab=self,
            name=name,
            index=i,
            netns=ns,
            ip=host_ip,
            public_ip=wan_ip,
            nat=nat,
            router_netns=edge if nat else None,
            up_dev=(edge, "eth0"),
            down_dev=(self.hub, hub_if),
        )
        host.shape(up=up_bps, down=down_bps)
        self.hosts[name] = host
        return host

    def _add_netns(self, ns: str) -> None:
        self._netns.append(ns)
        _run(["ip", "netns", "add", ns])
        self._ip(ns, "link", "set", "lo", "up")

    def _ip(self, ns: str, *args: str) -> None:
        _run(["ip", "-n", ns, *args])

    def _shape(self, dev: tuple[str, str], bps: int | None) -> None:
        shape(*dev, bps, latency_ms=self.latency_ms)

    def _popen(self, host: Host, cmd: Sequence[str] | str, **kw: Any) -> subprocess.Popen:
        if not self._open or self._closing:
            raise NetlabError("the lab is closed")
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("start_new_session", True)
        with self._lock:
            p = subprocess.Popen(host.argv(cmd), **kw)
            p._netlab_group = bool(kw["start_new_session"])  # type: ignore[attr-defined]
            self._procs.append(p)
            host.procs.append(p)
        return p


def _self_test() -> None:  # python -m locomm.testing.netlab: build two shaped hosts and measure them
    ok, why = available(nat=True)
    if not ok:
        print(f"netlab unavailable: {why}")
        sys.exit(1)
    with Lab() as lab:
        a = lab.add_host("a", rate="20mbit")
        b = lab.add_host("b")
        print(a, b, sep="\n")
        print(f"a upload   {measure_tcp(a, b) / 1e6:.1f} Mbit/s")
        print(f"a download {measure_tcp(b, a) / 1e6:.1f} Mbit/s")


if __name__ == "__main__":
    _self_test()
