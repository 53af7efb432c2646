"""How a data-parallel node enters a running swarm, how it leaves one, and how its volunteer pauses it.

Entering (:func:`enter_swarm`): pick the round to join at, a little ahead of the swarm's (two thirds of the
admitted peers reached it: one peer claiming round 10^9 cannot send us there), and download the state from
up to ``DONORS`` live peers near that round unless we resumed our own checkpoint (``peer/transport/state_sync.py``: what
most of them agree on wins).

Leaving (:func:`leave_swarm`), at the last round, on Ctrl-C/SIGTERM/SIGHUP: the pending exchange has been
finished (``Node._finish``); then, for a bounded time, we keep serving our last payload until every partner of
that round has it (a push answered OK, or a pull) or has left itself (or, past a round, is not on its way
to that round any more); then we publish a final heartbeat
marked ``finished``. Partners that read it skip us without waiting for a deadline (``Gossip.gone``), and
nobody counts us as a member from our last round on (``membership.members_for_round``). A second signal
(``Host.hurry``) stops the hand-over at once.

Pausing (:func:`pause_here`, asked for through the control socket): at the next step boundary the pending
exchange is finished and a heartbeat marked ``paused`` says nobody should wait for us from this round on (the
members rule treats it as a goodbye); the node keeps serving its state and last payload. Resuming enters the
swarm again as a joiner: partners never block on a paused peer, and the resumed one never trains on stale
weights when the swarm moved on. A pipeline stage replica pauses by the same rules (``stage_pause.py``), and
besides leaves every route: its siblings take its micro-batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from locomm.peer.control import ControlError, ControlServer, Handler, control_path
from locomm.peer.transport.state_sync import StateMismatch, expected_layout, state_tensors
from locomm.protocol.membership import swarm_round

if TYPE_CHECKING:
    from locomm.peer.dataparallel.node import Node
    from locomm.peer.host import Host
    from locomm.peer.pipeline.stage import Stage

__all__ = [
    "DONORS",
    "device_and_plan",
    "JOIN_MARGIN_ROUNDS",
    "STATE_ATTEMPTS",
    "enter_swarm",
    "first_of",
    "leave_swarm",
    "partner_gone",
    "pause_here",
    "pause_controls",
    "publish_quietly",
    "start_control",
]

log = logging.getLogger(__name__)
JOIN_MARGIN_ROUNDS = 2
STATE_ATTEMPTS = 5
"""Whole state downloads a joiner tries (2, 4, 8, 8 s apart) before it starts from the initial weights."""
DONORS = 5
"""Peers a joiner asks for their state (the state most of them agree on wins; see peer/transport/state_sync.py)."""
PAUSE_ANSWER_S = 20.0
"""How long ``pause`` waits for the peer to reach a step boundary before it answers with the phase."""
STOP_HANDOVER_S = 10.0
"""After Ctrl-C, how long a leaving peer serves its last payload to partners that have not had it yet."""


async def enter_swarm(node: Node, resumed: bool | None) -> None:
    """Pick the round to join at; download state from live peers unless we resumed our own. ``resumed=None``
    (back from a pause): our own state is current unless the swarm moved past our round."""
    host = node.host
    beats = [b for b in await host.read_beats() if b.peer != host.me]
    top = swarm_round(beats)
    if resumed is None:
        resumed = top <= node.round
    if all(not b.started for b in beats) and (top == 0 or (resumed and top == node.round)):
        # Nobody has trained yet (a new swarm, or a stopped one restarting from checkpoints of one round): start
        # together.
        node.join_round = node.round
        return
    # Join a little ahead of the swarm, so every peer counts us from the same round on: peers
    # that computed a round's membership before our heartbeat reached them never expect us in it.
    node.join_round = max(top + JOIN_MARGIN_ROUNDS, node.round)
    await host.publish()
    if not resumed and top > 0:
        donors = _donors(beats, top)
        expected = expected_layout(state_tensors(node.algo.phi, node.algo))  # what Node._snapshot serves
        node.phase = "syncing"
        got = None
        for attempt in range(STATE_ATTEMPTS):
            got = await host.fetch_state(donors, expected)
            if got is not None or host.stop.is_set():
                break
            # The state moved on while we fetched, a donor has not read our heartbeat yet (UNAUTHORIZED), or it
            # left or restarted elsewhere: wait a little, then ask the donors a fresh read names.
            log.info("state download %d/%d failed; asking again", attempt + 1, STATE_ATTEMPTS)
            await host.sleep(min(2 << attempt, 8))
            beats = [b for b in await host.read_beats() if b.peer != host.me]
            donors = _donors(beats, top := swarm_round(beats))
        if got is not None:
            try:
                await host.compute(node.load_state, got.tensors)
            except StateMismatch as e:  # fetch_state checked the layout already: a bug here, not a crash
                log.warning("the downloaded state does not fit this model: %s", e)
                got = None
        if got is None:
            log.warning("could not download state from %d donors; starting from the initial weights", len(donors))
            host.events.write("sync_failed", donors=len(donors))
        else:
            info = dict(donor_round=got.round, tensors=len(got.tensors), rule=got.rule, faulted=len(got.faulted))
            host.events.write("synced", donors=len(got.donors), **info)
            log.info("synced state of round %d from %d donor(s) by %s", got.round, len(got.donors), got.rule)
        if host.stop.is_set():  # stopping mid-sync: our round and weights stay what they were
            return
        # The swarm moved on while we synced: join ahead of where it is now, not where it was (a peer that starts
        # rounds behind the others trains alone and never catches up). A peer that read our first join_round
        # may plan us into a round or two before the new one; it skips us at that round's deadline.
        now_top = swarm_round([b for b in await host.read_beats() if b.peer != host.me])
        if now_top + JOIN_MARGIN_ROUNDS > node.join_round:
            node.join_round = now_top + JOIN_MARGIN_ROUNDS
            await host.publish()
    node.round = node.join_round
    node.trainer.step = node.round * node.spec.outer.inner_steps
    await host.settle_view()


def _donors(beats: list, top: int) -> list[str]:
    """Admitted peers at the swarm's round (not those claiming to be far past it, nor those leaving), newest
    first."""
    near = [b for b in beats if b.admitted and b.started and not (b.finished or b.paused) and b.round <= top + 1]
    near = [b for b in near if not (b.island and not b.island_rep)]  # an island follower serves no fresh state
    return [b.peer for b in sorted(near, key=lambda b: -b.round)[:DONORS]]


def partner_gone(node: Node | Stage, peer: str, round_idx: int) -> bool:
    """``Gossip.gone``: whether ``peer`` left or was paused before ``round_idx`` (its final or paused heartbeat,
    as last read). While we wait on a partner, the heartbeats are read again about once a second, so a goodbye is
    seen soon."""
    b = node.host.beats.get(peer)
    if b is not None and (b.finished or b.paused) and b.round <= round_idx:
        return True
    node.host.refresh_soon()
    return False


async def leave_swarm(node: Node, handover_s: float, max_s: float) -> None:
    """Serve our last round's payload until its partners have it (or left, or a second signal), then publish
    the final heartbeat that says we left.

    Past ``handover_s`` we wait only for partners still on their way to that round (a fresh heartbeat at most
    a round past it: a loaded partner may be seconds behind), and never past ``max_s``; after Ctrl-C at most
    STOP_HANDOVER_S."""
    host, last = node.host, node.round - 1
    stopping = host.stop.is_set()
    t0 = time.monotonic()
    ttl = node.spec.network.heartbeat_ttl_s

    def coming(peer: str) -> bool:
        b = host.beats.get(peer)
        return b is not None and not b.finished and b.round <= last + 1 and host.dht_now() - b.time < ttl

    waiting: set[str] = set()
    while not host.hurry.is_set():
        waiting = {p for p in node.gossip.undelivered(last) if not partner_gone(node, p, last + 1)}
        waiting -= node.gossip.banned
        waited = time.monotonic() - t0
        if stopping:
            over = waited > min(handover_s, STOP_HANDOVER_S)
        else:
            over = waited > max_s or (waited > handover_s and not any(coming(p) for p in waiting))
        if not waiting or over:
            break
        node.phase = "handing over"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(host.hurry.wait(), 0.25)
    node.left = True
    node.phase = "left"
    await host.publish()
    handover = time.monotonic() - t0
    host.events.write("left", round=node.round, handover_s=handover, undelivered=sorted(waiting))
    if waiting:
        log.info("left after %.1f s; %d partner(s) never took our last payload", handover, len(waiting))


# -- pause and resume (``locomm-peer pause`` / ``resume``, through ``peer/control.py``) -------------------


async def start_control(host: Host, handlers: Mapping[str, Handler]) -> None:
    """Serve the control socket in the checkpoint folder (none without one, or with ``opts.control`` off)."""
    if not host.opts.control or host.opts.checkpoint_dir is None:
        return
    server = ControlServer(control_path(host.opts.checkpoint_dir), handlers)
    await server.start()
    host.spawn(server.serve())


async def publish_quietly(host: Host) -> None:
    """``host.publish()``, a DHT failure logged rather than raised (the heartbeat loop publishes again soon)."""
    try:
        await host.publish()
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a failed store is retried by the heartbeat loop
        log.warning("could not publish our heartbeat now (%s); the heartbeat loop tries again", e)


class Pausable(Protocol):
    """What the control handlers drive: a data-parallel node or a pipeline stage."""

    paused: bool
    pause_wanted: asyncio.Event
    resume_wanted: asyncio.Event
    paused_now: asyncio.Event


def pause_controls(
    driver: Pausable, state: Callable[[], dict[str, Any]], refused: Callable[[], Awaitable[str | None]]
) -> dict[str, Handler]:
    """``pause`` (answered once the peer is paused, or after PAUSE_ANSWER_S with its phase; refused, saying why,
    when ``refused()`` gives a reason), ``resume``, ``status``."""

    async def pause() -> dict[str, Any]:
        if (why := await refused()) is not None:
            raise ControlError(why)
        driver.resume_wanted.clear()
        driver.pause_wanted.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(driver.paused_now.wait(), PAUSE_ANSWER_S)
        # A stage's pause may be called off after this first check (stage_pause.py): its ``refusal`` says why.
        if not driver.paused and (why := getattr(driver, "refusal", None)) is not None:
            raise ControlError(why)
        return state()

    async def resume() -> dict[str, Any]:
        driver.pause_wanted.clear()
        driver.resume_wanted.set()
        return state()

    async def status() -> dict[str, Any]:
        return state()

    return {"pause": pause, "resume": resume, "status": status}


def control_handlers(node: Node) -> dict[str, Handler]:
    """A data-parallel node's controls (:func:`pause_controls`)."""

    def state() -> dict[str, Any]:
        return {"paused": node.paused, "phase": node.phase, "round": node.round, "step": node.trainer.step}

    async def refused() -> str | None:
        if node.left:
            return "the peer is leaving"
        if node.island is not None:  # its island would drop it and resync it; not built or tested yet
            return "an island member cannot pause yet: stop it (Ctrl-C) and its island goes on"
        return None

    return pause_controls(node, state, refused)


