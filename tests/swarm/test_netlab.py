"""locomm.testing.netlab: namespaces on a bridge, tbf shaping both ways, a NAT router, cleanup in every exit path.

Needs root and iproute2 (iptables for the NAT test); otherwise every test is skipped with the reason
netlab.available() gives. About 15 s on 2 cores.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from locomm.testing import netlab, procs

OK, WHY = netlab.available()
NAT_OK, NAT_WHY = netlab.available(nat=True)
needs_lab = pytest.mark.skipif(not OK, reason=f"netlab unavailable: {WHY}")
needs_nat = pytest.mark.skipif(not NAT_OK, reason=f"netlab NAT unavailable: {NAT_WHY}")
pytestmark = pytest.mark.timeout(120)


def _ours(lab_or_prefix: str) -> list[str]:
    return [n for n in netlab.list_netns() if n.startswith(lab_or_prefix)]


def _dead(pid: int | str) -> bool:
    """Gone, or a zombie nobody has reaped yet (an orphan's parent may be a container's init)."""
    return not procs.alive(int(pid))


def test_available_gives_a_reason():
    ok, why = netlab.available()
    assert isinstance(ok, bool) and isinstance(why, str)
    assert ok or why


def test_parse_rate():
    assert netlab.parse_rate("80mbit") == 80_000_000
    assert netlab.parse_rate("1gbit") == 1_000_000_000
    assert netlab.parse_rate("500kbit") == 500_000
    assert netlab.parse_rate("none") is None and netlab.parse_rate(None) is None
    with pytest.raises(ValueError):
        netlab.parse_rate("fast")


@needs_lab
def test_two_shaped_hosts_reach_each_other():
    with netlab.Lab() as lab:
        a = lab.add_host("a", rate="20mbit")
        b = lab.add_host("b", rate="20mbit")
        assert a.ip.rsplit(".", 1)[0] == b.ip.rsplit(".", 1)[0]  # one /24
        assert netlab.ping(a, b.ip) and netlab.ping(b, a.ip)
        _, port = netlab.tcp_listen(b)
        assert netlab.tcp_probe(a, b.ip, port) == f"hello {a.ip}"
        _, port = netlab.tcp_listen(a)
        assert netlab.tcp_probe(b, a.ip, port) == f"hello {b.ip}"
        # every namespace has lo up
        for ns in lab.namespaces:
            out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "lo"], capture_output=True, text=True).stdout
            assert "UP" in out, (ns, out)


@needs_lab
def test_shaped_link_rate_upload_and_download():
    """Upload is shaped on the host's veth end, download on the hub's: measure each alone.

    Goodput of one TCP flow is ~95% of the L2 rate tbf counts (headers); the window allows a loaded machine."""
    with netlab.Lab() as lab:
        a = lab.add_host("a", up="20mbit", down="10mbit")
        ref = lab.add_host("ref")  # unshaped: the other end never limits
        up = netlab.measure_tcp(a, ref, 3_000_000)
        down = netlab.measure_tcp(ref, a, 3_000_000)
        print(f"measured: upload {up / 1e6:.1f} Mbit/s (20), download {down / 1e6:.1f} Mbit/s (10)")
        assert 0.75 * 20e6 <= up <= 1.10 * 20e6, up
        assert 0.75 * 10e6 <= down <= 1.10 * 10e6, down
        a.shape(up=None, down=None)  # unshaped again: far faster than either
        assert netlab.measure_tcp(ref, a, 3_000_000) > 50e6


@needs_nat
def test_nat_host_dials_out_but_cannot_be_dialled():
    with netlab.Lab() as lab:
        opn = lab.add_host("open", rate="20mbit")
        nat = lab.add_host("natted", rate="20mbit", nat=True)
        assert nat.ip != nat.public_ip and nat.ip.startswith("192.168.")
        # out: works, and the open host sees the router's address (masqueraded)
        _, port = netlab.tcp_listen(opn)
        assert netlab.tcp_probe(nat, opn.ip, port) == f"hello {nat.public_ip}"
        # in: neither its private address nor its router's public one answers
        _, nport = netlab.tcp_listen(nat)
        assert netlab.tcp_probe(nat, nat.ip, nport) is not None  # the server is really listening
        assert netlab.tcp_probe(opn, nat.ip, nport, timeout=2) is None
        assert netlab.tcp_probe(opn, nat.public_ip, nport, timeout=2) is None
        # even with a route to the private subnet through the router, its firewall drops new inbound flows
        subprocess.run(
            ["ip", "-n", opn.netns, "route", "add", nat.ip.rsplit(".", 1)[0] + ".0/24", "via", nat.public_ip],
            check=True,
        )
        assert netlab.tcp_probe(opn, nat.ip, nport, timeout=2) is None
        # the NAT host's link is shaped too (on its router's WAN veth)
        up = netlab.measure_tcp(nat, opn, 2_000_000)
        assert 0.75 * 20e6 <= up <= 1.10 * 20e6, up
        down = netlab.measure_tcp(opn, nat, 2_000_000, dialer="dst")  # it dials, the open host sends
        assert 0.75 * 20e6 <= down <= 1.10 * 20e6, down
        with pytest.raises(netlab.NetlabError):  # the open host cannot dial in to send
            netlab.measure_tcp(opn, nat, 100_000, timeout=3)


@needs_lab
def test_namespaces_and_processes_gone_after_exit_and_after_exception():
    with netlab.Lab() as lab:
        a = lab.add_host("a", rate="20mbit")
        p = a.popen(["sleep", "1000"])
        names = lab.namespaces
        assert set(names) <= set(netlab.list_netns()) and len(names) == 2
    assert not set(names) & set(netlab.list_netns())
    assert p.poll() is not None

    with pytest.raises(RuntimeError, match="boom"):
        with netlab.Lab() as lab:
            a = lab.add_host("a")
            lab.add_host("b", nat=NAT_OK)
            p = a.popen(["sleep", "1000"])
            names = lab.namespaces
            raise RuntimeError("boom")
    assert not set(names) & set(netlab.list_netns())
    assert p.poll() is not None


_CHILD = textwrap.dedent("""
    import os, sys, time
    from locomm.testing import netlab
    lab = netlab.Lab(grace_s=1.0)
    lab.open()
    h = lab.add_host("a", rate="20mbit")
    p = h.popen(["sleep", "1000"])
    print(lab.run_name, p.pid, flush=True)
    if sys.argv[1] == "crash":
        os._exit(3)  # no atexit, no handlers: leaves its namespaces behind
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
""")


@needs_lab
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_cleans_up(sig):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, "wait"], stdout=subprocess.PIPE, text=True)
    run, pid = child.stdout.readline().split()
    assert _ours(run)
    child.send_signal(sig)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == (143 if sig == signal.SIGTERM else 130), (child.returncode, out)
    assert not _ours(run)
    assert _dead(pid)


@needs_lab
def test_cleanup_stale_removes_dead_runs():
    child = subprocess.Popen([sys.executable, "-c", _CHILD, "crash"], stdout=subprocess.PIPE, text=True)
    run, pid = child.stdout.readline().split()
    child.wait(timeout=30)
    child.stdout.close()
    assert child.returncode == 3
    assert _ours(run), "the crashed run should have left its namespaces"
    removed = netlab.cleanup_stale()
    assert set(_ours(run)) == set() and any(n.startswith(run) for n in removed)
    deadline = time.monotonic() + 5
    while not _dead(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(pid), "the sleep inside the dead run's namespace is killed"
