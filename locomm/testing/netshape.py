"""Per-destination link rates on a :class:`locomm.testing.netlab.Lab`: a fast LAN among a few hosts, the lab's
rate to everyone else (a home with two machines on gigabit Ethernet behind one consumer uplink each).

Stdlib only; needs root and tc's ``htb`` and ``u32`` (no netem, no ifb). :func:`shape_group` replaces the lab's
tbf on both veth ends of every group member with an htb tree of two classes, each its own rate and ceiling
(no borrowing between them)::

    root 1: htb default 10
      class 1:10  rate = ceil = the member's own rate (``Host.up_bps`` / ``down_bps``)   everything else
      class 1:20  rate = ceil = the group rate                                          the other members
      u32 filters: ip dst <member> -> 1:20 on the upload end (the host's eth0, egress),
                   ip src <member> -> 1:20 on the download end (the hub's veth, egress)

A flow between two members thus crosses the sender's 1:20 upload and the receiver's 1:20 download; a flow to or
from a non-member crosses the member's 1:10 and the other host's tbf, as before. The two classes are separate
pipes, not one link shared: a member can send at the group rate to a member and at its own rate to the rest at
once. Each class has a ``bfifo`` leaf holding ``latency_ms`` of queue at its rate (the lab's tbf queue), and
``burst = cburst = max(rate / 100 Hz, 64 KiB)`` (the lab's tbf burst: a veth hands GSO super-packets of up to
64 KiB). Matching on ``public_ip``: a NATed member's router rewrites the source before its eth0.

    with netlab.Lab() as lab:
        a, b, c = (lab.add_host(n, rate="80mbit") for n in "abc")
        netshape.shape_group([a, b], "1gbit")       # a <-> b at 1 Gbit/s, a/b <-> c at 80 Mbit/s
        print(netlab.measure_tcp(a, b) / 1e6, netlab.measure_tcp(a, c) / 1e6)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from locomm.testing.netns import LATENCY_MS, MIN_BURST, NetlabError, _run, parse_rate

if TYPE_CHECKING:
    from locomm.testing.netlab import Host

DEFAULT_CLASS, GROUP_CLASS = "1:10", "1:20"


def _burst(bps: int) -> int:
    return max(bps // 8 // 100, MIN_BURST)


def _add_class(ns: str, dev: str, classid: str, bps: int, latency_ms: float) -> None:
    b = str(_burst(bps))
    _run(
        ["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb"]
        + ["rate", f"{bps}bit", "ceil", f"{bps}bit", "burst", b, "cburst", b, "quantum", "60000"]
    )
    limit = max(int(bps / 8 * latency_ms / 1000), 4 * MIN_BURST)
    minor = classid.split(":")[1]
    _run(
        ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", classid, "handle", f"{minor}:", "bfifo"]
        + ["limit", str(limit)]
    )


def shape_dev(
    ns: str,
    dev: str,
    default_bps: int,
    group_bps: int,
    ips: Sequence[str],
    *,
    match: str,
    latency_ms: float = LATENCY_MS,
) -> None:
    """htb on the egress of ``dev`` in ``ns``: packets whose ``match`` ("src" or "dst") address is one of
    ``ips`` at ``group_bps``, the rest at ``default_bps``."""
    if match not in ("src", "dst"):
        raise ValueError(f"match must be 'src' or 'dst', got {match!r}")
    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
    _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
    _add_class(ns, dev, DEFAULT_CLASS, default_bps, latency_ms)
    _add_class(ns, dev, GROUP_CLASS, group_bps, latency_ms)
    for ip in ips:
        _run(
            ["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32"]
            + ["match", "ip", match, f"{ip}/32", "flowid", GROUP_CLASS]
        )


def shape_group(members: Sequence[Host], rate: str | int, *, latency_ms: float | None = None) -> None:
    """Traffic among ``members`` at ``rate`` (both ways), each member's traffic with everyone else at its own
    (lab-set) upload and download rates, which must be shaped (not None)."""
    bps = parse_rate(rate)
    if bps is None:
        raise ValueError("shape_group needs a rate, not none")
    if len(members) < 2:
        raise ValueError(f"a group needs 2+ members, got {len(members)}")
    for h in members:
        if h.up_bps is None or h.down_bps is None:
            raise NetlabError(f"{h.name}: shape_group needs a shaped host (its own rate for the rest)")
        lat = h.lab.latency_ms if latency_ms is None else latency_ms
        others = [o.public_ip for o in members if o is not h]
        shape_dev(*h.up_dev, h.up_bps, bps, others, match="dst", latency_ms=lat)
        shape_dev(*h.down_dev, h.down_bps, bps, others, match="src", latency_ms=lat)


def show(host: Host) -> dict[str, str]:
    """``tc -s`` qdisc, class and filter listings of a host's two shaped ends (for a bench's record)."""
    out = {}
    for side, (ns, dev) in (("up", host.up_dev), ("down", host.down_dev)):
        text = []
        for what in ("qdisc", "class", "filter"):
            r = _run(["tc", "-n", ns, "-s", what, "show", "dev", dev], check=False)
            text.append(r.stdout)
        out[side] = "".join(text)
    return out


def _self_test() -> None:  # python -m locomm.testing.netshape [JSON]: a group of 2 at 1gbit, the rest 80mbit
    import json  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from locomm.testing import netlab  # noqa: PLC0415

    ok, why = netlab.available()
    if not ok:
        print(f"netlab unavailable: {why}")
        sys.exit(1)
    out: dict[str, float] = {}
    with netlab.Lab() as lab:
        h = [lab.add_host(f"p{i}", rate="80mbit") for i in range(4)]
        shape_group(h[:2], "1gbit")
        for a, b, n in ((0, 1, 64e6), (1, 0, 64e6), (0, 2, 8e6), (2, 0, 8e6), (1, 3, 8e6), (3, 1, 8e6), (2, 3, 8e6)):
            out[f"p{a}->p{b}"] = netlab.measure_tcp(h[a], h[b], int(n)) / 1e6
            print(f"p{a} -> p{b}: {out[f'p{a}->p{b}']:.1f} Mbit/s", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"group": ["p0", "p1"], "group_rate": "1gbit", "rate": "80mbit", "mbit_s": out}, f, indent=1)


if __name__ == "__main__":
    _self_test()
