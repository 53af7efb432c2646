"""Pause and resume of a pipeline stage replica (``locomm-peer pause`` / ``resume``), on the rules of the
data-parallel pause (``lifecycle.py``): a paused heartbeat takes the replica out of every route (its siblings take
its micro-batches) and out of its siblings' replica-sync rounds from its round on; it keeps serving its state.
A later stage first refuses new frames (NOT_READY, re-routed by their senders) and answers those it holds. The
last unpaused replica of a stage after 0 may not pause (every micro-batch would be lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from locomm.peer.control import Handler
from locomm.peer.presence import first_of, pause_controls, publish_quietly

if TYPE_CHECKING:
    from locomm.peer.pipeline.stage import Stage

log = logging.getLogger(__name__)


def stage_controls(st: Stage) -> dict[str, Handler]:
    """A stage replica's control handlers (``lifecycle.pause_controls``)."""

    def state() -> dict[str, Any]:
        return control_state(st)

    async def refused() -> str | None:
        st.refusal = None  # a new request: an earlier one's refusal is not its answer
        return await pause_refused(st)

    return pause_controls(st, state, refused)


def control_state(st: Stage) -> dict[str, Any]:
    return {
        "paused": st.paused,
        "phase": st.phase,
        "stage": st.stage,
        "round": st.round,
        "step": st.worker.step,
    }


async def last_unpaused(st: Stage) -> bool:
    """Whether no other live replica of our stage is unpaused (a fresh heartbeat read first, if it works)."""
    with contextlib.suppress(Exception):
        await st.host.read_beats()
    return not [p for p in st.svc.live_replicas(st.stage, suspects=True) if p != st.host.me]


def last_replica_refusal(st: Stage) -> str:
    return (
        f"this is the only replica of stage {st.stage} that is not paused: pausing it would stop the "
        "pipeline (no other replica takes its micro-batches); wait until another one serves this stage"
    )


async def pause_refused(st: Stage) -> str | None:
    """Why this replica may not pause now (None: it may). A later stage's last unpaused replica may not: every
    micro-batch would be lost until it resumed. Stage 0's may: the pipeline then idles, nothing is lost."""
    if st.finished or st.host.stop.is_set():
        return "the peer is leaving"
    if st.stage == 0 or st.paused:
        return None
    return last_replica_refusal(st) if await last_unpaused(st) else None


async def pause_stage(st: Stage) -> None:
    """Paused at a step boundary (stage 0) or once the frames it is serving are answered (later stages; new
    ones are refused with NOT_READY meanwhile, and re-routed by their senders): the pending replica sync is
    finished, a heartbeat marked ``paused`` takes us out of every route and out of the sync rounds from this
    round on (``members_for_round``); the state server keeps serving our state. On resume, the stage's state
    is downloaded when its other replicas moved to a later round, and the paused mark stays up until then,
    so nobody routes to us or plans us before we can serve. A later stage paused when stage 0 ends, ends.

    The last-replica rule is checked again just before the paused heartbeat (a sibling may have paused while
    we drained): then the pause is called off and ``pause`` answers why. Two siblings that both pass that
    check within one heartbeat read can still both pause; their stage then loses micro-batches until one
    resumes."""
    host, svc = st.host, st.svc
    svc.paused = True
    await svc.drained()
    async with st._sync_lock:
        if st.pending is not None:
            await st._settle()
    refusal = None
    if st.stage > 0 and not host.stop.is_set() and await last_unpaused(st):
        refusal = last_replica_refusal(st)
    if refusal is not None or not st.pause_wanted.is_set() or st.resume_wanted.is_set():
        # Called off: refused now, or resumed while we drained (nothing was published: nobody left us out).
        svc.paused = False
        st.pause_wanted.clear()
        st.resume_wanted.clear()
        if refusal is not None:
            st.refusal = refusal
            host.events.write("pause_refused", stage=st.stage, why=refusal)
            log.warning("pause called off: %s", refusal)
        st.paused_now.set()  # wakes the pause request: it answers with the refusal, or that we train
        st.paused_now.clear()
        return
    await host.compute(st._snapshot, st.round)
    st.paused, st.phase = True, "paused"
    await publish_quietly(host)
    st.paused_now.set()
    host.events.write("paused", stage=st.stage, round=st.round, step=st.worker.step)
    log.info("stage %d paused at round %d (locomm-peer resume to go on)", st.stage, st.round)
    t0 = time.monotonic()
    while not (host.stop.is_set() or st.resume_wanted.is_set()):
        await first_of(1.0, host.stop, st.resume_wanted)
        if st.stage > 0 and await run_over(st):
            log.info("stage 0 has finished while we were paused: the run is over")
            return  # _serve_until_done ends the run; we stay paused
    st.paused_now.clear()
    st.resume_wanted.clear()
    st.pause_wanted.clear()
    if host.stop.is_set():  # leaving while paused
        return
    paused_at = st.round
    try:
        await st._join_stage(back_from_pause=True)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the DHT or a donor failed us: a resumed replica goes on from its own
        log.warning("could not sync stage %d on resume (%s); going on from our own state", st.stage, e)
    if host.stop.is_set():
        return
    st._last_round_t = 0.0  # the paused time is no round's length (the siblings' sync deadline)
    await host.compute(st._snapshot, st.round)
    svc.paused = st.paused = False
    st.phase = "training"
    await publish_quietly(host)
    host.events.write("resumed", stage=st.stage, round=st.round, paused_at=paused_at, paused_s=time.monotonic() - t0)
    log.info("stage %d resumed at round %d (paused at %d)", st.stage, st.round, paused_at)


async def run_over(st: Stage) -> bool:
    """A later stage's end: every stage-0 replica we saw has finished, or is paused while another finished (a
    paused driver that comes back after the run finds no stage to send to). One fresh heartbeat read first."""
    with contextlib.suppress(Exception):
        await st.host.read_beats()
    drivers = [b for b in st.host.beats.values() if b.stage == 0]
    st._seen_driver = st._seen_driver or bool(drivers)
    if not st._seen_driver:
        return False
    return not drivers or (all(b.finished or b.paused for b in drivers) and any(b.finished for b in drivers))
