"""The stage service: one stage replica's share of every micro-batch, on the RPC base.

A micro-batch is one chain of nested requests: stage k's ``fwd`` handler computes its forward, sends z
and the token window to a seeded-random live replica of stage k+1 (:func:`locomm.protocol.routing.route`),
and the answer carries dL/dz back along the same path; the handler then runs its backward and answers its
own caller with its input's gradient. A failed hop (dead replica, timeout, refusal) is re-routed to another
replica, ``pipeline.reroute_attempts`` times; a micro-batch that still fails is :class:`Lost` (stage 0
counts it and goes on with the rest of the step).

The driver (:class:`locomm.peer.pipeline.stage.Stage`) owns the lifecycle and the replica sync; it hands this
service the host, the stage worker and the boundary coder, and is called back after every backward
(``on_backward``), where optimizer steps and replica-sync rounds fall due.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from locomm.compression.base import CodecError
from locomm.compression.boundary import BoundaryCoder, NonFinite
from locomm.peer.host import Host
from locomm.peer.transport.rpc import Call, Service, TransferCut, Unreachable, open_link
from locomm.protocol.defence import BoundaryNorm
from locomm.protocol.membership import live
from locomm.protocol.messages import (
    STAGE_MESSAGES,
    ActivationFrame,
    ErrorCode,
    ProtocolViolation,
    activation_header,
    validate_activation,
)
from locomm.protocol.routing import route
from locomm.train.stage import StageWorker, eval_last, eval_mid

log = logging.getLogger(__name__)
SUSPECT_S = 30.0
"""A replica that failed a hop is not routed to for this long (or until its heartbeat says it moved on)."""


class Lost(Exception):
    """A micro-batch no replica of the next stage could take."""


class StageService:
    """Forward and backward of micro-batches through this replica, and the hop to the next stage."""

    def __init__(
        self, host: Host, worker: StageWorker, coder: BoundaryCoder, on_backward: Callable[[], Awaitable[None]]
    ) -> None:
        self.host, self.worker, self.coder, self.on_backward = host, worker, coder, on_backward
        self.stage = worker.stage
        self.spec = host.spec
        self.clock = 0
        """The data clock of a stage after 0: the largest stage-0 step any micro-batch here came from."""
        self.microbatches = self.lost = self.rerouted = self.tokens_forwarded = 0
        self.suspect: dict[str, float] = {}
        self.mb_times: deque[float] = deque(maxlen=256)
        self.stage_log: list[tuple[float, float, str]] = []
        """(start, end, kind) of every compute task, for the bubble fraction."""
        self.boundary_bytes = {"fwd": 0, "bwd": 0, "tokens": 0}
        self.inflight = 0
        """Micro-batches whose forward graph this stage holds (counted on the loop, before the forward runs)."""
        self.hold = 0
        """>0 while an outer update waits to be applied: new forwards wait for it."""
        self.serving = 0
        """Frames from the previous stage that this replica is processing (forward to the answer)."""
        self.paused = False
        """Its volunteer paused it (or it is pausing): new frames are refused with NOT_READY, so their senders
        re-route them to a sibling, until the paused heartbeat takes it out of everyone's routes."""
        self._cond = asyncio.Condition()
        d = self.spec.defence
        self.norms = {"act": BoundaryNorm(d), "grad": BoundaryNorm(d)}
        """Running medians of the RMS of the activations and gradients that reached this replica."""

    def service(self) -> Service:
        return Service("stage", {t: self._on_forward for t in STAGE_MESSAGES}, policy="announced")

    def data_clock(self) -> int:
        return self.worker.step if self.stage == 0 else self.clock

    def mb_per_s(self, window_s: float = 30.0) -> float:
        now = time.time()
        return sum(1 for t in self.mb_times if now - t < window_s) / window_s

    async def timed(self, kind: str, fn: Any, *args: Any) -> Any:
        def run() -> Any:
            t0 = time.time()
            try:
                return fn(*args)
            finally:
                self.stage_log.append((t0, time.time(), kind))

        return await self.host.compute(run)

    def live_replicas(self, stage: int, *, suspects: bool = False, paused: bool = False) -> list[str]:
        """Replicas of ``stage`` with a fresh heartbeat; without ``suspects``, not those that failed a hop lately;
        without ``paused``, not those their volunteers paused (they take no micro-batches)."""
        h, now = self.host, time.monotonic()
        beats = live(h.beats.values(), h.dht_now(), self.spec.network.heartbeat_ttl_s, stage=stage)
        return sorted(
            b.peer
            for b in beats
            if b.peer not in h.faults.banned
            and (suspects or now >= self.suspect.get(b.peer, 0.0))
            and (paused or not b.paused)
        )

    # -- who may send, and how far a frame moves the clock --------------------------------

    async def _check_sender(self, remote: str) -> None:
        """Frames come only from a live replica of the previous stage (UNAUTHORIZED otherwise, before any body
        is read); a sender we have not seen there yet gets one fresh (shared) DHT read first."""
        h, prev = self.host, self.stage - 1

        def is_prev() -> bool:
            b = h.beats.get(remote)
            return b is not None and b.stage == prev and remote in self.live_replicas(prev, suspects=True, paused=True)

        if not await h.recheck(is_prev):
            raise ProtocolViolation(ErrorCode.UNAUTHORIZED, f"not a live replica of stage {prev}")

    def clock_ceiling(self, remote: str, frame_clock: int) -> int:
        """What a frame's clock may move ours to: at most one round (H steps) past the clocks that this stage's
        replicas and stage 0's replicas publish (the sender's own excluded), and past ours. A sender cannot set
        the data clock (hence replica-sync rounds) of a stage ahead of the swarm."""
        h = self.host
        fresh = live(h.beats.values(), h.dht_now(), self.spec.network.heartbeat_ttl_s)
        published = [b.clock for b in fresh if b.peer != remote and b.stage in (0, self.stage)]
        ceiling = max([self.clock, *published]) + self.spec.outer.inner_steps
        if frame_clock > ceiling:
            log.info("a frame from %s claims step %d; held to %d", remote[-8:], frame_clock, ceiling)
        return min(frame_clock, ceiling)

    # -- serving ------------------------------------------------------------------------

    async def _on_forward(self, call: Call) -> None:
        spec, coder = self.spec, self.coder
        mbs, seq = spec.pipeline.micro_batch_size, spec.data.seq_len
        f = validate_activation(
            call.msg,
            stage=self.stage,
            max_batch=mbs,
            max_seq=seq,
            codec=coder.act_stack,
            max_act_bytes=coder.max_activation_bytes(mbs, seq),
        )
        if self.stage == 0:
            raise ProtocolViolation(ErrorCode.NOT_READY, "stage 0 takes no activations")
        await self._check_sender(call.remote)
        if self.paused:  # not a fault of the sender: it routed before it read our paused heartbeat; no body read
            raise ProtocolViolation(ErrorCode.NOT_READY, "this replica is paused")
        tok_raw = await call.link.read_part(f.tokens_nbytes)
        act_raw = await call.link.read_part(f.act_nbytes)
        if len(tok_raw) != f.tokens_nbytes or len(act_raw) != f.act_nbytes:
            raise ProtocolViolation(ErrorCode.BAD_SHAPE, "a part differs from its declared size")
        if self.paused:  # paused while the body came
            raise ProtocolViolation(ErrorCode.NOT_READY, "this replica is paused")
        self.serving += 1
        try:
            await self._serve(call, f, tok_raw, act_raw)
        finally:
            self.serving -= 1
            await self.notify()

    async def _serve(self, call: Call, f: ActivationFrame, tok_raw: bytes, act_raw: bytes) -> None:
        coder, rpc = self.coder, self.host.rpc
        try:
            window = coder.decode_window(tok_raw, f.batch, f.seq)
            h = await rpc.decode(coder.decode_activation, act_raw, window[:, :-1])
        except NonFinite as e:
            raise ProtocolViolation(ErrorCode.NOT_FINITE, str(e)) from None
        except CodecError as e:
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, str(e)) from None
        if (why := self.norms["act"].check(h)) is not None:
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"activation {why}")
        train = call.msg.type == "fwd"
        if train:
            self.clock = max(self.clock, self.clock_ceiling(call.remote, int(call.msg.round)))
        try:
            loss, g = await self.process(f.origin, f.mb, window, h, train=train)
        except Lost as e:
            raise ProtocolViolation(ErrorCode.NOT_READY, f"downstream: {e}") from None
        if not train:
            await call.answer(ErrorCode.OK, loss=loss)
            return
        data = await rpc.decode(coder.encode_gradient, g, window[:, :-1])
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
                return await self.timed("eval", eval_last, w, x, y, h), None
            out = await self.timed("eval", eval_mid, w, x, h)
            loss, _ = await self.send(origin, mb, window, out, train=False)
            return loss, None
        self.microbatches += 1
        self.mb_times.append(time.time())
        if w.last:
            loss, g = await self.timed("fb", w.forward_backward, x, y, h)
            await self.on_backward()
            return loss, g
        key = (origin, mb)
        async with self._cond:  # a step that is due (or an outer update) waits for no graph in flight
            await self._cond.wait_for(lambda: not self.hold and not (w.step_due and self.inflight))
        if key in w.pending:
            raise ProtocolViolation(ErrorCode.NOT_READY, "this micro-batch is in flight here already")
        self.inflight += 1
        try:
            out = await self.timed("f", w.forward, key, x, h)
            try:
                loss, g_out = await self.send(origin, mb, window, out, train=True)
            except BaseException:
                await self.host.compute(w.drop, key)
                raise
            g_in = await self.timed("b", w.backward, key, g_out)
        finally:
            self.inflight -= 1
            await self.notify()
        await self.on_backward()
        return loss, g_in

    async def quiesced(self, fn: Any, *args: Any) -> Any:
        """Run ``fn`` in the compute thread once no forward graph is in flight (it changes the weights
        those graphs saved); new forwards wait meanwhile."""
        self.hold += 1
        try:
            async with self._cond:
                await self._cond.wait_for(lambda: not self.inflight)
            return await self.host.compute(fn, *args)
        finally:
            self.hold -= 1
            await self.notify()

    async def drained(self) -> None:
        """Until no frame from the previous stage is being processed here (its answer sent or failed)."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self.serving)

    async def notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    # -- sending to the next stage ------------------------------------------------------

    async def send(
        self, origin: str, mb: int, window: torch.Tensor, h: torch.Tensor, *, train: bool
    ) -> tuple[float, torch.Tensor | None]:
        """Hand a micro-batch to a random live replica of the next stage; re-route on failure."""
        host, nxt = self.host, self.stage + 1
        x = window[:, :-1]
        data = await host.rpc.decode(self.coder.encode_activation, h, x)
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
                await host.read_beats()
                # Every replica failed a hop lately: try the suspects too (a hiccup must not stop the pipeline).
                replicas = self.live_replicas(nxt, suspects=True)
            peer = route(self.spec.train.seed, origin, mb, nxt, replicas, attempt=attempt, exclude=tried)
            if peer is None:
                break
            tried.append(str(peer))
            if attempt > 0:
                self.rerouted += 1
            try:
                header = activation_header(host.run_id, host.me, "fwd" if train else "eval", **header_args)
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
        p, host = self.spec.pipeline, self.host
        async with asyncio.timeout(p.stage_timeout_s + host.limits.request_timeout_s):
            link = await open_link(host.p2p, peer, host.rpc.handler_name("stage"), host.limits)
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
            g = await host.rpc.decode(self.coder.decode_gradient, raw, x)
        except (CodecError, NonFinite) as e:
            host.faults.record(peer, f"bad gradient: {e}")
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, str(e)) from None
        if (why := self.norms["grad"].check(g)) is not None:
            host.faults.record(peer, f"gradient {why}")
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"gradient {why}")
        return loss, g
