"""The virtual-time event loop of ``locomm.testing.clock``: it jumps over idle time, never over thread work."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from locomm.testing.clock import VirtualTimeLoop, run

pytestmark = pytest.mark.timeout(30)


def test_a_long_sleep_takes_no_real_time():
    async def body() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(1000)
        return t0, loop.time()

    real = time.monotonic()
    t0, t1 = run(body())
    assert time.monotonic() - real < 0.5
    assert t0 == 0.0 and t1 == pytest.approx(1000.0, abs=1e-9)


def test_the_clock_starts_where_asked_and_sleeps_add_up_exactly():
    async def body() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = [loop.time()]
        for dt in (0.25, 0.5, 2.0):
            await asyncio.sleep(dt)
            seen.append(loop.time())
        return seen

    assert run(body(), start=100.0) == [100.0, 100.25, 100.75, 102.75]


def test_a_timeout_fires_in_virtual_time():
    async def body() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(3.0):
                await asyncio.Event().wait()  # nothing will ever set it
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 2.0)
        return loop.time()

    real = time.monotonic()
    assert run(body()) == pytest.approx(5.0, abs=1e-9)
    assert time.monotonic() - real < 0.5


def test_concurrent_sleepers_wake_in_order_at_their_own_times():
    async def body() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        woke: list[tuple[str, float]] = []

        async def sleeper(name: str, dt: float) -> None:
            await asyncio.sleep(dt)
            woke.append((name, loop.time()))

        await asyncio.gather(sleeper("c", 30), sleeper("a", 10), sleeper("b", 20))
        return woke

    assert run(body()) == [("a", 10.0), ("b", 20.0), ("c", 30.0)]


@pytest.mark.parametrize("executor", ["default", "pool", "to_thread"])
def test_executor_work_is_not_jumped_over(executor):
    """A 0.2 s job in a thread under a 1 s (virtual) timeout, beside a 100 s sleeper: the clock waits for it."""

    def job() -> float:
        time.sleep(0.2)
        return 42.0

    async def body(pool: ThreadPoolExecutor) -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        sleeper = asyncio.create_task(asyncio.sleep(100))
        if executor == "to_thread":
            work = asyncio.to_thread(job)
        else:
            work = loop.run_in_executor(None if executor == "default" else pool, job)
        got = await asyncio.wait_for(work, 1.0)  # a jump to the sleeper's timer would time this out
        at = loop.time()
        await sleeper
        return got, at, loop.time()

    with ThreadPoolExecutor(1) as pool:
        real = time.monotonic()
        got, at, end = run(body(pool))
    assert got == 42.0 and at == 0.0 and end == pytest.approx(100.0)
    assert time.monotonic() - real >= 0.2  # the job really ran, in real time


def test_a_cancelled_job_still_running_holds_the_clock():
    """A job whose future was cancelled (a cut transfer's decode) keeps its thread busy; no jump until it returns."""
    release = threading.Event()

    async def body() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, release.wait, 5)
        await asyncio.sleep(0)
        fut.cancel()  # too late: the thread has it
        loop.call_soon(threading.Timer(0.2, release.set).start)
        t0 = loop.time()
        assert loop.in_executor == 1
        await asyncio.sleep(50)  # jumps only once the thread let go of the job
        return t0, loop.time()

    real = time.monotonic()
    t0, t1 = run(body())
    assert t0 == 0.0 and t1 == pytest.approx(50.0)
    assert time.monotonic() - real >= 0.2


def test_real_io_is_still_served():
    """A socket pair: data a thread writes arrives on the real selector, and no virtual time passes. (With a
    timer pending the loop would jump to it instead: only executor jobs hold the clock.)"""

    async def body() -> tuple[bytes, float]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        try:
            reader, writer = await asyncio.open_connection(sock=a)
            threading.Timer(0.1, b.sendall, (b"hello",)).start()
            data = await reader.readexactly(5)  # no timer: the loop blocks on the real selector
            writer.close()
            return data, loop.time()
        finally:
            b.close()

    data, at = run(body())
    assert data == b"hello" and at == 0.0


def test_the_loop_does_not_run_backwards():
    loop = VirtualTimeLoop(start=5.0)
    try:
        loop.advance(1.5)
        assert loop.time() == 6.5
        with pytest.raises(ValueError):
            loop.advance(-1)
    finally:
        loop.close()
