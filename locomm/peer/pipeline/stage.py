"""The stage driver: a peer that serves one pipeline stage, composed on the :class:`~locomm.peer.host.Host`.

Lifecycle of ``Stage.run()``:
1. the host is up (P2P, DHT node, the settled run spec, the RPC server, metrics);
2. the stage: ``--stage K``, or ``auto``: the stage with the fewest live replicas in the heartbeats,
   ties to the lowest (:func:`locomm.protocol.membership.pick_stage`); a joiner of a running stage
   downloads that stage's weights and outer state from its live replicas; with ``--checkpoint-dir`` a
   replica resumes its own stage's checkpoint and downloads only a newer state (``peer/pipeline/checkpoint.py``);
3. services: ``stage`` (:class:`locomm.peer.pipeline.service.StageService`: handlers ``fwd`` and
   ``eval``, policy ``announced``), ``gossip`` for replica sync, ``state`` for joiners of this stage;
4. stage 0 drives training: each optimizer step draws a batch from its own data shard, splits it
   into micro-batches and keeps ``pipeline.in_flight`` of them in the pipeline at once; later stages
   serve whatever reaches them until every stage-0 replica has finished.

Every ``outer.inner_steps`` optimizer steps by the data clock, the replicas of a stage run the outer
algorithm over ``gossip`` on that stage's parameters only, overlapped with training and applied one
round late (``protocol/rounds.py``), as the data-parallel driver does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from locomm.checkpoint import save_tensors_atomic
from locomm.compression.boundary import BoundaryCoder
from locomm.compression.payload import PayloadCodec
from locomm.config import ConfigError, RunSpec
from locomm.model.stages import Geometry
from locomm.peer.host import Host
from locomm.peer.options import NodeOptions
from locomm.peer.pipeline.checkpoint import StageCheckpoints
from locomm.peer.pipeline.service import Lost, StageService
from locomm.peer.presence import Presence, finish_or_stop, finite, first_of
from locomm.peer.transport.state_sync import (
    Snapshot,
    StateServer,
    expected_layout,
    load_state,
    state_tensors,
)
from locomm.protocol import build_outer
from locomm.protocol import rounds as schedule
from locomm.protocol.membership import (
    DONOR_MIN_AGE_ROUNDS,
    Heartbeat,
    live,
    members_for_round,
    pick_stage,
    robust_top,
    state_donors,
)
from locomm.protocol.timing import sibling_wait_s
from locomm.train.stage import StageWorker, eval_mid

log = logging.getLogger(__name__)


class Stage:
    """One stage replica of a pipeline run."""

    def __init__(self, spec: RunSpec, opts: NodeOptions, stage: int | str = "auto") -> None:
        self.spec, self.opts, self.stage_arg = spec, opts, stage
        self.host: Host
        self.stage = -1
        self.round = 0
        self.round_s = 0.0
        self._last_round_t = 0.0
        self._rounds_due = 0
        """Rounds whose sync has been started (a round starts once)."""
        self.exchange: asyncio.Task | None = None
        """The pending round's exchange (its plan is ``self.rounds.pending``), applied one round late."""
        self._sync_lock = asyncio.Lock()
        self._mb_seq = 0
        self.members = self.partners = self.last_answered = 0
        self.last_loss = self.val_loss = float("nan")
        self.tokens_per_s = 0.0
        self.phase = "training"
        self._seen_driver = False
        self.t_train = time.perf_counter()
        self.summary: dict[str, Any] = {}
        self.ckpts = StageCheckpoints(opts.checkpoint_dir, opts.checkpoint_every)

    @staticmethod
    def schedule(algo: Any, spec: RunSpec) -> schedule.Rounds:
        """A replica's round schedule: the spec's (its defence included), applied at the next sync by the data
        clock; ``sim/pipeline.py`` builds the same (``tests/unit/test_pipeline.py`` holds them together)."""
        return schedule.Rounds.of_spec(algo, spec, pipeline=True)

    def params(self) -> dict[str, torch.Tensor]:
        return self.worker.params()

    def heartbeat(self) -> Heartbeat:
        """Published once the services exist (the host calls it from then on)."""
        svc = self.svc
        clock = svc.data_clock()
        return self.presence.beat(
            stage=self.stage,
            round=clock // self.spec.outer.inner_steps,
            clock=clock,
            step=self.worker.step,
            loss=self.last_loss,
            val_loss=self.val_loss,
            mb_per_s=svc.mb_per_s(),
            microbatches=svc.microbatches,
            rerouted=svc.rerouted,
            lost=svc.lost,
            tokens_per_s=self.tokens_per_s,
            bytes_sent=self.gossip.stats.bytes_sent + svc.boundary_bytes["fwd"] + svc.boundary_bytes["bwd"],
        )

    def _summary(self, initial: float, final: float) -> dict[str, Any]:
        """A stage replica's summary at exit (its ``finished`` event and ``--json`` line)."""
        t_end = time.time()
        svc = self.svc
        log_ = list(svc.stage_log)
        t0 = log_[0][0] if log_ else t_end
        tokens = svc.boundary_bytes
        return self.presence.summary(
            self.gossip,
            rounds=self.round,
            steps=self.worker.step,
            initial=initial,
            final=final,
            t0=self.t_train,
            stage=self.stage,
            microbatches=svc.microbatches,
            microbatches_lost=svc.lost,
            microbatches_rerouted=svc.rerouted,
            bytes_fwd=tokens["fwd"],
            bytes_tokens=tokens["tokens"],
            bytes_bwd=tokens["bwd"],
            tokens_served=svc.microbatches * self.spec.pipeline.micro_batch_size * self.spec.data.seq_len,
            tokens_forwarded=svc.tokens_forwarded,
            compute_intervals=[(round(a, 4), round(b, 4), k) for a, b, k in log_ if k != "eval"],
            busy_s=sum(b - a for a, b, k in log_ if k != "eval"),
            span_s=t_end - t0,
            last_loss=finite(self.last_loss),
        )

    # -- the presence's hooks (peer/presence.py) ------------------------------------------
    # Stage 0 pauses at a step boundary; a later stage first refuses new frames (NOT_READY: their senders re-route
    # them) and answers those it holds. Paused, the replica is in no route and in no sibling's sync round. The last
    # unpaused replica of a later stage may not pause (every micro-batch would be lost until it resumed). Two
    # siblings that both pass that check within one heartbeat read can still both pause; their stage then loses
    # micro-batches until one resumes.

    @property
    def step(self) -> int:
        return self.worker.step

    def describe(self) -> dict[str, Any]:
        return {"stage": self.stage}

    async def may_pause(self) -> str | None:
        if self.stage == 0 or self.presence.paused:  # stage 0's pause idles the pipeline: nothing is lost
            return None
        with contextlib.suppress(Exception):  # a fresh heartbeat read first, if it works
            await self.host.read_beats()
        if [p for p in self.svc.live_replicas(self.stage, suspects=True) if p != self.host.me]:
            return None
        return (
            f"this is the only replica of stage {self.stage} that is not paused: pausing it would stop the "
            "pipeline (no other replica takes its micro-batches); wait until another one serves this stage"
        )

    async def drain(self) -> None:
        self.svc.paused = True  # new frames are refused with NOT_READY from here on
        await self.svc.drained()
        async with self._sync_lock:
            if self.rounds.pending is not None:
                await self._settle()

    def undrain(self) -> None:
        self.svc.paused = False

    def snapshot(self, round_idx: int) -> None:
        self._snapshot(round_idx)

    async def resync(self) -> None:
        await self._join_stage(back_from_pause=True)
        self._last_round_t = 0.0  # the paused time is no round's length (the siblings' sync deadline)

    async def run_over(self) -> bool:
        """A later stage's end: every stage-0 replica we saw has finished, or is paused while another finished (a
        paused driver that comes back after the run finds no stage to send to). One fresh heartbeat read first."""
        if self.stage == 0:
            return False
        with contextlib.suppress(Exception):
            await self.host.read_beats()
        drivers = [b for b in self.host.beats.values() if b.stage == 0]
        self._seen_driver = self._seen_driver or bool(drivers)
        if not self._seen_driver:
            return False
        return not drivers or (all(b.finished or b.paused for b in drivers) and any(b.finished for b in drivers))

    # -- start-up ------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        async with Host(self.spec, self.opts) as host:
            self.host, self.spec = host, host.spec
            return await self._run(host)

    def _build(self, shard: tuple[int, int]) -> None:
        from locomm.data import BatchSampler, eval_batches, load_corpus  # noqa: PLC0415

        spec = self.spec
        self.geo = Geometry.of(spec)
        self.coder = BoundaryCoder(spec, self.geo)
        device, plan = self.host.device_and_plan()
        self.worker = StageWorker(spec, self.stage, geo=self.geo, device=device, plan=plan)
        self.algo = build_outer(spec.outer, self.params(), self.host.me)
        self.rounds = self.schedule(self.algo, spec)
        self.codec = PayloadCodec(
            {k: tuple(v.shape) for k, v in self.params().items()},
            self.algo.payload_roles,
            spec.compression,
            encoded=self.algo.payload_encoded,
        )
        if self.stage == 0:
            splits = load_corpus(spec.data)
            self.sampler = BatchSampler(
                splits, spec.data, spec.train.seed, shard[0], shard[1], stream=self.host.stream_key()
            )
            self._val = eval_batches(splits.val, spec.data, spec.train.eval_batches)
        # Warm the codecs up here (numba compiles on first use), not inside a hop's deadline.
        h = torch.zeros(1, 2, self.geo.d)
        tok = torch.zeros(1, 2, dtype=torch.long)
        self.coder.decode_activation(self.coder.encode_activation(h, tok), tok)
        self.coder.decode_gradient(self.coder.encode_gradient(h, tok), tok)
        self.codec.warm_up()

    async def _run(self, host: Host) -> dict[str, Any]:
        spec = self.spec
        if spec.pipeline.stages < 2:
            raise ConfigError("pipeline.stages: this swarm's run spec has no pipeline (stages < 2)")
        if spec.outer.algo == "diloco":
            raise ConfigError("outer.algo: pipeline replicas sync with noloco, gasloc or sparseloco")
        beats = await host.read_beats()
        stage_arg = await host.compute(self.ckpts.open, spec, self.stage_arg, host.events)  # its stage, if resumed
        if stage_arg == "auto":
            # A replica that died a moment ago still has a record: count only fresh heartbeats.
            fresh = 3 * spec.network.heartbeat_interval_s
            self.stage = pick_stage(beats, spec.pipeline.stages, host.me, fresh_s=fresh, now=host.dht_now())
        else:
            self.stage = int(stage_arg)
            if not 0 <= self.stage < spec.pipeline.stages:
                raise ConfigError(f"--stage: {self.stage} is not in [0, {spec.pipeline.stages})")
        self.presence = Presence(host, self)
        await host.compute(self._build, host.default_shard())
        self.svc = StageService(host, self.worker, self.coder, self._after_backward)
        clock = await host.compute(self.ckpts.attach, self.worker, self.algo, getattr(self, "sampler", None))
        if clock is not None:  # resumed: our clocks are the checkpoint's
            self.svc.clock = clock if self.stage > 0 else 0
            self.round = self._rounds_due = self.svc.data_clock() // spec.outer.inner_steps
        self.gossip = host.gossip(self.codec)
        self.gossip.admit = self._admit_sync  # replica-sync pushes only from replicas of this stage
        self.presence.wire(self.gossip)
        self.state_server = StateServer(host.run_id)
        await host.serve(self.svc.service(), self.gossip.service(), self.state_server.service())
        host.heartbeat = self.heartbeat
        await host.publish()
        await self.presence.start_control(lambda: {"stage": self.stage, "step": self.worker.step})
        if self.opts.initial_peers:
            await self._join_stage()
        await host.compute(self._snapshot, self.round)
        host.up(stage=self.stage, first_heartbeat_s=time.perf_counter() - host.t_launch, resumed=self.ckpts.resumed)
        log.info("peer %s serves stage %d of %d", host.me, self.stage, spec.pipeline.stages)
        if (n := self.opts.wait_for_peers) > 1:
            await host.wait_for(lambda beats: self._all_staged(beats, n), 90.0, f"{n} peers on every stage")
        self.presence.started = True
        self.t_train = time.perf_counter()
        await host.publish()
        initial = final = float("nan")
        if self.stage == 0:
            initial = await self._evaluate()
            await self._train_stage0()
            await self._settle_last(grace_s=spec.network.stall_timeout_s)
            final = await self._evaluate()
        else:
            await self._serve_until_done()
            await self._settle_last(grace_s=5.0)  # a sibling that took fewer micro-batches may never get here
        # No hand-over: a sibling missing our last payload goes on without it at its deadline.
        await self.presence.leave(self.gossip, self.round - 1, 0.0, 0.0, spec.network.heartbeat_ttl_s)
        await self.ckpts.write(host.compute, self.svc.data_clock(), final=True)
        if self.opts.final_weights and not host.stop.is_set():
            weights = {k: v.detach().contiguous() for k, v in self.params().items()}
            await host.compute(save_tensors_atomic, self.opts.final_weights, weights)
        self.summary = self._summary(initial, final)
        host.events.write("finished", **self.summary)
        return self.summary

    async def _join_stage(self, *, back_from_pause: bool = False) -> None:
        """A joiner of a stage that has trained: download the stage's weights and outer state from its replicas
        (paused ones are no donors); resumed from a checkpoint, only when they are a round or more ahead of it.
        Back from a pause, whenever they are in a later round than ours (they ran the rounds between without us):
        then we take their clock and round even if no download succeeds, keeping our own weights."""
        host, H = self.host, self.spec.outer.inner_steps
        trained = self._siblings(await host.read_beats())
        clock, clocks = self.svc.data_clock(), [_clock(b) for b in trained]
        if back_from_pause:
            wanted = bool(trained) and robust_top(clocks, slack=H) // H > clock // H
        else:
            wanted = bool(trained) and self.ckpts.should_sync(trained, H, clock)
        if not wanted:
            return  # nobody has trained yet, or our own state is as new as theirs

        def donors(beats: list[Heartbeat], groups: Mapping[str, str], ages: Mapping[str, int]) -> list[str]:
            sib = self._siblings(beats)
            top = robust_top((_clock(b) for b in sib), slack=H)
            young = top // H - DONOR_MIN_AGE_ROUNDS  # ``since`` is in heartbeat rounds: data clock // H
            return state_donors(
                sib, top, _clock, slack=H, prefer=host.trusted, groups=groups, since=ages, young_after=young
            )

        expected = expected_layout(state_tensors(self.params(), self.algo))
        got = await self.presence.download(donors, expected, self._load_state, stage=self.stage)
        if got is None and (host.stop.is_set() or not back_from_pause):
            return  # a joiner goes on from the initial weights; stopped mid-sync, we leave as we were
        # The step (and data clock) most siblings reached: one claiming step 10^9 cannot send us there.
        step = robust_top((b.step for b in trained), slack=H)
        self.worker.step = step
        if self.stage > 0:  # the siblings' data clock: our rounds start at the round they are in
            self.svc.clock = robust_top(clocks, slack=H)
        self.round = self._rounds_due = self.svc.data_clock() // H

    def _siblings(self, beats: list[Heartbeat]) -> list[Heartbeat]:
        """Other live replicas of our stage that have trained (paused and leaving ones are no donors)."""
        me = self.host.me
        return [
            b for b in beats if b.peer != me and b.stage == self.stage and not (b.finished or b.paused) and b.step > 0
        ]

    def _all_staged(self, beats: list[Heartbeat], n: int) -> bool:
        """``n`` peers, self included, announce a stage, and every stage has one."""
        staged = [b for b in beats if b.stage is not None]
        return len(staged) >= n and {b.stage for b in staged} >= set(range(self.spec.pipeline.stages))

    async def _serve_until_done(self) -> None:
        """Stages after 0 serve until the run is over (:meth:`run_over`) or we are stopped."""
        presence = self.presence
        while not self.host.stop.is_set():
            await first_of(1.0, self.host.stop, presence.pause_wanted)
            if self.host.stop.is_set() or await self.run_over():
                return
            if presence.pause_wanted.is_set():
                await presence.pause()

    # -- state ---------------------------------------------------------------------------

    def _snapshot(self, round_idx: int) -> None:
        # A joiner of this stage downloads the live weights (not only the last outer point) and the outer state.
        self.state_server.snapshot = Snapshot.take(round_idx, state_tensors(self.params(), self.algo))

    def _load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_state(tensors, self.params(), self.algo)
        # Gradients taken at the old weights (a later stage paused mid-step). Without a download the partial
        # accumulation stays, as it does across every round's outer update.
        self.worker.drop_accumulated()

    # -- stage 0: the training loop ------------------------------------------------------

    async def _micro_batch(self, window: torch.Tensor, sem: asyncio.Semaphore) -> float | None:
        svc, w = self.svc, self.worker
        async with sem:
            mb = self._mb_seq
            self._mb_seq += 1
            svc.microbatches += 1
            svc.mb_times.append(time.time())
            out = await svc.timed("f", w.forward, mb, window[:, :-1], None)
            try:
                loss, g = await svc.send(self.host.me, mb, window, out, train=True)
            except Lost as e:
                await self.host.compute(w.drop, mb)
                svc.lost += 1
                self.host.events.write("lost", mb=mb, why=str(e))
                log.warning("micro-batch %d lost: %s", mb, e)
                return None
            await svc.timed("b", w.backward, mb, g)
            return loss

    async def _train_stage0(self) -> None:
        p, host, svc = self.spec.pipeline, self.host, self.svc
        mbs = p.micro_batch_size
        sem = asyncio.Semaphore(p.in_flight)
        t_start = time.perf_counter()
        while self.worker.step < self.spec.train.steps and not host.stop.is_set():
            x, y = await host.compute(self.sampler.next)
            window = torch.cat([x, y[:, -1:]], dim=1)
            t0 = time.perf_counter()
            parts = [window[i : i + mbs] for i in range(0, window.shape[0], mbs)]
            losses = await asyncio.gather(*(self._micro_batch(part, sem) for part in parts))
            done = [v for v in losses if v is not None]
            if self.worker.accumulated:
                await svc.timed("step", self.worker.apply_step)
            else:  # every micro-batch of this batch was lost: the step is skipped, the schedule goes on
                self.worker.step += 1
            if done:
                self.last_loss = sum(done) / len(done)
            dt = time.perf_counter() - t0
            self.tokens_per_s = len(done) * mbs * self.spec.data.seq_len / dt if dt > 0 else 0.0
            host.events.write(
                "step",
                step=self.worker.step,
                loss=finite(self.last_loss),
                lost=svc.lost,
                rerouted=svc.rerouted,
                wall_s=time.perf_counter() - t_start,
                tokens_per_s=self.tokens_per_s,
            )
            r = self._due_round()
            if r is not None:
                await self._sync(r)
                every = self.opts.eval_every
                if every and self.round % every == 0 and self.worker.step < self.spec.train.steps:
                    await self._evaluate()
            if self.presence.pause_wanted.is_set() and self.worker.step < self.spec.train.steps:
                await self.presence.pause()

    async def _evaluate(self) -> float:
        self.val_loss = await self.evaluate()
        self.host.events.write("eval", step=self.worker.step, round=self.round, val_loss=self.val_loss)
        return self.val_loss

    async def evaluate(self) -> float:
        """Validation loss through the pipeline (stage 0 only): forward-only micro-batches."""
        total, n = 0.0, 0
        mbs = self.spec.pipeline.micro_batch_size
        for x, y in self._val:
            for i in range(0, x.shape[0], mbs):
                window = torch.cat([x[i : i + mbs], y[i : i + mbs, -1:]], dim=1)
                h = await self.svc.timed("eval", eval_mid, self.worker, window[:, :-1], None)
                mb = self._mb_seq
                self._mb_seq += 1
                try:
                    loss, _ = await self.svc.send(self.host.me, mb, window, h, train=False)
                except Lost as e:
                    log.warning("evaluation micro-batch lost: %s", e)
                    continue
                total += loss
                n += 1
        return total / n if n else float("nan")

    # -- replica sync --------------------------------------------------------------------

    def _due_round(self) -> int | None:
        """The replica sync round that has just ended by the data clock, once; None when none has."""
        done = self.svc.data_clock() // self.spec.outer.inner_steps
        if done <= self._rounds_due:
            return None
        self._rounds_due = done
        return done - 1

    async def _after_backward(self) -> None:
        await self.host.compute(self.worker.maybe_step)
        await self.svc.notify()
        r = self._due_round()
        if r is not None:
            # Before this micro-batch is answered: the next one reaches us only after the round's apply and
            # plan, so which steps they see is set by the data clock, not by timing (the simulator's order).
            # Only the exchange itself runs in the background.
            await self._sync(r)

    async def _sync(self, r: int) -> None:
        """Replica sync of round ``r`` (by the data clock): apply round r - 1's exchange, start round r's."""
        host = self.host
        now = time.monotonic()
        self.round_s = now - self._last_round_t if self._last_round_t else 0.0
        self._last_round_t = now
        await host.compute(self._snapshot, r + 1)
        async with self._sync_lock:
            if self.rounds.pending is not None:  # apply the previous round's exchange, one round late
                await self._settle()
            self.gossip.advance(r)
            # Replicas of this stage with a fresh heartbeat (as the heartbeat loop last read them: no DHT
            # round trip between the trigger and the plan): a sibling that died drops out within seconds, so
            # nobody waits out max_wait_s for its payload.
            net = self.spec.network
            beats = live(host.beats.values(), host.dht_now(), 3 * net.heartbeat_interval_s, stage=self.stage)
            members = members_for_round(
                beats, r, host.me, fresh_s=net.heartbeat_ttl_s, now=host.dht_now(), since=host.since()
            )
            planned = await host.compute(self.rounds.start, r, members, self.params())
            self.members, self.partners = len(members), len(planned.exchange.peers)
            host.events.write("replica_sync", stage=self.stage, round=r, member_ids=members, partners=self.partners)
            t_due = time.monotonic() + sibling_wait_s(self.round_s, host.limits)
            self.exchange = host.spawn(
                self.gossip.exchange(r, list(planned.exchange.peers), planned.exchange.payload, eta=lambda _p: t_due)
            )
            self.round = r + 1
        host.publish_soon()
        if self.ckpts.due(self.round):
            await self.ckpts.write(host.compute, self.svc.data_clock())

    async def _admit_sync(self, remote: str, round_idx: int) -> bool:
        """A replica-sync push is taken only from an admitted replica of this stage (one fresh, shared read first)."""

        def sibling() -> bool:
            b = self.host.beats.get(remote)
            return b is not None and b.stage == self.stage and b.admitted

        return await self.host.recheck(sibling)

    async def _settle_last(self, grace_s: float) -> None:
        if self.rounds.pending is not None:
            async with self._sync_lock:
                await self._settle(grace_s=grace_s)

    async def _settle(self, grace_s: float | None = None) -> None:
        """Apply the pending outer round; with ``grace_s`` (at the end of the run) give up on it after that."""
        planned, task = self.rounds.pending, self.exchange
        if planned is None or task is None:  # settled meanwhile by another round's sync
            return
        self.exchange = None
        if grace_s is not None:
            await asyncio.wait({task}, timeout=grace_s)
            finished = task.done()
            if not finished:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        else:  # a stop, before or meanwhile, ends it at once (finish_or_stop cancels it)
            finished = await finish_or_stop(self.host, task, 0.0)
        if not finished:
            self.rounds.drop()
            return
        got = task.result()
        self.last_answered = len(got)
        await self.svc.quiesced(self._apply, planned.received(self.host.me, got))

    def _apply(self, received: dict[str, Any]) -> None:
        """The pending round's outer update, one round late, keeping local progress (``protocol/rounds.py``)."""
        r = self.rounds.settle(self.params(), received)
        self.host.note_screening(r, self.rounds.outcome)
        self._snapshot(r if r is not None else self.round)
        self.worker.module.project_()


def _clock(b: Heartbeat) -> int:
    """A stage replica's progress: its data clock (its step, from a heartbeat without one)."""
    return b.clock or b.step