async def pause_here(node: Node) -> None:
    """Paused at a step boundary of round ``node.round`` (its pending exchange finished): say so in a heartbeat,
    so nobody waits for us from this round on, keep serving state and our last payload, and wait for
    ``resume`` (or a stop). On resume, enter the swarm again as a joiner does: a new join round a little ahead of
    the swarm's, and the swarm's state when it moved past our round meanwhile (our own weights otherwise). The
    paused mark stays up until that is done, so nobody plans us before we can train."""
    host = node.host
    node.paused, node.phase = True, "paused"
    await publish_quietly(host)
    node.paused_now.set()
    host.events.write("paused", round=node.round, step=node.trainer.step)
    log.info("paused at round %d (locomm-peer resume to go on)", node.round)
    t0 = time.monotonic()
    await first_of(None, host.stop, node.resume_wanted)
    node.paused_now.clear()
    node.resume_wanted.clear()
    if host.stop.is_set():  # leaving while paused: leave_swarm's final heartbeat follows
        return
    paused_at = node.round
    # Still marked paused while it syncs: a partner that read our new join round before the download ended would
    # plan us into rounds we miss, and wait out their deadlines for us.
    while True:
        try:
            await enter_swarm(node, resumed=None)
            break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the DHT failed us mid-resume: still paused, try again
            log.warning("could not enter the swarm again (%s); still paused, trying again in 5 s", e)
            await host.sleep(5.0)
            if host.stop.is_set():
                break
    if host.stop.is_set():  # stopped while it synced: it leaves as it was, paused
        return
    await host.compute(node._snapshot, node.round)  # joiners get the state we train from now, not the paused one
    node.paused, node.phase = False, "training"
    await publish_quietly(host)
    host.events.write("resumed", round=node.round, paused_at=paused_at, paused_s=time.monotonic() - t0)
    log.info("resumed at round %d (paused at %d)", node.round, paused_at)


