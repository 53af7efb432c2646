"""One peer's place in the swarm, for every driver: entering it (a state download), pausing and resuming,
leaving it. A driver (the data-parallel node, a pipeline stage replica) owns one :class:`Presence` and implements
the small :class:`Driver` protocol; nothing here knows which driver it drives.

Entering: where a driver joins (a round a little ahead of the swarm's, or its siblings' clock) is the driver's
own rule; *whom* it asks for state is one rule (``protocol/membership.state_donors``: live admitted peers near
the robust top, so one peer claiming round 10^9 is neither where we go nor whom we ask), tried up to
``STATE_ATTEMPTS`` times, each with a fresh heartbeat read (:meth:`Presence.download`). What most donors agree
on wins (``transport/state_sync.py``).

Pausing (:meth:`Presence.pause`, asked for through the control socket, ``locomm-peer pause`` / ``resume``):
1. the driver drains: the pending exchange is finished (a later pipeline stage first refuses new frames with
   NOT_READY and answers those it holds);
2. the driver's refusal is checked again (the last unpaused replica of a later stage may not pause); a refusal,
   or a resume that came meanwhile, calls the pause off before anything is published;
3. a snapshot of the weights it stops at, and a heartbeat marked ``paused``: nobody waits for us from this round
   on (``membership.members_for_round`` treats it as a goodbye), no route leads to us; state is still served;
4. wait for resume or stop (or the driver's run being over);
5. re-enter as a joiner does (the driver's ``resync``), still marked paused, retried while the DHT fails us;
6. a fresh snapshot, the paused mark down, a heartbeat, a ``resumed`` event.

Leaving (:meth:`Presence.leave`), at the last round, on Ctrl-C/SIGTERM/SIGHUP: the pending exchange has been
finished; then, for a bounded time, the last payload is served until every partner of that round has it (a push
answered OK, or a pull) or has left itself (or, past a round, is not on its way to that round any more); then a
final heartbeat marked ``finished``. Partners that read it skip us without a deadline (``Gossip.gone``, wired to
:meth:`Presence.partner_gone`). A second signal (``Host.hurry``) stops the hand-over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from locomm import __version__
from locomm.peer.control import ControlError, ControlServer, Handler, control_path
from locomm.peer.host import GOODBYE_S, Host
from locomm.peer.transport.gossip import Gossip
from locomm.peer.transport.state_sync import Judge, StateMismatch, Synced
from locomm.protocol.membership import STATE_RETRY_S, Heartbeat, may_still_pull, restarted, sends_nothing_more

__all__ = [
    "JOIN_MARGIN_ROUNDS",
    "STATE_ATTEMPTS",
    "Driver",
    "Presence",
    "finite",
    "first_of",
    "publish_quietly",
]

log = logging.getLogger(__name__)
T = TypeVar("T")
JOIN_MARGIN_ROUNDS = 2
"""A joiner's first round is this far ahead of the swarm's, so every peer counts it from the same round on."""
STATE_ATTEMPTS = len(STATE_RETRY_S) + 1
PAUSE_ANSWER_S = 20.0
"""How long ``pause`` waits for the peer to reach a step boundary before it answers with the phase."""
STOP_HANDOVER_S = 10.0
"""After Ctrl-C, how long a leaving peer serves its last payload to partners that have not had it yet."""
LEAVE_PUBLISH_S = 5.0
"""After a signal, how long each of a leaving peer's heartbeat stores may take (the goodbye: this beyond
``GOODBYE_S``, its own bound on reaching a node other than ours); one not stored by then expires instead.
Unbounded, a chaos peer whose link was at 1 Mbit/s spent 53 s of its 60 s after SIGINT in two stores
(docs/results/chaos.md, seed 13)."""
RESYNC_RETRY_S = 5.0
"""Back from a pause, how long to wait before entering the swarm again when the DHT failed us (still paused)."""


class Driver(Protocol):
    """What a :class:`Presence` drives: the hooks a data-parallel node and a pipeline stage replica implement."""

    round: int
    phase: str

    @property
    def step(self) -> int:
        """Optimizer steps taken."""
        ...

    def describe(self) -> dict[str, Any]:
        """The driver's own fields of its ``pause`` answer and its paused/resumed events (its stage, say)."""
        ...

    async def may_pause(self) -> str | None:
        """Why it may not pause now (None: it may); asked before a pause and again just before it is published."""
        ...

    async def drain(self) -> None:
        """Reach a state that can be paused: the pending exchange finished, frames in hand answered."""
        ...

    def undrain(self) -> None:
        """The pause was called off, or is over: take work again."""
        ...

    def snapshot(self, round_idx: int) -> None:
        """Serve the state we hold now to joiners (in the compute thread)."""
        ...

    async def resync(self) -> None:
        """Back from a pause: enter the swarm again as a joiner does (raises on a DHT failure: retried)."""
        ...

    async def run_over(self) -> bool:
        """While paused: whether the run ended without us (then the pause ends the driver)."""
        ...


