"""A peer that serves one pipeline stage: the stage service on the RPC base, routing, and replica sync.

Lifecycle of ``PipelineNode.run()`` (the daemon's, with a stage instead of the whole model):
1. P2P and the DHT in this loop; the run spec settled as ``Node`` does;
2. the stage: ``--stage K``, or ``auto``: the stage with the fewest live replicas in
   the heartbeats (which carry ``stage``), ties to the lowest; a joiner of a running
   stage downloads that stage's weights and outer state from its live replicas;
3. services: ``locomm.{run}.stage`` (handlers ``fwd`` and ``eval``, policy
   ``announced``), ``gossip`` for replica sync, ``state`` for joiners of this stage;
4. stage 0 drives training: each optimizer step draws a batch from its own data
   shard, splits it into micro-batches and keeps ``pipeline.in_flight`` of them in
   the pipeline at once; later stages serve whatever reaches them.

A micro-batch is one chain of nested requests: stage k's ``fwd`` handler computes
its forward, sends z and the token window to a seeded-random live replica of stage
k+1 (:func:`locomm.protocol.routing.route`), and the answer carries dL/dz back along
the same path; the handler then runs its backward and answers its own caller with
its input's gradient. A failed hop (dead replica, timeout, refusal) is re-routed to
another replica, ``pipeline.reroute_attempts`` times; a micro-batch that still
fails is counted lost at stage 0 (its graph dropped, the step goes on with the
rest). Every ``outer.inner_steps`` optimizer steps the replicas of a stage run the
outer algorithm over ``gossip`` on that stage's parameters only (``protocol/``,
unchanged), overlapped with training and applied one round late as ``Node`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from typing import Any

import torch
from hivemind.utils import get_dht_time

from locomm import __version__
from locomm.compression.base import CodecError
from locomm.compression.boundary import BoundaryCoder, NonFinite
from locomm.compression.payload import PayloadCodec
from locomm.config import ConfigError, RunSpec
from locomm.model.stages import Geometry
from locomm.peer.gossip import Faults
from locomm.peer.node import Node, NodeOptions
from locomm.peer.rpc import Call, Limits, Service, TransferCut, Unreachable, open_link
from locomm.peer.state import Snapshot, fetch_state
from locomm.peer.swarm import Heartbeat, members_for_round, store_heartbeat
from locomm.protocol import build_outer
from locomm.protocol.messages import (
    STAGE_MESSAGES,
    ErrorCode,
    ProtocolViolation,
    activation_header,
    validate_activation,
)
from locomm.protocol.routing import route
from locomm.train.stage import StageWorker

log = logging.getLogger(__name__)
SUSPECT_S = 30.0
"""A replica that failed a hop is not routed to for this long (or until its heartbeat says it moved on)."""


class Lost(Exception):
    """A micro-batch no replica of the next stage could take."""


def pick_stage(
    beats: list[Heartbeat], stages: int, me: str, fresh_s: float = math.inf, now: float | None = None
) -> int:
    """``--stage auto``: the stage with the fewest live replicas (a heartbeat younger than ``fresh_s``),
    ties to the lowest."""
    now = get_dht_time() if now is None else now
    counts = [0] * stages
    for b in beats:
        s = b.fields.get("stage")
        age = now - float(b.fields.get("time", now) or now)
        if b.peer != me and isinstance(s, int) and 0 <= s < stages and not b.fields.get("finished") and age < fresh_s:
            counts[s] += 1
    return min(range(stages), key=lambda s: (counts[s], s))


class PipelineNode(Node):
    """One stage replica of a pipeline run."""

    def __init__(self, spec: RunSpec, opts: NodeOptions, stage: int | str = "auto") -> None:
        super().__init__(spec, opts)
        self.stage_arg = stage
        self.stage = -1
        self.reporter = None
        self.steps_target = 0
        self.microbatches = 0
        self.lost = 0
        self.rerouted = 0
        self.suspect: dict[str, float] = {}
        self.mb_times: deque[float] = deque(maxlen=256)
        self.stage_log: list[tuple[float, float, str]] = []
        """(start, end, kind) of every compute task, for the bubble fraction."""
        self.boundary_bytes = {"fwd": 0, "bwd": 0, "tokens": 0}
        self.pending_sync: tuple[int, dict[str, torch.Tensor], asyncio.Task] | None = None
        self.clock = 0
        """The data clock of a stage after 0: the largest stage-0 step any micro-batch here came from. Replica
        sync rounds follow it (round r ends when it reaches (r + 1) H), not this replica's own step count,
        which drifts from its siblings' with the random routing; stage 0's clock is its own step."""
        self._rounds_due = 0
        """Rounds whose sync has been started (a round starts once)."""
        self._sync_lock = asyncio.Lock()
        self._step_cond: asyncio.Condition | None = None
        self._mb_seq = 0
        self.inflight = 0
        """Micro-batches whose forward graph this stage holds (counted on the loop, before the forward runs)."""
        self.hold = 0
        """>0 while an outer update waits to be applied: new forwards wait for it."""
        self.tokens_forwarded = 0
        self._last_round_t = 0.0
        self.finished = False

    # -- compute with timestamps -----------------------------------------------------------

    async def timed(self, kind: str, fn: Any, *args: Any) -> Any:
        def run() -> Any:
            t0 = time.time()
            try:
                return fn(*args)
            finally:
                self.stage_log.append((t0, time.time(), kind))

        return await self.compute(run)

    # -- membership ------------------------------------------------------------------------

    def live_replicas(self, stage: int, *, suspects: bool = False) -> list[str]:
        """Replicas of ``stage`` with a fresh heartbeat; without ``suspects``, not those that failed a hop lately."""
        now = time.monotonic()
        ttl = self.spec.network.heartbeat_ttl_s
        out = []
        for b in self.beats.values():
            f = b.fields
            if f.get("stage") != stage or f.get("finished") or b.peer in self.faults.banned:
                continue
            if not suspects and now < self.suspect.get(b.peer, 0.0):
                continue
            if get_dht_time() - float(f.get("time", 0.0) or 0.0) > ttl:
                continue
            out.append(b.peer)
        return sorted(out)

    async def _heartbeat(self) -> None:
        assert self.dht is not None
        H = self.spec.outer.inner_steps
        w = getattr(self, "worker", None)
        step = w.step if w is not None else 0
        clock = self.data_clock()
        now = time.time()
        recent = [t for t in self.mb_times if now - t < 30.0]
        record = {
            "stage": self.stage,
            "round": clock // H,
            "clock": clock,
            "join_round": self.join_round,
            "step": step,
            "started": self.started,
            "finished": self.finished,
            "loss": _finite(self.last_loss),
            "val_loss": _finite(self.val_loss),
            "mb_per_s": len(recent) / 30.0 if recent else 0.0,
            "microbatches": self.microbatches,
            "rerouted": self.rerouted,
            "lost": self.lost,
            "tokens_per_s": self.tokens_per_s,
            "bytes_sent": self.gossip.stats.bytes_sent + self.boundary_bytes["fwd"] + self.boundary_bytes["bwd"]
            if hasattr(self, "gossip")
            else 0,
            "version": __version__,
            "maddrs": [str(m) for m in self.maddrs],
            "faults": self.faults.total if hasattr(self, "faults") else 0,
        }
        await store_heartbeat(self.dht, self.run_id, self.me, record, self.spec.network.heartbeat_ttl_s)

    def data_clock(self) -> int:
        w = getattr(self, "worker", None)
        return (w.step if w is not None else 0) if self.stage == 0 else self.clock

    def _due_round(self) -> int | None:
        """The replica sync round that has just ended by the data clock, once; None when none has."""
        done = self.data_clock() // self.spec.outer.inner_steps
        if done <= self._rounds_due:
            return None
        self._rounds_due = done
        return done - 1

    # -- the stage service -----------------------------------------------------------------

    def service(self) -> Service:
        return Service("stage", {t: self._on_forward for t in STAGE_MESSAGES}, policy="announced")

    async def _on_forward(self, call: Call) -> None:
        spec = self.spec
        f = validate_activation(
            call.msg,
            stage=self.stage,
            max_batch=spec.pipeline.micro_batch_size,
            max_seq=spec.data.seq_len,
            codec=self.coder.act_stack,
            max_act_bytes=self.coder.max_activation_bytes(spec.pipeline.micro_batch_size, spec.data.seq_len),
        )
        if self.stage == 0:
            raise ProtocolViolation(ErrorCode.NOT_READY, "stage 0 takes no activations")
        tok_raw = await call.link.read_part(f.tokens_nbytes)
        act_raw = await call.link.read_part(f.act_nbytes)
        if len(tok_raw) != f.tokens_nbytes or len(act_raw) != f.act_nbytes:
            raise ProtocolViolation(ErrorCode.BAD_SHAPE, "a part differs from its declared size")
        try:
            window = self.coder.decode_window(tok_raw, f.batch, f.seq)
            h = await self.rpc.decode(self.coder.decode_activation, act_raw, window[:, :-1])
        except NonFinite as e:
            raise ProtocolViolation(ErrorCode.NOT_FINITE, str(e)) from None
        except CodecError as e:
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, str(e)) from None
        train = call.msg.type == "fwd"
        if train:
            self.clock = max(self.clock, int(call.msg.round))
        try:
            loss, g = await self.process(f.origin, f.mb, window, h, train=train)
        except Lost as e:
            raise ProtocolViolation(ErrorCode.NOT_READY, f"downstream: {e}") from None
        if not train:
            await call.answer(ErrorCode.OK, loss=loss)
            return
        data = await self.rpc.decode(self.coder.encode_gradient, g, window[:, :-1])
        self.boundary_bytes["bwd"] += len(data)
        await call.answer(ErrorCode.OK, loss=loss, nbytes=len(data))
        await call.link.write_part(data)

    async def process(
        self, origin: str, mb: int, window: torch.Tensor, h: torch.Tensor | None, *, train: bool
    ) -> tuple[float, torch.Tensor | None]:
        """This stage's part of a micro-batch and everything after it: (loss, dL/dh_in)."""
        x, y = window[:, :-1], window[:, 1:]
        w = self.worker
        if not train:
            if w.last:
                return await self.timed("eval", _eval_last, w, x, y, h), None
            out = await self.timed("eval", _eval_mid, w, x, h)
            loss, _ = await self.send(origin, mb, window, out, train=False)
            return loss, None
        self.microbatches += 1
        self.mb_times.append(time.time())
        if w.last:
            loss, g = await self.timed("fb", w.forward_backward, x, y, h)
            await self._after_backward()
            return loss, g
        key = (origin, mb)
        assert self._step_cond is not None
        async with self._step_cond:  # a step that is due (or an outer update) waits for no graph in flight
            await self._step_cond.wait_for(lambda: not self.hold and not (w.step_due and self.inflight))
        if key in w.pending:
            raise ProtocolViolation(ErrorCode.NOT_READY, "this micro-batch is in flight here already")
        self.inflight += 1
        try:
            out = await self.timed("f", w.forward, key, x, h)
            try:
                loss, g_out = await self.send(origin, mb, window, out, train=True)
            except BaseException:
                await self.compute(w.drop, key)
                raise
            g_in = await self.timed("b", w.backward, key, g_out)
        finally:
            self.inflight -= 1
            await self._notify()
        await self._after_backward()
        return loss, g_in

    async def quiesced(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` in the compute thread once no forward graph is in flight (it changes the weights
        those graphs saved); new forwards wait meanwhile."""
        assert self._step_cond is not None
        self.hold += 1
        try:
            async with self._step_cond:
                await self._step_cond.wait_for(lambda: not self.inflight)
            return await self.compute(fn, *args)
        finally:
            self.hold -= 1
            await self._notify()

    async def _notify(self) -> None:
        assert self._step_cond is not None
        async with self._step_cond:
            self._step_cond.notify_all()

    async def _after_backward(self) -> None:
        await self.compute(self.worker.maybe_step)
        await self._notify()
        r = self._due_round()
        if r is not None:
            # In the background: the upstream's answer must not wait for an outer round.
            task = asyncio.create_task(self._on_step(r))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    # -- sending to the next stage ---------------------------------------------------------

    async def send(
        self, origin: str, mb: int, window: torch.Tensor, h: torch.Tensor, *, train: bool
    ) -> tuple[float, torch.Tensor | None]:
        """Hand a micro-batch to a random live replica of the next stage; re-route on failure."""
        nxt = self.stage + 1
        x = window[:, :-1]
        data = await self.rpc.decode(self.coder.encode_activation, h, x)
        tok = self.coder.encode_window(window)
        header_args = dict(
            step=self.data_clock(),
            stage=nxt,
            origin=origin,
            mb=mb,
            batch=int(x.shape[0]),
            seq=int(x.shape[1]),
            codec=self.coder.act_stack,
            tokens_nbytes=len(tok),
            act_nbytes=len(data),
        )
        tried: list[str] = []
        why = "no live replica"
        for attempt in range(1 + self.spec.pipeline.reroute_attempts):
            replicas = self.live_replicas(nxt)
            if not [r for r in replicas if r not in tried]:
                await self._read_beats()
                # Every replica failed a hop lately: try the suspects too (a hiccup must not stop the pipeline).
                replicas = self.live_replicas(nxt, suspects=True)
            peer = route(self.spec.train.seed, origin, mb, nxt, replicas, attempt=attempt, exclude=tried)
            if peer is None:
                break
            tried.append(str(peer))
            if attempt > 0:
                self.rerouted += 1
            try:
                header = activation_header(self.run_id, self.me, "fwd" if train else "eval", **header_args)
                loss, g = await self._hop(str(peer), header, tok, data, x, train)
                if train:
                    self.boundary_bytes["fwd"] += len(data)
                    self.boundary_bytes["tokens"] += len(tok)
                    self.tokens_forwarded += x.numel()
                return loss, g
            except asyncio.CancelledError:
                raise
            except (Unreachable, TransferCut, ConnectionError, TimeoutError, ProtocolViolation, CodecError) as e:
                why = f"{type(e).__name__}: {e}"
                log.info("micro-batch %s/%d: hop to %s failed (%s); re-routing", origin[-6:], mb, str(peer)[-8:], why)
                if not isinstance(e, ProtocolViolation) or e.code in (ErrorCode.TIMEOUT, ErrorCode.INTERNAL):
                    self.suspect[str(peer)] = time.monotonic() + SUSPECT_S
        raise Lost(why)

    async def _hop(
        self, peer: str, header: dict[str, Any], tok: bytes, data: bytes, x: torch.Tensor, train: bool
    ) -> tuple[float, torch.Tensor | None]:
        p = self.spec.pipeline
        assert self.p2p is not None
        async with asyncio.timeout(p.stage_timeout_s + self.limits.request_timeout_s):
            link = await open_link(self.p2p, peer, self.rpc.handler_name("stage"), self.limits)
            try:
                await link.write_header(header)
                await link.write_part(tok)
                await link.write_part(data)
                code, resp = await link.read_answer(extra_s=p.stage_timeout_s)
                if code != ErrorCode.OK:
                    raise ProtocolViolation(code, str(resp.get("msg", "")))
                loss = resp.get("loss")
                if not isinstance(loss, float) or not math.isfinite(loss):
                    raise ProtocolViolation(ErrorCode.MALFORMED, "answer without a finite loss")
                if not train:
                    return loss, None
                n = resp.get("nbytes")
                max_b = self.coder.max_activation_bytes(int(x.shape[0]), int(x.shape[1]))
                if not isinstance(n, int) or not 0 < n <= max_b:
                    raise ProtocolViolation(ErrorCode.MALFORMED, "answer without a valid gradient size")
                raw = await link.read_part(n)
            finally:
                link.writer.close()
        try:
            g = await self.rpc.decode(self.coder.decode_gradient, raw, x)
        except (CodecError, NonFinite) as e:
            self.faults.record(peer, f"bad gradient: {e}")
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, str(e)) from None
        return loss, g

    # -- stage 0: the training loop --------------------------------------------------------

    async def _micro_batch(self, window: torch.Tensor, sem: asyncio.Semaphore) -> float | None:
        async with sem:
            mb = self._mb_seq
            self._mb_seq += 1
            w = self.worker
            x = window[:, :-1]
            self.microbatches += 1
            self.mb_times.append(time.time())
            out = await self.timed("f", w.forward, mb, x, None)
            try:
                loss, g = await self.send(self.me, mb, window, out, train=True)
            except Lost as e:
                await self.compute(w.drop, mb)
                self.lost += 1
                self.events.write("lost", mb=mb, why=str(e))
                log.warning("micro-batch %d lost: %s", mb, e)
                return None
            await self.timed("b", w.backward, mb, g)
            return loss

    async def _train_stage0(self) -> None:
        p = self.spec.pipeline
        mbs = p.micro_batch_size
        sem = asyncio.Semaphore(p.in_flight)
        t_start = time.perf_counter()
        tokens = 0
        while self.worker.step < self.steps_target and not self.stop.is_set():
            x, y = await self.compute(self.sampler.next)
            window = torch.cat([x, y[:, -1:]], dim=1)
            t0 = time.perf_counter()
            parts = [window[i : i + mbs] for i in range(0, window.shape[0], mbs)]
            losses = await asyncio.gather(*(self._micro_batch(part, sem) for part in parts))
            done = [v for v in losses if v is not None]
            if self.worker.accumulated:
                await self.timed("step", self.worker.apply_step)
            else:  # every micro-batch of this batch was lost: the step is skipped, the schedule goes on
                self.worker.step += 1
            tokens += len(done) * mbs * self.spec.data.seq_len
            if done:
                self.last_loss = sum(done) / len(done)
            dt = time.perf_counter() - t0
            self.tokens_per_s = len(done) * mbs * self.spec.data.seq_len / dt if dt > 0 else 0.0
            self.events.write(
                "step",
                step=self.worker.step,
                loss=_finite(self.last_loss),
                lost=self.lost,
                rerouted=self.rerouted,
                wall_s=time.perf_counter() - t_start,
                tokens_per_s=self.tokens_per_s,
            )
            r = self._due_round()
            if r is not None:
                await self._on_step(r)
        self.t_train = time.perf_counter() - t_start

    async def evaluate(self) -> float:
        """Validation loss through the pipeline (stage 0 only): forward-only micro-batches."""
        total, n = 0.0, 0
        mbs = self.spec.pipeline.micro_batch_size
        for x, y in self._val:
            for i in range(0, x.shape[0], mbs):
                window = torch.cat([x[i : i + mbs], y[i : i + mbs, -1:]], dim=1)
                h = await self.timed("eval", _eval_mid, self.worker, window[:, :-1], None)
                mb = self._mb_seq
                self._mb_seq += 1
                try:
                    loss, _ = await self.send(self.me, mb, window, h, train=False)
                except Lost as e:
                    log.warning("evaluation micro-batch lost: %s", e)
                    continue
                total += loss
                n += 1
        return total / n if n else float("nan")

    # -- replica sync ----------------------------------------------------------------------

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """What a joiner of this stage downloads: the live weights (not only the last outer point) and the
        outer state."""
        return {
            **{f"model/{k}": v for k, v in self.params().items()},
            **{f"outer/{k}": v for k, v in self.algo.state_dict().items()},
        }

    async def _on_step(self, r: int) -> None:
        """Replica sync of round ``r`` (by the data clock): apply round r - 1's exchange, start round r's."""
        now = time.monotonic()
        self.round_s = now - self._last_round_t if self._last_round_t else 0.0
        self._last_round_t = now
        self.state_server.snapshot = await self.compute(lambda: Snapshot.take(r + 1, self._state_tensors()))
        await self._heartbeat()
        async with self._sync_lock:
            if self.pending_sync is not None:  # apply the previous round's exchange, one round late
                await self._finish_sync()
            self.gossip.advance(r)
            await self._read_beats()
            # Replicas of this stage with a fresh heartbeat: a sibling that died drops out within seconds,
            # so nobody waits out max_wait_s for its payload.
            fresh = 3 * self.spec.network.heartbeat_interval_s
            now = get_dht_time()
            beats = [
                b
                for b in self.beats.values()
                if b.fields.get("stage") == self.stage and now - float(b.fields.get("time", 0.0) or 0.0) < fresh
            ]
            members = members_for_round(beats, r, self.me, fresh_s=self.spec.network.heartbeat_ttl_s)
            plan, sent = await self.compute(self._plan, r, members)
            self.members, self.partners = len(members), len(plan.peers)
            # A partner's payload is due within about a round (siblings step at nearly the same rate) and a
            # stall timeout; one that is still arriving then is waited for, a dead one is not.
            wait = min(self.spec.network.max_wait_s, self.spec.network.stall_timeout_s + 2 * self.round_s)
            t_due = time.monotonic() + wait
            task = asyncio.create_task(self.gossip.exchange(r, list(plan.peers), plan.payload, eta=lambda _p: t_due))
            self.pending_sync = (r, sent, task, plan)  # type: ignore[assignment]
            self.round = r + 1

    async def _finish_sync(self, grace_s: float | None = None) -> None:
        """Apply the pending outer round; with ``grace_s`` (at the end of the run) give up on it after that."""
        assert self.pending_sync is not None
        r, sent, task, plan = self.pending_sync  # type: ignore[misc]
        self.pending_sync = None
        if grace_s is not None:
            await asyncio.wait({task}, timeout=grace_s)
        if (self.stop.is_set() or grace_s is not None) and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return
        got = await task
        self.last_answered = len(got)
        await self.quiesced(self._apply_sync, r, sent, {self.me: plan.payload, **got})

    def _apply_sync(self, r: int, sent: dict[str, torch.Tensor], inputs: dict[str, Any]) -> None:
        self._apply(r, sent, inputs)
        self.worker.module.project_()

    def params(self) -> dict[str, torch.Tensor]:
        return self.worker.params()

    # -- start-up --------------------------------------------------------------------------

    def _build_stage(self, shard: tuple[int, int]) -> None:
        from locomm.data import BatchSampler, eval_batches, load_corpus  # noqa: PLC0415
        from locomm.train import resolve_device  # noqa: PLC0415

        spec = self.spec
        self.geo = Geometry.of(spec)
        self.coder = BoundaryCoder(spec, self.geo)
        self.worker = StageWorker(spec, self.stage, geo=self.geo, device=resolve_device(self.opts.device))
        self.algo = build_outer(spec.outer, self.params(), self.me)
        if self.stage == 0:
            splits = load_corpus(spec.data)
            self.sampler = BatchSampler(
                splits.train, spec.data, seed=spec.train.seed, worker_id=shard[0], num_workers=shard[1]
            )
            self._val = eval_batches(splits.val, spec.data, spec.train.eval_batches)
        # Warm the codecs up here (numba compiles on first use), not inside a hop's deadline.
        h = torch.zeros(1, 2, self.geo.d)
        tok = torch.zeros(1, 2, dtype=torch.long)
        self.coder.decode_activation(self.coder.encode_activation(h, tok), tok)
        self.coder.decode_gradient(self.coder.encode_gradient(h, tok), tok)

    async def _join_stage(self) -> None:
        """A joiner of a stage that has trained: download the stage's weights and outer state from its replicas."""
        assert self.p2p is not None
        beats = [
            b
            for b in await self._read_beats()
            if b.peer != self.me and b.fields.get("stage") == self.stage and not b.fields.get("finished")
        ]
        donors = [
            b.peer
            for b in sorted(beats, key=lambda b: -int(b.fields.get("step", 0) or 0))[:3]
            if int(b.fields.get("step", 0) or 0) > 0
        ]
        if not donors:
            return
        got = await fetch_state(
            self.p2p,
            run_id=self.run_id,
            me=self.me,
            donors=donors,
            limits=self.limits,
            max_bytes=int(self.spec.network.max_message_mb * 2**20) * 4,
            on_fault=self.faults.record,
        )
        if got is None:
            log.warning("could not download stage %d's state; starting from the initial weights", self.stage)
            self.events.write("sync_failed", donors=len(donors))
            return
        donor_round, tensors = got
        await self.compute(self._load_state, tensors)
        step = max(int(b.fields.get("step", 0) or 0) for b in beats)
        self.worker.step = step
        if self.stage > 0:  # the siblings' data clock: our rounds start at the round they are in
            self.clock = max(int(b.fields.get("clock", b.fields.get("step", 0)) or 0) for b in beats)
        self.round = self._rounds_due = self.data_clock() // self.spec.outer.inner_steps
        self.events.write("synced", donor_round=donor_round, tensors=len(tensors), step=step)
        log.info("stage %d: synced weights of step %d from %d donor(s)", self.stage, step, len(donors))

    async def _serve_until_done(self) -> None:
        """Stages after 0 serve until every stage-0 replica has finished (or we are stopped)."""
        seen_driver = False
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 1.0)
            with contextlib.suppress(Exception):
                await self._read_beats()
            drivers = [b for b in self.beats.values() if b.fields.get("stage") == 0]
            if drivers:
                seen_driver = True
            if seen_driver and all(b.fields.get("finished") for b in drivers):
                return

    async def run(self) -> dict[str, Any]:
        import signal  # noqa: PLC0415

        from locomm.peer.metrics import Metrics  # noqa: PLC0415
        from locomm.peer.swarm import read_heartbeats  # noqa: PLC0415

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop.set)
        self._step_cond = asyncio.Condition()
        hb_task: asyncio.Task | None = None
        t_launch = time.perf_counter()
        try:
            await self._connect()
            spec = self.spec
            if spec.pipeline.stages < 2:
                raise ConfigError("pipeline.stages: this swarm's run spec has no pipeline (stages < 2)")
            if spec.outer.algo == "diloco":
                raise ConfigError("outer.algo: pipeline replicas sync with noloco, gasloc or sparseloco")
            self.run_id = spec.hash()[:16]
            self.limits = Limits.from_network(spec.network)
            self.faults = Faults(spec.network.max_faults_before_ban)
            beats = await read_heartbeats(self.dht, self.run_id)
            if self.stage_arg == "auto":
                # A replica that died a moment ago still has a record: count only fresh heartbeats.
                self.stage = pick_stage(
                    beats, spec.pipeline.stages, self.me, fresh_s=3 * spec.network.heartbeat_interval_s
                )
            else:
                self.stage = int(self.stage_arg)
                if not 0 <= self.stage < spec.pipeline.stages:
                    raise ConfigError(f"--stage: {self.stage} is not in [0, {spec.pipeline.stages})")
            self.join_round = 0
            self.steps_target = spec.train.steps
            shard = self.opts.shard or (int(self.me.encode().hex()[-8:], 16) % 64, 64)
            await self.compute(self._build_stage, shard)
            self.metrics = Metrics(self.opts.metrics_port, self.me, host=self.opts.metrics_host)
            self.codec = PayloadCodec(
                {k: tuple(v.shape) for k, v in self.params().items()},
                self.algo.payload_roles,
                spec.compression,
                encoded=self.algo.payload_encoded,
            )
            self._make_services()
            await self.compute(self.codec.warm_up)
            await self.rpc.add(self.service())
            await self.rpc.add(self.gossip.service())
            await self.rpc.add(self.state_server.service())
            await self._heartbeat()
            if self.opts.initial_peers:
                await self._join_stage()
            self.state_server.snapshot = await self.compute(lambda: Snapshot.take(self.round, self._state_tensors()))
            hb_task = asyncio.create_task(self._heartbeat_loop())
            if self.opts.announce_file:
                self.opts.announce_file.write_text("\n".join(str(m) for m in self.maddrs) + "\n")
            self.events.write(
                "started",
                peer=self.me,
                maddrs=[str(m) for m in self.maddrs],
                stage=self.stage,
                run=self.run_id,
                algo=spec.outer.algo,
                first_heartbeat_s=time.perf_counter() - t_launch,
            )
            log.info("peer %s serves stage %d of %d", self.me, self.stage, spec.pipeline.stages)
            if self.opts.wait_for_peers > 1:
                await self._wait_for_stages(self.opts.wait_for_peers)
            self.started = True
            await self._heartbeat()
            initial = final = float("nan")
            if self.stage == 0:
                initial = await self.evaluate()
                self.val_loss = initial
                self.events.write("eval", step=self.worker.step, val_loss=initial)
                await self._train_stage0()
                if self.pending_sync is not None:
                    async with self._sync_lock:
                        await self._finish_sync(grace_s=self.spec.network.stall_timeout_s)
                final = await self.evaluate()
                self.val_loss = final
                self.events.write("eval", step=self.worker.step, val_loss=final)
            else:
                await self._serve_until_done()
                if self.pending_sync is not None:  # a sibling that took fewer micro-batches may never get here
                    async with self._sync_lock:
                        await self._finish_sync(grace_s=5.0)
            self.finished = True
            with contextlib.suppress(Exception):
                await self._heartbeat()
            if self.opts.final_weights and not self.stop.is_set():
                from safetensors.torch import save_file  # noqa: PLC0415

                await self.compute(
                    save_file,
                    {k: v.detach().contiguous() for k, v in self.params().items()},
                    str(self.opts.final_weights),
                )
            self.summary = self._summary(initial, final)
            self.events.write("finished", **self.summary)
            return self.summary
        finally:
            self.stop.set()
            if hb_task is not None:
                hb_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await hb_task
            if self.pending_sync is not None:
                self.pending_sync[2].cancel()
                with contextlib.suppress(BaseException):
                    await self.pending_sync[2]
            await self._shutdown()

    async def _wait_for_stages(self, n: int, timeout: float = 90.0) -> None:
        """Before training: wait until ``n`` peers, self included, announce a stage, and every stage has one."""
        deadline = time.monotonic() + timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            await self._read_beats()
            staged = [
                b
                for b in self.beats.values()
                if isinstance(b.fields.get("stage"), int) and b.fields.get("stage", -1) >= 0
            ]
            stages = {b.fields["stage"] for b in staged}
            if len(staged) >= n and stages >= set(range(self.spec.pipeline.stages)):
                return
            await asyncio.sleep(0.25)
        log.warning("starting without all %d peers", n)

    def _summary(self, initial: float, final: float) -> dict[str, Any]:
        t_end = time.time()
        log_ = list(self.stage_log)
        t0 = log_[0][0] if log_ else t_end
        busy = sum(b - a for a, b, k in log_ if k != "eval")
        tokens = self.boundary_bytes
        tok_count = self.microbatches * self.spec.pipeline.micro_batch_size * self.spec.data.seq_len
        return {
            "peer": self.me,
            "stage": self.stage,
            "initial_loss": initial,
            "final_loss": final,
            "steps": self.worker.step,
            "microbatches": self.microbatches,
            "microbatches_lost": self.lost,
            "microbatches_rerouted": self.rerouted,
            "bytes_fwd": tokens["fwd"],
            "bytes_tokens": tokens["tokens"],
            "bytes_bwd": tokens["bwd"],
            "tokens_served": tok_count,
            "tokens_forwarded": self.tokens_forwarded,
            "compute_intervals": [(round(a, 4), round(b, 4), k) for a, b, k in log_ if k != "eval"],
            "busy_s": busy,
            "span_s": t_end - t0,
            "last_loss": _finite(self.last_loss),
            "faults": self.faults.total,
            "errors_answered": dict(self.rpc.stats.errors_answered),
            "exchanges_ok": self.gossip.stats.exchanges_ok,
            "exchanges_failed": self.gossip.stats.exchanges_failed,
            "interrupted": self.stop.is_set() and not self.finished,
        }


@torch.no_grad()
def _eval_mid(w: StageWorker, x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    w.module.eval()
    out = w.module(x.to(w.device), None if h is None else h.to(w.device))
    w.module.train()
    return out


@torch.no_grad()
def _eval_last(w: StageWorker, x: torch.Tensor, y: torch.Tensor, h: torch.Tensor | None) -> float:
    from locomm.model.stages import StageModule  # noqa: PLC0415

    w.module.eval()
    loss = float(StageModule.loss(w.module(x.to(w.device), h.to(w.device)), y.to(w.device)))
    w.module.train()
    return loss


def _finite(x: float) -> float | None:
    return x if isinstance(x, float) and math.isfinite(x) else None
