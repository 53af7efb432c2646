"""An island's representative: what it keeps for its followers (their step messages, the synchronized buffers
it answered, the outer rounds it planned and settled, the state downloads asked of it) and the ``island`` service's
handlers that answer them, each at a point where its state is consistent: a follower's step (``on_step``), its
outer-round fetch (``on_outer``), its state download (``on_state``).

Every member holds one (any member may become the representative on failover); it serves while its member leads,
and answers NOT_READY otherwise. It reads its member through the :class:`Seat` protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import torch

from locomm.compression.base import CodecError
from locomm.peer.host import Host
from locomm.peer.island.state import Trainee, state_of
from locomm.peer.island.wire import LEAVING, NEVER_PLANNED, write_synced, write_tensors
from locomm.peer.transport.rpc import Call
from locomm.protocol.messages import ErrorCode, ProtocolViolation
from locomm.protocol.scape import ScapeMessage, ScapeSync, Synced, decode_indices, encode_indices, reduce

log = logging.getLogger(__name__)


class Seat(Protocol):
    """What a representative reads of its island member."""

    host: Host
    node: Trainee
    name: str
    sync: ScapeSync
    sent: dict[int, dict[str, torch.Tensor]]
    stats: dict[str, int]

    @property
    def leading(self) -> bool: ...

    def check(self, call: Call, lead: bool = True) -> None: ...

    def rank(self, peer: str) -> int: ...

    def deadline_s(self) -> float: ...


class Representative:
    """One member's representative side (see the module docstring)."""

    def __init__(self, seat: Seat) -> None:
        self.seat = seat
        self.loop = asyncio.get_running_loop()
        self.active: set[str] = set()
        """Followers the representative waits for at each step (a late one is dropped until it comes back)."""
        self.inbox: dict[int, dict[str, ScapeMessage]] = {}
        self.results: dict[int, asyncio.Future[Synced]] = {}
        self.arrived = asyncio.Event()
        self.settled: dict[int, dict[str, torch.Tensor] | None] = {}
        self.settled_event = asyncio.Event()
        self.planned: set[int] = set()
        """Rounds this representative planned and has not settled yet (followers wait for those)."""
        self.state_wanted: list[asyncio.Future] = []

    async def lead(self, msg: ScapeMessage) -> Synced:
        t = msg.step
        self.active -= {p for p in self.active if (b := self.seat.host.beats.get(p)) is not None and b.finished}
        fut = self.results.setdefault(t, asyncio.get_running_loop().create_future())
        end = time.monotonic() + self.seat.deadline_s()
        while not self.active <= set(self.inbox.get(t, {})) and time.monotonic() < end:
            if self.state_wanted:  # mid-step, grads computed, nothing applied: a consistent state too
                await self.serve_states()
                end = max(end, time.monotonic() + self.seat.deadline_s())  # give it time to download and step
                continue
            self.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.arrived.wait(), max(0.01, end - time.monotonic()))
        got = {p: m for s_, box in list(self.inbox.items()) if s_ <= t for p, m in box.items() if s_ == t}
        for s_ in [s_ for s_ in self.inbox if s_ <= t]:
            del self.inbox[s_]
        if msg.mask_shard is None:  # no moment here yet: nobody's slice can be right
            for m in got.values():
                m.mask_shard = None
        want = msg.values.numel()
        ok = {p: m for p, m in got.items() if m.values.numel() == want}
        for p in set(got) - set(ok):
            self.seat.host.faults.record(p, f"island step {t}: {got[p].values.numel()} values, the mask has {want}")
        late = self.active - set(ok)
        if late:
            self.seat.stats["dropped"] += len(late)
            log.info("island %s step %d: going on without %s", self.seat.name, t, [p[-8:] for p in late])
            self.active -= late
        synced = await self.seat.host.rpc.decode(reduce, [msg, *ok.values()])
        fut.set_result(synced)
        for old in [s for s in self.results if s < t - 2]:
            del self.results[old]
        return synced

    async def on_step(self, call: Call) -> None:
        f, remote = call.msg.fields, call.remote
        self.seat.check(call)
        t, cur = f.get("step"), self.seat.sync.step
        old = self.results.get(t) if isinstance(t, int) and t < cur else None
        retry = old is not None and old.done() and self.seat.rank(remote) in old.result().senders
        if not isinstance(t, int) or (t not in (cur, cur + 1) and not retry):
            await call.answer(ErrorCode.STALE_ROUND, f"island step {t!r}, we are at {cur}", step=cur)
            return
        nv, nm = f.get("nv"), f.get("nm")
        lo, hi = self.seat.sync.bounds[self.seat.rank(remote)]
        if not (isinstance(nv, int) and 0 < nv <= self.seat.sync.numel and isinstance(nm, int) and 0 <= nm <= hi - lo):
            raise ProtocolViolation(ErrorCode.MALFORMED, f"island step: nv={nv!r} nm={nm!r}")
        has_mask = f.get("has_mask") is True
        if has_mask and nm != self.seat.sync.slice_size(self.seat.rank(remote)):
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"island step: a mask slice of {nm} indices")
        vraw = await call.link.read_part(4 * nv)
        raw = await call.link.read_part(6 * nm)
        if len(vraw) != 4 * nv:
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"island step: {len(vraw)} value bytes for {nv} values")
        values = torch.frombuffer(vraw, dtype=torch.float32)
        if not bool(torch.isfinite(values).all()):
            raise ProtocolViolation(ErrorCode.NOT_FINITE, "island step: values not finite")
        try:
            shard = decode_indices(raw, nm, self.seat.sync.numel) if has_mask else None
        except CodecError as e:
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"island step: mask slice: {e}") from None
        if shard is not None and nm and (int(shard[0]) < lo or int(shard[-1]) >= hi):
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, "island step: mask slice outside the sender's slice")
        self.seat.stats["step_bytes_received"] += 4 * nv + len(raw)
        if retry:  # its answer of a step it took part in was lost on the way: the same buffer again
            self.seat.stats["step_bytes_sent"] += await write_synced(call, old.result())
            return
        self.active.add(remote)
        self.inbox.setdefault(t, {})[remote] = ScapeMessage(self.seat.rank(remote), t, values.clone(), shard)
        self.arrived.set()
        fut = self.results.setdefault(t, asyncio.get_running_loop().create_future())
        await self._await_leading(fut)
        synced = fut.result()
        if self.seat.rank(remote) not in synced.senders:
            await call.answer(ErrorCode.STALE_ROUND, "the step went on without you", step=self.seat.sync.step)
            return
        self.seat.stats["step_bytes_sent"] += await write_synced(call, synced)

    async def _await_leading(self, fut: asyncio.Future) -> None:
        """Wait for ``fut`` as long as we lead and are not leaving (a slow step, an evaluation: no deadline)."""
        while not fut.done():
            if self.seat.host.stop.is_set() or not self.seat.leading:
                raise ProtocolViolation(ErrorCode.NOT_READY, LEAVING)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fut), 1.0)

    async def serve_states(self) -> None:
        """Answer the queued ``island.state`` requests with one snapshot, taken now (a step boundary)."""
        if not self.state_wanted:
            return
        wanted, self.state_wanted = self.state_wanted, []
        snap = await self.seat.host.compute(state_of, self.seat.node, self.seat.sync, self.seat.sent)
        for fut in wanted:
            if not fut.done():
                fut.set_result(snap)

    def settle_done(self, round_idx: int, applied: bool) -> None:
        """The representative settled ``round_idx`` (``Node._apply``, the compute thread): followers may fetch it."""
        algo = self.seat.node.algo
        state = {k: v.detach().to("cpu", copy=True) for k, v in algo.state_dict().items()} if applied else None
        self.settled[round_idx] = state
        self.loop.call_soon_threadsafe(self.planned.discard, round_idx)
        for old in [r for r in self.settled if r < round_idx - 1]:
            del self.settled[old]
        self.loop.call_soon_threadsafe(self.settled_event.set)  # we are on the compute thread

    async def on_outer(self, call: Call) -> None:
        r = call.msg.round
        self.seat.check(call, lead=False)
        end = time.monotonic() + self.seat.node.spec.network.max_wait_s
        while r not in self.settled and self.seat.leading and time.monotonic() < end:
            if r not in self.planned and self.seat.node.round > r:
                raise ProtocolViolation(ErrorCode.NOT_READY, NEVER_PLANNED)  # it led from a later round on
            if self.seat.host.stop.is_set():
                break
            self.settled_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.settled_event.wait(), max(0.01, end - time.monotonic()))
        state = self.settled.get(r)
        if state is None:
            raise ProtocolViolation(ErrorCode.NOT_READY, f"round {r} is not settled here")
        self.seat.stats["outer_bytes"] += await write_tensors(call, state)

    async def on_state(self, call: Call) -> None:
        self.seat.check(call)
        fut = asyncio.get_running_loop().create_future()
        self.state_wanted.append(fut)
        self.active.add(call.remote)
        self.arrived.set()  # a representative waiting for its followers serves it at once
        await self._await_leading(fut)
        tensors, fields = fut.result()
        fields = dict(fields)
        mask = fields.pop("mask")
        self.seat.stats["resync_bytes"] += await write_tensors(
            call, tensors, fields=fields, tail=encode_indices(mask) if mask is not None else b""
        )
