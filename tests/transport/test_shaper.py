"""The traffic cap (``locomm/peer/transport/shaper.py``): the token bucket alone, and Links through it.

Everything runs on a virtual-time loop (``locomm.testing.clock``) with the loop's clock handed to the shaper
and the links, so a 600 s window takes no real time and durations are asserted to the virtual instant. Links
write into a collecting writer and read from a fed ``StreamReader`` (no p2pd, as in test_rpc.py).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from locomm.config import ConfigError
from locomm.config.distributed import NetworkConfig
from locomm.peer.transport.rpc import Limits, Link, Meter, RpcServer, open_link
from locomm.peer.transport.shaper import SLICE, Shaper, shaper_of
from locomm.testing.clock import run

pytestmark = pytest.mark.timeout(60)

MBIT = 1e6 / 8
LIMITS = Limits(request_timeout_s=5.0, stall_timeout_s=5.0, min_rate_Bps=10 * MBIT, rate_window_s=2.0)
PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def now() -> float:
    return asyncio.get_running_loop().time()


class Writer:
    """Collects what is written, with the time of each write."""

    def __init__(self) -> None:
        self.n = 0
        self.times: list[tuple[float, int]] = []

    def write(self, data) -> None:
        self.n += len(data)
        self.times.append((now(), self.n))

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        pass


class StubP2P:
    """Hands out one fed stream per call (what p2pd's call_binary_stream_handler returns)."""

    async def add_binary_stream_handler(self, name, handler) -> None:
        pass

    async def call_binary_stream_handler(self, peer, handler):
        return None, asyncio.StreamReader(), Writer()


def link(shaper: Shaper | None, limits: Limits = LIMITS) -> tuple[asyncio.StreamReader, Writer, Link]:
    reader, writer = asyncio.StreamReader(), Writer()
    return reader, writer, Link(reader, writer, limits, Meter("p", "send"), clock=now, shaper=shaper)


def test_the_bucket_holds_the_cap_within_one_percent_over_a_long_window():
    """A taker that always wants more, 600 s: the bytes granted are depth + rate * t, never more."""

    async def body():
        shaper = Shaper(20, None, clock=now)
        rate, depth = shaper.up.rate, shaper.up.depth
        done, t0 = 0, now()
        while now() - t0 < 600:
            await shaper.send(SLICE)
            done += SLICE
            assert done <= depth + rate * (now() - t0) + SLICE  # the bucket never runs ahead of its rate
        held = (done - depth) / (now() - t0)
        assert held == pytest.approx(rate, rel=0.01)
        assert shaper.up.granted == done

    run(body())


def test_a_link_write_takes_its_bytes_at_the_cap_plus_the_burst():
    """8 MB through 20 Mbit/s: (N - depth) / rate virtual seconds; the cap is below the link's floor, yet the
    link does not cut itself (time on its own bucket is not time on the wire)."""
    n = 8_000_000

    async def body():
        shaper = Shaper(20, None, clock=now)
        limits = Limits(request_timeout_s=1.0, stall_timeout_s=1.0, min_rate_Bps=40 * MBIT, rate_window_s=0.5)
        _, writer, ln = link(shaper, limits)
        ln.expect(n)  # 1 s + 1.6 s at the 40 Mbit/s floor, far less than the 3.1 s the cap takes
        t0 = now()
        await ln.write_bytes(bytes(n))
        dt = now() - t0
        assert writer.n == n
        assert dt == pytest.approx((n - shaper.up.depth) / shaper.up.rate, abs=1e-6)
        assert dt == pytest.approx(n * 8 / 20e6 - 0.25, abs=1e-6)  # the default burst: 0.25 s of the rate
        assert max(b - a for (_, a), (_, b) in zip([(0, 0), *writer.times], writer.times)) <= SLICE
        assert ln.meter.throttled_s == pytest.approx(dt, abs=1e-6)

    run(body())


def test_two_concurrent_links_share_one_cap():
    """Two 4 MB writes at once through one 20 Mbit/s bucket: both end together, after 8 MB at the cap; halfway
    through each has had half of what went out."""
    n = 4_000_000

    async def body():
        shaper = Shaper(20, None, clock=now)
        (_, wa, a), (_, wb, b) = link(shaper), link(shaper)
        t0 = now()
        ends = []

        async def write(ln: Link) -> None:
            await ln.write_bytes(bytes(n))
            ends.append(now() - t0)

        await asyncio.gather(write(a), write(b))
        total = (2 * n - shaper.up.depth) / shaper.up.rate
        assert max(ends) == pytest.approx(total, abs=1e-6)
        assert abs(ends[0] - ends[1]) <= SLICE / shaper.up.rate + 1e-9  # FIFO: neither starves the other
        half = t0 + total / 2
        by_half = [max((k for t, k in w.times if t <= half), default=0) for w in (wa, wb)]
        assert by_half[0] == pytest.approx(by_half[1], abs=2 * SLICE)
        assert sum(by_half) == pytest.approx(shaper.up.depth + shaper.up.rate * total / 2, abs=2 * SLICE)

    run(body())


def test_a_download_cap_paces_reads_and_does_not_blame_the_sender():
    """The sender delivers 3 MB at once; a 4 Mbit/s download cap reads it in (N - depth) / rate, beyond the
    link's floor deadline and floor window, and the link is not cut (the slowness is ours)."""
    n = 3_000_000

    async def body():
        shaper = Shaper(None, 4, clock=now)
        limits = Limits(request_timeout_s=1.0, stall_timeout_s=1.0, min_rate_Bps=10 * MBIT, rate_window_s=0.5)
        reader, _, ln = link(shaper, limits)
        reader.feed_data(bytes(n))
        ln.expect(n)
        t0 = now()
        data = await ln.read_exact(n)
        dt = now() - t0
        assert len(data) == n
        assert dt == pytest.approx((n - shaper.down.depth) / shaper.down.rate, abs=1e-6)
        assert dt > limits.deadline_s(n)  # 1 s + 2.4 s at the floor: it would have been cut without the shift

    run(body())


def test_unlimited_is_a_no_op():
    async def body():
        shaper = Shaper(None, None, clock=now)
        assert not shaper.limited and shaper.up is None and shaper.down is None
        assert shaper.max_concurrent(10 * MBIT) is None
        reader, writer, ln = link(shaper)
        assert ln.up is None and ln.down is None
        t0 = now()
        assert await shaper.send(1 << 30) == 0.0 and await shaper.recv(1 << 30) == 0.0
        await ln.write_bytes(bytes(4 << 20))
        reader.feed_data(bytes(4 << 20))
        await ln.read_exact(4 << 20)
        assert now() == t0 and writer.n == 4 << 20

    run(body())


def test_a_cancelled_taker_gives_its_tokens_back():
    async def body():
        shaper = Shaper(8, None, clock=now)  # 1 MB/s, 0.25 MB deep
        waiter = asyncio.create_task(shaper.send(10_000_000))  # 9.75 s of debt
        await asyncio.sleep(1.0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        t0 = now()
        await shaper.send(500_000)  # the bucket has refilled to its depth: 0.25 s more
        assert now() - t0 == pytest.approx(0.25, abs=1e-6)
        assert shaper.up.granted == 500_000

    run(body())


def test_check_refuses_a_cap_below_the_floor_and_max_concurrent_keeps_it():
    net = NetworkConfig(min_rate_mbit=10.0)
    with pytest.raises(ConfigError, match=r"--max-upload-mbit 4 is below 1.25x the swarm's floor .*min_rate_mbit=10"):
        Shaper(4, None).check(net)
    with pytest.raises(ConfigError, match="--max-download-mbit 12"):  # at the floor, but without the headroom
        Shaper(None, 12).check(net)
    Shaper(12.5, 12.5).check(net)
    Shaper(4, None).check(NetworkConfig(min_rate_mbit=2.0))
    s = Shaper(25, 40)
    floor = net.min_rate_mbit * MBIT
    assert s.max_concurrent(floor) == 2 and s.max_concurrent(floor, "down") == 3  # 1.25x the floor each
    assert Shaper(20, None).max_concurrent(floor) == 1 and Shaper(10, None).max_concurrent(floor) == 1
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="positive"):
            Shaper(bad, None)


def test_the_gate_runs_at_most_max_concurrent_transfers_at_once():
    """Five 1 MB pushes under a 30 Mbit/s cap and a 10 Mbit/s floor: two at a time, each above the floor."""

    async def body():
        shaper, floor = Shaper(30, None, clock=now), 10 * MBIT
        running, most, rates = 0, 0, []

        async def push() -> None:
            nonlocal running, most
            async with shaper.gate(floor):
                running += 1
                most = max(most, running)
                _, _, ln = link(shaper)
                t0 = now()
                await ln.write_bytes(bytes(1_000_000))
                rates.append(1_000_000 / (now() - t0))
                running -= 1

        await asyncio.gather(*(push() for _ in range(5)))
        assert most == 2
        assert min(rates) >= 1.25 * floor
        async with Shaper(None, None).gate(floor):  # no cap: no gate
            pass

    run(body())


def test_the_server_attaches_its_shaper_and_client_links_pick_it_up():
    async def body():
        p2p, shaper = StubP2P(), Shaper(20, 30, clock=now)
        with ThreadPoolExecutor(1) as pool:
            server = RpcServer(p2p, "run", LIMITS, pool, clock=now, shaper=shaper)
            assert server.shaper is shaper and shaper_of(p2p) is shaper
            ln = await open_link(p2p, PEER, "h", LIMITS, clock=now)
            assert ln.up is shaper.up and ln.down is shaper.down
            other = Shaper(5, None, clock=now)
            assert (await open_link(p2p, PEER, "h", LIMITS, clock=now, shaper=other)).up is other.up
            assert shaper_of(StubP2P()) is None
            assert (await open_link(StubP2P(), PEER, "h", LIMITS, clock=now)).up is None

    run(body())