class Presence:
    """One driver's presence in the swarm (see the module docstring). The driver's heartbeat reads ``paused``
    and ``left`` from here."""

    def __init__(self, host: Host, driver: Driver) -> None:
        self.host, self.driver = host, driver
        self.started = self.paused = self.left = False
        self.pause_wanted, self.resume_wanted = asyncio.Event(), asyncio.Event()
        self.answered = asyncio.Event()
        """Set when the last pause request has its answer: paused, or called off (``refusal`` says why)."""
        self.refusal: str | None = None
        """Why the last pause was called off after it was asked for (None: it was not)."""
        self.gossip: Gossip | None = None
        self._incarnations: dict[tuple[str, int], str] = {}
        """Per (partner, round) waited on: the partner's incarnation when the wait began."""

    def wire(self, gossip: Gossip) -> None:
        """The driver's exchange: its waits learn from partners' heartbeats who will send nothing more and who
        serves a payload to pull now, and our heartbeat says what we serve (every driver alike)."""
        self.gossip = gossip
        gossip.gone = self.partner_gone  # a partner that left, paused, or moved on serving nothing: no waiting
        gossip.serves = self.partner_serves  # a partner whose push failed: pull it now

    # -- heartbeats, summaries -------------------------------------------------------------

    def beat(self, **fields: Any) -> Heartbeat:
        """A heartbeat with the fields every driver shares (who, addresses, version, started/paused/left, faults;
        a loss that is not finite as None) and the driver's own ``fields``."""
        h = self.host
        for k in ("loss", "val_loss"):
            if k in fields:
                fields[k] = finite(fields[k])
        if self.left:  # the goodbye: it serves nothing any more
            fields["serves"] = ()
        elif "serves" not in fields and self.gossip is not None:
            fields["serves"] = tuple(self.gossip.serving())
        fields.setdefault("leaving", not self.left and self.gossip is not None and self.gossip.leaving)
        return Heartbeat(
            peer=h.me,
            started=self.started,
            finished=self.left,
            paused=self.paused,
            version=__version__,
            incarnation=h.incarnation,
            maddrs=tuple(str(m) for m in h.maddrs),
            faults=h.faults.total,
            **fields,
        )

    def summary(
        self, gossip: Gossip, *, rounds: int, steps: int, initial: float, final: float, t0: float, **own: Any
    ) -> dict[str, Any]:
        """What a peer reports at exit (its ``finished`` event and ``--json`` line): the keys every driver shares,
        then the driver's own."""
        h, g = self.host, gossip.stats
        return {
            "peer": h.me,
            "rounds_completed": rounds,
            "steps": steps,
            "initial_loss": initial,
            "final_loss": final,
            "exchanges_ok": g.exchanges_ok,
            "exchanges_failed": g.exchanges_failed,
            "transfers_cut": h.rpc.stats.cut,
            "faults": h.faults.total,
            "banned": len(h.faults.banned),
            "banned_peers": sorted(h.faults.banned),
            "errors_answered": dict(h.rpc.stats.errors_answered),
            "wall_s": time.perf_counter() - t0,
            "interrupted": h.stop.is_set(),
            **own,
        }

    # -- entering --------------------------------------------------------------------------

    async def download(
        self,
        donors_of: Callable[[list[Heartbeat], Mapping[str, str], Mapping[str, int]], list[str]],
        expected: Mapping[str, tuple[int, ...]],
        load: Callable[[dict[str, Any]], None],
        judge: Judge | None = None,
        **event: Any,
    ) -> Synced | None:
        """The swarm's state, from the peers ``donors_of(beats, groups, ages)`` picks in a fresh heartbeat read (ours
        excluded; ``groups``: each connected peer's ``membership.netgroup``, for donors of many groups; ``ages``:
        ``Host.ages``, the round each peer was first seen alive in by us or a trusted peer), loaded
        with ``load`` in the compute thread; up to STATE_ATTEMPTS whole downloads, STATE_RETRY_S apart. None when
        none succeeded (a ``sync_failed`` event; the driver goes on from its own weights). ``judge``: the driver's
        check of each candidate state (state_sync's rule 6). ``event``: extra fields of the ``synced`` /
        ``sync_failed`` events."""
        host = self.host
        donors: list[str] = []
        got = None
        for attempt in range(STATE_ATTEMPTS):
            if attempt:
                # The state moved on while we fetched, a donor has not read our heartbeat yet (UNAUTHORIZED), or
                # it left or restarted elsewhere: wait a little, then ask the donors a fresh read names.
                log.info("state download %d/%d failed; asking again", attempt, STATE_ATTEMPTS)
                await host.sleep(STATE_RETRY_S[attempt - 1])
                if host.stop.is_set():
                    break
            beats = [b for b in await host.read_beats() if b.peer != host.me]
            ages = await unless_stopped(host, host.ages())  # asks the trusted peers: 21 s at most
            if host.stop.is_set():
                break
            donors = donors_of(beats, await host.netgroups(), ages or {})
            got = await unless_stopped(host, host.fetch_state(donors, expected, judge)) if donors else None
            if got is not None or host.stop.is_set():
                break
        if got is not None:
            try:
                await host.compute(load, got.tensors)
            except StateMismatch as e:  # fetch_state checked the layout already: a bug here, not a crash
                log.warning("the downloaded state does not fit this model: %s", e)
                got = None
        if got is None and host.stop.is_set():
            log.info("stopped while downloading the swarm's state; nothing was loaded")
            return None
        if got is None:
            log.warning("could not download the swarm's state from %d donor(s)", len(donors))
            host.events.write("sync_failed", donors=len(donors), asked=list(donors), **event)
            return None
        info = dict(donor_round=got.round, tensors=len(got.tensors), rule=got.rule, faulted=len(got.faulted))
        info.update(donor_ids=list(got.donors), faulted_ids=list(got.faulted), asked=list(donors))
        host.events.write("synced", donors=len(got.donors), **info, **event)
        log.info("synced state of round %d from %d donor(s) by %s", got.round, len(got.donors), got.rule)
        return got

    def partner_gone(self, peer: str, round_idx: int) -> bool:
        """``Gossip.gone``: whether ``peer`` will not send ``round_idx``'s payload: it left or was paused, or it
        is two rounds past it (its exchange of that round is over), and its heartbeat does not list the round in
        ``serves`` (what it had sent has come; what it still serves we pull); or it restarted since the wait
        began (``membership.restarted``). While we wait on a partner, the
        heartbeats are read again about once a second, so a goodbye is seen soon."""
        b = self.host.beats.get(peer)
        if b is not None and sends_nothing_more(b, round_idx):
            return True
        # the process we planned with: asked first at the start of the wait (about when we planned)
        if len(self._incarnations) > 512:
            self._incarnations = {k: v for k, v in self._incarnations.items() if k[1] >= round_idx - 2}
        planned = self._incarnations.setdefault((peer, round_idx), b.incarnation if b is not None else "")
        if restarted(b, planned):
            return True
        self.host.refresh_soon()
        return False

    def partner_serves(self, peer: str, round_idx: int) -> bool:
        """``Gossip.serves``: whether ``peer``'s heartbeat says it serves ``round_idx``'s payload to pullers (a
        push of it failed, or it is leaving): the exchange pulls it now rather than at its ETA."""
        b = self.host.beats.get(peer)
        return b is not None and round_idx in b.serves

    # -- pausing ---------------------------------------------------------------------------

    async def start_control(self, state: Callable[[], dict[str, Any]]) -> None:
        """Serve the control socket in the checkpoint folder (none without one, or with ``opts.control`` off):
        ``pause`` (answered once paused, or after PAUSE_ANSWER_S with the phase; refused, saying why, when the
        driver's ``may_pause`` gives a reason), ``resume``, ``status``. ``state``: the driver's answer."""
        host = self.host
        if not host.opts.control or host.opts.checkpoint_dir is None:
            return
        server = ControlServer(control_path(host.opts.checkpoint_dir), self.controls(state))
        await server.start()
        host.spawn(server.serve())

    def controls(self, state: Callable[[], dict[str, Any]]) -> dict[str, Handler]:
        """The control handlers (:meth:`start_control`)."""

        def answer() -> dict[str, Any]:
            return {"paused": self.paused, "phase": self.driver.phase, "round": self.driver.round} | state()

        async def pause() -> dict[str, Any]:
            self.refusal = None  # a new request: an earlier one's refusal is not its answer
            if self.left or self.host.stop.is_set():
                raise ControlError("the peer is leaving")
            if not self.paused and (why := await self.driver.may_pause()) is not None:
                raise ControlError(why)
            self.answered.clear()
            self.resume_wanted.clear()
            self.pause_wanted.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.answered.wait(), PAUSE_ANSWER_S)
            if not self.paused and self.refusal is not None:  # called off after the first check (pause step 2)
                raise ControlError(self.refusal)
            return answer()

        async def resume() -> dict[str, Any]:
            self.pause_wanted.clear()
            self.resume_wanted.set()
            return answer()

        async def status() -> dict[str, Any]:
            return answer()

        return {"pause": pause, "resume": resume, "status": status}

    async def pause(self) -> None:
        """The one pause sequence (the module docstring's six steps), at a point the driver chose (a step
        boundary). Returns when resumed, when stopped while paused, or when the run ended meanwhile."""
        host, d = self.host, self.driver
        await d.drain()
        refusal = None if host.stop.is_set() else await d.may_pause()
        if refusal is not None or not self.pause_wanted.is_set() or self.resume_wanted.is_set():
            # Called off: refused now, or resumed while we drained (nothing was published: nobody left us out).
            d.undrain()
            self.pause_wanted.clear()
            self.resume_wanted.clear()
            if refusal is not None:
                self.refusal = refusal
                host.events.write("pause_refused", **d.describe(), why=refusal)
                log.warning("pause called off: %s", refusal)
            self.answered.set()  # the pause request answers with the refusal, or that we train
            return
        await host.compute(d.snapshot, d.round)
        self.paused, d.phase = True, "paused"
        await publish_quietly(host)
        self.answered.set()
        host.events.write("paused", **d.describe(), round=d.round, step=d.step)
        log.info("paused at round %d (locomm-peer resume to go on)", d.round)
        t0 = time.monotonic()
        while not (host.stop.is_set() or self.resume_wanted.is_set()):
            await first_of(1.0, host.stop, self.resume_wanted)
            if await d.run_over():
                log.info("the run ended while we were paused")
                return  # the driver ends; we stay paused
        self.resume_wanted.clear()
        self.pause_wanted.clear()
        if host.stop.is_set():  # leaving while paused: the final heartbeat follows
            return
        paused_at = d.round
        # Still marked paused while it syncs: a partner that read our new join round before the download ended
        # would plan us into rounds we miss, and wait out their deadlines for us.
        while not host.stop.is_set():
            try:
                await d.resync()
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the DHT failed us mid-resume: still paused, try again
                log.warning("could not enter the swarm again (%s); still paused, trying again soon", e)
                await host.sleep(RESYNC_RETRY_S)
        if host.stop.is_set():  # stopped while it synced: it leaves as it was, paused
            return
        await host.compute(d.snapshot, d.round)  # joiners get the state we train from now, not the paused one
        d.undrain()
        self.paused, d.phase = False, "training"
        await publish_quietly(host)
        paused_s = time.monotonic() - t0
        host.events.write("resumed", **d.describe(), round=d.round, paused_at=paused_at, paused_s=paused_s)
        log.info("resumed at round %d (paused at %d)", d.round, paused_at)

    # -- leaving ---------------------------------------------------------------------------

    async def leave(self, gossip: Gossip, last: int, handover_s: float, max_s: float, ttl: float) -> None:
        """Serve round ``last``'s payload until its partners have it (or left, or a second signal), then publish
        the final heartbeat that says we left.

        Past ``handover_s`` we wait only for partners still on their way to that round (a heartbeat younger than
        ``ttl`` at most a round past it: a loaded partner may be seconds behind; not one that is leaving too:
        ``membership.may_still_pull``), and never past ``max_s``; after Ctrl-C at most STOP_HANDOVER_S."""
        host, d = self.host, self.driver
        stopping = host.stop.is_set()
        t0 = time.monotonic()

        def coming(peer: str) -> bool:
            return may_still_pull(host.beats.get(peer), last, host.dht_now(), ttl)

        waiting: set[str] = set()
        gossip.leaving = True  # our heartbeat lists what we still serve: partners pull it now
        bound = LEAVE_PUBLISH_S if stopping else None  # after a signal, leaving has an end of its own
        await publish_quietly(host, bound)
        out = gossip.outgoing.get(last)
        end = math.inf if out is None else out.serve_until  # in the gossip's clock: never served past it
        while not host.hurry.is_set():
            waiting = {p for p in gossip.undelivered(last) if not self.partner_gone(p, last + 1)}
            waiting -= gossip.banned
            waited = time.monotonic() - t0
            if stopping:
                over = waited > min(handover_s, STOP_HANDOVER_S)
            else:
                over = waited > max_s or (waited > handover_s and not any(coming(p) for p in waiting))
            over = over or gossip.clock() > end
            if not waiting or over:
                break
            d.phase = "handing over"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(host.hurry.wait(), 0.25)
        self.left = True
        d.phase = "left"
        # a failed store (logged): the heartbeat expires instead
        await publish_quietly(host, None if bound is None else GOODBYE_S + bound)
        handover = time.monotonic() - t0
        host.events.write("left", **d.describe(), round=d.round, handover_s=handover, undelivered=sorted(waiting))
        if waiting:
            log.info("left after %.1f s; %d partner(s) never took our last payload", handover, len(waiting))