async def first_of(timeout: float | None, *events: asyncio.Event) -> None:
    """Until one of ``events`` is set (or ``timeout`` seconds): a paused driver waits for resume or stop."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def device_and_plan(host: Host) -> tuple[Any, Any]:
    """The device and the memory plan of ``--max-memory`` (``train/plan.py``), logged as a ``plan`` event. Call it in
    the compute thread before the model is on the device (the device's free memory is the default budget)."""
    from locomm.train import peer_plan, resolve_device  # noqa: PLC0415 - imports torch

    device = resolve_device(host.opts.device)
    plan = peer_plan(host.spec, device=device, max_memory_gb=host.opts.max_memory_gb)
    if plan is None:
        return device, None
    host.events.write("plan", **plan.as_json())
    log.info("memory plan:\n%s", plan.describe())
    return device, plan


def node_summary(node: Node, initial_val: float, final_val: float, first_heartbeat_s: float) -> dict[str, Any]:
    """What a data-parallel peer reports at exit (its ``finished`` event and ``--json`` line)."""
    g, h = node.gossip.stats, node.host
    counted = ("exchanges_ok", "exchanges_failed", "bytes_undelivered", "pushes_ok", "pushes_failed", "pulls")
    counted += ("gave_up", "gone_skipped", "gave_up_on")
    return {
        "peer": h.me,
        "rounds_completed": node.round,
        "initial_loss": initial_val,
        "final_loss": final_val,
        "bytes_sent": node.bytes_sent(),
        "bytes_received": node.bytes_received(),
        **{k: getattr(g, k) for k in counted},
        "unreachable": g.unreachable,
        "transfers_cut": h.rpc.stats.cut,
        "faults": h.faults.total,
        "banned": len(h.faults.banned),
        "banned_peers": sorted(h.faults.banned),
        "wait_s": node.wait_s,
        "wall_s": time.perf_counter() - node.t_train,
        "steps": node.trainer.step,
        "members": node.members,
        "first_heartbeat_s": first_heartbeat_s,
        "errors_answered": dict(h.rpc.stats.errors_answered),
        "interrupted": h.stop.is_set(),
        **({"island": node.island.summary()} if node.island is not None else {}),
    }
