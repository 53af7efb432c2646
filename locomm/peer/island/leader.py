"""The representative's side of an island's service (``peer/island/member.py``): a follower's step, its outer-round
fetch and its state download, each answered at a point where the representative's state is consistent.

A mixin of :class:`~locomm.peer.island.member.Island`: the handlers read its roster, sync state and queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import torch

from locomm.compression.base import CodecError
from locomm.peer.island.wire import LEAVING, NEVER_PLANNED, state_of, write_synced, write_tensors
from locomm.peer.transport.rpc import Call
from locomm.protocol.messages import ErrorCode, ProtocolViolation
from locomm.protocol.scape import ScapeMessage, decode_indices, encode_indices


class IslandServing:
    """The ``island`` service's handlers and what the representative keeps for them."""

    # Set by Island.__init__ / form (declared here for readers).
    host: Any
    node: Any
    name: str
    roster: list[str]
    sync: Any
    active: set[str]
    inbox: dict[int, dict[str, ScapeMessage]]
    results: dict[int, asyncio.Future]
    arrived: asyncio.Event
    settled: dict[int, dict[str, torch.Tensor] | None]
    settled_event: asyncio.Event
    planned: set[int]
    state_wanted: list[asyncio.Future]
    stats: dict[str, int]
    loop: asyncio.AbstractEventLoop

    async def _on_step(self, call: Call) -> None:
        f, remote = call.msg.fields, call.remote
        self._check(call)
        t, cur = f.get("step"), self.sync.step
        old = self.results.get(t) if isinstance(t, int) and t < cur else None
        retry = old is not None and old.done() and self._rank(remote) in old.result().senders
        if not isinstance(t, int) or (t not in (cur, cur + 1) and not retry):
            await call.answer(ErrorCode.STALE_ROUND, f"island step {t!r}, we are at {cur}", step=cur)
            return
        nv, nm = f.get("nv"), f.get("nm")
        lo, hi = self.sync.bounds[self._rank(remote)]
        if not (isinstance(nv, int) and 0 < nv <= self.sync.numel and isinstance(nm, int) and 0 <= nm <= hi - lo):
            raise ProtocolViolation(ErrorCode.MALFORMED, f"island step: nv={nv!r} nm={nm!r}")
        has_mask = f.get("has_mask") is True
        if has_mask and nm != self.sync.slice_size(self._rank(remote)):
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"island step: a mask slice of {nm} indices")
        vraw = await call.link.read_part(4 * nv)
        raw = await call.link.read_part(6 * nm)
        if len(vraw) != 4 * nv:
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"island step: {len(vraw)} value bytes for {nv} values")
        values = torch.frombuffer(vraw, dtype=torch.float32)
        if not bool(torch.isfinite(values).all()):
            raise ProtocolViolation(ErrorCode.NOT_FINITE, "island step: values not finite")
        try:
            shard = decode_indices(raw, nm, self.sync.numel) if has_mask else None
        except CodecError as e:
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"island step: mask slice: {e}") from None
        if shard is not None and nm and (int(shard[0]) < lo or int(shard[-1]) >= hi):
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, "island step: mask slice outside the sender's slice")
        self.stats["step_bytes_received"] += 4 * nv + len(raw)
        if retry:  # its answer of a step it took part in was lost on the way: the same buffer again
            self.stats["step_bytes_sent"] += await write_synced(call, old.result())
            return
        self.active.add(remote)
        self.inbox.setdefault(t, {})[remote] = ScapeMessage(self._rank(remote), t, values.clone(), shard)
        self.arrived.set()
        fut = self.results.setdefault(t, asyncio.get_running_loop().create_future())
        await self._await_leading(fut)
        synced = fut.result()
        if self._rank(remote) not in synced.senders:
            await call.answer(ErrorCode.STALE_ROUND, "the step went on without you", step=self.sync.step)
            return
        self.stats["step_bytes_sent"] += await write_synced(call, synced)

    async def _await_leading(self, fut: asyncio.Future) -> None:
        """Wait for ``fut`` as long as we lead and are not leaving (a slow step, an evaluation: no deadline)."""
        while not fut.done():
            if self.host.stop.is_set() or not self.leading:
                raise ProtocolViolation(ErrorCode.NOT_READY, LEAVING)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fut), 1.0)

    async def _serve_states(self) -> None:
        """Answer the queued ``island.state`` requests with one snapshot, taken now (a step boundary)."""
        if not self.state_wanted:
            return
        wanted, self.state_wanted = self.state_wanted, []
        snap = await self.host.compute(state_of, self)
        for fut in wanted:
            if not fut.done():
                fut.set_result(snap)

    def settle_done(self, round_idx: int, applied: bool) -> None:
        """The representative settled ``round_idx`` (``Node._apply``, the compute thread): followers may fetch it."""
        algo = self.node.algo
        state = {k: v.detach().to("cpu", copy=True) for k, v in algo.state_dict().items()} if applied else None
        self.settled[round_idx] = state
        self.loop.call_soon_threadsafe(self.planned.discard, round_idx)
        for old in [r for r in self.settled if r < round_idx - 1]:
            del self.settled[old]
        self.loop.call_soon_threadsafe(self.settled_event.set)  # we are on the compute thread

    async def _on_outer(self, call: Call) -> None:
        r = call.msg.round
        self._check(call, lead=False)
        end = time.monotonic() + self.node.spec.network.max_wait_s
        while r not in self.settled and self.leading and time.monotonic() < end:
            if r not in self.planned and self.node.round > r:
                raise ProtocolViolation(ErrorCode.NOT_READY, NEVER_PLANNED)  # it led from a later round on
            if self.host.stop.is_set():
                break
            self.settled_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.settled_event.wait(), max(0.01, end - time.monotonic()))
        state = self.settled.get(r)
        if state is None:
            raise ProtocolViolation(ErrorCode.NOT_READY, f"round {r} is not settled here")
        self.stats["outer_bytes"] += await write_tensors(call, state)

    async def _on_state(self, call: Call) -> None:
        self._check(call)
        fut = asyncio.get_running_loop().create_future()
        self.state_wanted.append(fut)
        self.active.add(call.remote)
        self.arrived.set()  # a representative waiting for its followers serves it at once
        await self._await_leading(fut)
        tensors, fields = fut.result()
        fields = dict(fields)
        mask = fields.pop("mask")
        self.stats["resync_bytes"] += await write_tensors(
            call, tensors, fields=fields, tail=encode_indices(mask) if mask is not None else b""
        )