async def publish_quietly(host: Host, timeout: float | None = None) -> None:
    """``host.publish()``, a DHT failure logged rather than raised (the heartbeat loop publishes again soon);
    given up after ``timeout`` seconds."""
    bound = asyncio.timeout(timeout)
    try:
        async with bound:
            await host.publish()
    except asyncio.CancelledError:
        raise
    except TimeoutError as e:
        if not bound.expired():  # a timeout inside the store: a DHT failure like any other
            log.warning("could not publish our heartbeat now (%r); the heartbeat loop tries again", e)
        else:
            log.warning("our heartbeat was not stored within %.0f s; the last one stored expires instead", timeout)
    except Exception as e:  # noqa: BLE001 - a failed store is retried by the heartbeat loop
        log.warning("could not publish our heartbeat now (%s); the heartbeat loop tries again", e)


async def unless_stopped(host: Host, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None when the host is stopped first (then it is cancelled): a Ctrl-C never waits on
    a state download's own deadlines (a chaos joiner spent 45 s of its 60 s after SIGINT in one)."""
    task = asyncio.ensure_future(work)
    try:
        return task.result() if await finish_or_stop(host, task, 0.0) else None
    except BaseException:  # we were cancelled (the host's task group): the download goes with us
        task.cancel()
        raise


async def first_of(timeout: float | None, *events: asyncio.Event) -> None:
    """Until one of ``events`` is set (or ``timeout`` seconds): a paused driver waits for resume or stop."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def finish_or_stop(host: Host, task: asyncio.Future, grace_s: float) -> bool:
    """Wait for ``task`` (a round's pending exchange). A stop (the first signal), before or while it runs, leaves
    it ``grace_s`` more and a second signal (``host.hurry``) none: a Ctrl-C never waits on an exchange's own
    deadlines. True when it finished (its result is ready); otherwise it is cancelled and False."""
    if not task.done():
        stopping = asyncio.ensure_future(host.stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
    if not task.done():
        hurry = asyncio.ensure_future(host.hurry.wait())
        try:
            await asyncio.wait({task, hurry}, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurry.cancel()
    if task.done():
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


def finite(x: float) -> float | None:
    """A loss for a heartbeat or an event: None unless it is a finite float."""
    return x if isinstance(x, float) and math.isfinite(x) else None
