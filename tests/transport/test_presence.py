"""The one pause/resume sequence (``peer/presence.py``) on a driver of hooks, over a host of fakes: the order of the
steps, a pause called off at the last check, a resume retried while the DHT fails, a download retried with fresh
donors. The swarm tests (tests/swarm/test_volunteer.py) run the same sequence on real peers of both drivers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from locomm.peer.control import ControlError
from locomm.peer.presence import STATE_ATTEMPTS, Presence
from locomm.protocol.membership import Heartbeat


class FakeHost:
    def __init__(self) -> None:
        self.me = "me"
        self.stop, self.hurry = asyncio.Event(), asyncio.Event()
        self.opts = SimpleNamespace(control=False, checkpoint_dir=None)
        self.beats: dict[str, Heartbeat] = {}
        self.published: list[bool] = []  # the paused mark of each heartbeat stored
        self.events = SimpleNamespace(log=[], write=lambda kind, **f: self.events.log.append((kind, f)))
        self.slept: list[float] = []
        self.presence: Presence | None = None
        self.fetches: list[list[str]] = []
        self.judges: list[Any] = []
        self.fetch_answers: list[Any] = []
        self.group_reads = 0

    async def compute(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def publish(self) -> None:
        assert self.presence is not None
        self.published.append(self.presence.paused)

    async def sleep(self, s: float) -> None:
        self.slept.append(s)

    async def read_beats(self) -> list[Heartbeat]:
        return list(self.beats.values())

    async def fetch_state(self, donors: list[str], expected: Any, judge: Any = None) -> Any:
        self.fetches.append(donors)
        self.judges.append(judge)
        return self.fetch_answers.pop(0) if self.fetch_answers else None

    async def netgroups(self) -> dict[str, str]:
        self.group_reads += 1
        return {"d0": f"ip4:10.{self.group_reads}.0.0/16"}

    async def ages(self) -> dict[str, int]:
        self.age_reads = getattr(self, "age_reads", 0) + 1
        return {"d0": self.age_reads}

    def refresh_soon(self) -> None:
        pass


class FakeDriver:
    def __init__(self, host: FakeHost) -> None:
        self.host, self.round, self.phase, self.calls = host, 7, "training", []
        self.refuse_at_last_check: str | None = None
        self.resync_failures = 0
        self.checks = 0

    @property
    def step(self) -> int:
        return 70

    def describe(self) -> dict[str, Any]:
        return {"stage": 1}

    async def may_pause(self) -> str | None:
        self.checks += 1
        return self.refuse_at_last_check if self.checks > 1 else None

    async def drain(self) -> None:
        self.calls.append("drain")

    def undrain(self) -> None:
        self.calls.append("undrain")

    def snapshot(self, r: int) -> None:
        self.calls.append(f"snapshot {r}")

    async def resync(self) -> None:
        self.calls.append("resync")
        if self.resync_failures:
            self.resync_failures -= 1
            raise OSError("the DHT failed us")
        self.round = 9

    async def run_over(self) -> bool:
        return False


def _rig() -> tuple[FakeHost, FakeDriver, Presence]:
    host = FakeHost()
    driver = FakeDriver(host)
    host.presence = Presence(host, driver)  # type: ignore[arg-type]
    return host, driver, host.presence


async def test_pause_then_resume_runs_the_one_sequence_in_order():
    host, driver, presence = _rig()
    handlers = presence.controls(lambda: {"step": driver.step})
    driver.resync_failures = 2
    asked = asyncio.ensure_future(handlers["pause"]())
    await asyncio.sleep(0)
    paused = asyncio.ensure_future(presence.pause())
    answer = await asyncio.wait_for(asked, 5)
    assert answer["paused"] and answer["phase"] == "paused" and answer["round"] == 7 and answer["step"] == 70
    assert host.published == [True]  # the paused heartbeat went out once the state was served
    await handlers["resume"]()
    await asyncio.wait_for(paused, 5)
    assert driver.calls == ["drain", "snapshot 7", "resync", "resync", "resync", "snapshot 9", "undrain"]
    assert host.slept == [5.0, 5.0]  # a failed re-entry is retried, still paused
    assert host.published == [True, False] and not presence.paused and driver.phase == "training"
    kinds = [k for k, _ in host.events.log]
    assert kinds == ["paused", "resumed"]
    assert host.events.log[1][1]["paused_at"] == 7 and host.events.log[1][1]["stage"] == 1


async def test_a_pause_refused_at_the_last_check_is_called_off_unpublished():
    host, driver, presence = _rig()
    handlers = presence.controls(dict)
    driver.refuse_at_last_check = "the last replica"
    asked = asyncio.ensure_future(handlers["pause"]())
    await asyncio.sleep(0)
    await presence.pause()
    with pytest.raises(ControlError, match="the last replica"):
        await asyncio.wait_for(asked, 5)
    assert driver.calls == ["drain", "undrain"] and host.published == [] and not presence.paused
    assert [k for k, _ in host.events.log] == ["pause_refused"]


async def test_leaving_refuses_a_pause():
    host, _, presence = _rig()
    presence.left = True
    with pytest.raises(ControlError, match="leaving"):
        await presence.controls(dict)["pause"]()


async def test_a_download_asks_fresh_donors_each_attempt_then_gives_up():
    host, _, presence = _rig()
    reads = iter(range(100))

    seen_groups = []

    def donors(beats: list[Heartbeat], groups: dict[str, str], ages: dict[str, int]) -> list[str]:
        seen_groups.append(groups["d0"])
        assert ages == {"d0": len(seen_groups)}  # the trusted peers' view, asked anew too
        return [f"d{next(reads)}"]

    got = await presence.download(donors, {}, lambda t: None)
    assert got is None
    assert seen_groups == [f"ip4:10.{i + 1}.0.0/16" for i in range(STATE_ATTEMPTS)]  # the connections, read anew
    assert host.fetches == [[f"d{i}"] for i in range(STATE_ATTEMPTS)]
    assert host.slept == [2.0, 4.0, 8.0, 8.0]
    assert host.events.log == [("sync_failed", {"donors": 1, "asked": ["d4"]})]


async def test_a_download_that_succeeds_loads_what_it_got():
    host, _, presence = _rig()
    loaded = []
    synced = SimpleNamespace(round=3, tensors={"w": 1}, rule="majority", faulted=[], donors=["a", "b"])
    host.fetch_answers = [None, synced]

    async def judge(tensors: Any) -> str | None:
        return None

    got = await presence.download(lambda beats, groups, ages: ["a", "b"], {}, loaded.append, judge, stage=2)
    assert got is synced and loaded == [{"w": 1}] and len(host.fetches) == 2
    assert host.judges == [judge, judge]  # the driver's check goes with every attempt
    assert host.events.log[-1] == (
        "synced",
        {"donors": 2, "donor_round": 3, "tensors": 1, "rule": "majority", "faulted": 0, "stage": 2}
        | {"donor_ids": ["a", "b"], "faulted_ids": [], "asked": ["a", "b"]},
    )


def test_a_stop_while_an_exchange_runs_gives_it_the_grace_and_a_second_signal_none():
    """Ctrl-C while a round's exchange is awaited (its partners crashed: it would run to its own deadline, up to
    ``max_wait_s``) leaves it ``grace_s`` more, a second Ctrl-C none. On the main before, the wait began before the
    signal and took no notice of either: a peer whose partners had crashed sat out both signals (measured: 2 min
    and counting, killed)."""
    from locomm.peer.presence import finish_or_stop
    from locomm.testing.clock import run

    async def body() -> None:
        loop = asyncio.get_running_loop()
        host = FakeHost()
        quick = asyncio.ensure_future(asyncio.sleep(3.0, result="got"))
        assert await finish_or_stop(host, quick, 10.0) and quick.result() == "got"  # no stop: waited for

        t0 = loop.time()
        slow = asyncio.ensure_future(asyncio.sleep(600.0))
        loop.call_later(5.0, host.stop.set)
        assert not await finish_or_stop(host, slow, 10.0) and slow.cancelled()
        assert loop.time() - t0 == pytest.approx(15.0)  # the stop at 5 s, then the grace

        host = FakeHost()
        t0 = loop.time()
        slow = asyncio.ensure_future(asyncio.sleep(600.0))
        loop.call_later(5.0, host.stop.set)
        loop.call_later(7.0, host.hurry.set)
        assert not await finish_or_stop(host, slow, 10.0)
        assert loop.time() - t0 == pytest.approx(7.0)  # the second signal ends it at once

        host = FakeHost()
        host.stop.set()  # stopping already: an exchange that lands within the grace is still applied
        landing = asyncio.ensure_future(asyncio.sleep(8.0, result="late"))
        assert await finish_or_stop(host, landing, 10.0) and landing.result() == "late"

    run(body())


def test_a_leaving_peers_heartbeat_stores_have_an_end():
    """A leaving peer's two stores (its 'leaving, serving r' heartbeat and its goodbye) each end at their bound,
    stored or not. Unbounded, a chaos peer whose link was at 1 Mbit/s spent 53 s of its 60 s after SIGINT in them
    and was killed (docs/results/chaos.md, seed 13)."""
    from locomm.peer.presence import GOODBYE_S, LEAVE_PUBLISH_S
    from locomm.testing.clock import run

    async def body() -> None:
        loop = asyncio.get_running_loop()
        host, _, presence = _rig()

        async def stuck() -> None:
            await asyncio.sleep(600.0)  # a DHT store that never answers

        host.publish = stuck  # type: ignore[method-assign]
        host.dht_now = lambda: 0.0  # type: ignore[attr-defined]
        gossip = SimpleNamespace(leaving=False, outgoing={}, undelivered=lambda r: set(), banned=set(), clock=float)
        host.stop.set()
        t0 = loop.time()
        await presence.leave(gossip, 6, 30.0, 600.0, 60.0)  # type: ignore[arg-type]
        assert loop.time() - t0 == pytest.approx(LEAVE_PUBLISH_S + GOODBYE_S + LEAVE_PUBLISH_S)
        assert presence.left and gossip.leaving and host.events.log[-1][0] == "left"

    run(body())


def test_a_stop_ends_a_state_download_at_once():
    """Ctrl-C while a joiner downloads the swarm's state cancels the download (nothing was loaded; no
    ``sync_failed``). Before, the download ran on: a chaos joiner spent 45 s of its 60 s after SIGINT in one."""
    from locomm.testing.clock import run

    async def body() -> None:
        loop = asyncio.get_running_loop()
        host, _, presence = _rig()

        async def slow(donors: list[str], expected: Any, judge: Any = None) -> Any:
            await asyncio.sleep(600.0)

        host.fetch_state = slow  # type: ignore[method-assign]
        loop.call_later(5.0, host.stop.set)
        t0 = loop.time()
        assert await presence.download(lambda beats, groups, ages: ["d0"], {}, lambda t: None) is None
        assert loop.time() - t0 == pytest.approx(5.0)
        assert host.events.log == [] and host.slept == []

    run(body())


def test_a_download_cancelled_from_outside_takes_its_fetch_with_it():
    """The host's task group cancelling the driver mid-download cancels the fetch too (no task left running on a
    p2pd that is shutting down)."""
    from locomm.testing.clock import run

    async def body() -> None:
        host, _, presence = _rig()
        fetching: list[asyncio.Task] = []

        async def slow(donors: list[str], expected: Any, judge: Any = None) -> Any:
            fetching.append(asyncio.current_task())  # type: ignore[arg-type]
            await asyncio.sleep(600.0)

        host.fetch_state = slow  # type: ignore[method-assign]
        outer = asyncio.ensure_future(presence.download(lambda beats, groups, ages: ["d0"], {}, lambda t: None))
        await asyncio.sleep(5.0)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await asyncio.sleep(0)
        assert fetching and fetching[0].cancelled()

    run(body())
