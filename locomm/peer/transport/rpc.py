"""The exchange layer: one service base for every locomm binary-stream handler, and byte-sized deadlines.

hivemind's ``ServicerBase`` declares a protobuf handler per RPC; locomm's payloads are
raw tensor parts, so the services here sit on p2pd binary streams with locomm's own
frames (``u32 length | msgpack header``, then ``u32 length | bytes`` per part). A
service declares one handler per message type and a policy; for every request
the base does, in order:

1. a bounded header read (``request_timeout_s``; at most ``MAX_HEADER_BYTES``);
2. validation of the envelope against ``protocol/messages.py`` (version, run,
   type, round, sender == the stream's authenticated peer id);
3. the authorize hook with the service's policy (``member``: admitted members
   only, ``announced``: any peer with a heartbeat, joiners included). Signatures
   plug in here;
4. the handler, which reads its body through :class:`Link` (streamed, under the
   deadlines below) and decodes in the codec pool (:meth:`RpcServer.decode`:
   never on the loop, never on the compute thread);
5. an answer with an :class:`ErrorCode`. Violations in ``FAULT_CODES`` count as
   the sender's faults; slowness (``TIMEOUT``), refusals and our own errors never do.

Deadlines are sized by bytes, not one fixed total. A transfer is cut off when it
*stalls* (no byte moved for ``stall_timeout_s``), when it runs past its declared
size at the floor rate ``min_rate_mbit`` (plus ``request_timeout_s`` of slack), or
when, over any ``rate_window_s`` of waiting on the wire, it moved less than the
floor: a sender trickling 1 byte/s into a 1 GB declaration is cut off after one
window, not after 800 s. With S parallel streams each stream is held to 1/S of
the floor. Open streams are capped per remote peer (``max_streams_per_peer``) and in total
(``max_inbound_streams``: peer ids are free, so the total is what bounds the buffered headers); a stream over
either cap is answered ``NOT_READY`` (not a fault) before its header is read, and only a little of what it
sends is drained.

A traffic cap (``shaper.py``): ``RpcServer(shaper=...)`` attaches it to its P2P; every Link on that P2P (served,
or from ``open_link`` / ``request``) takes its bytes from its buckets, ``SLICE`` at a time. Time on the bucket is
ours, not the partner's: it counts toward no stall or floor window and moves the size deadline back.

``clock`` (of a ``Link``, the ``RpcServer``, ``open_link``) is the one source of "now" for the deadlines and
meters; the daemon's is ``time.monotonic``. The waits are asyncio timeouts on the loop's clock, so tests on a
virtual-time loop (``locomm.testing.clock``) pass ``clock=loop.time`` and never sleep on the real clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P, PeerID

from locomm.peer.transport.meter import Clock, FloorWindow, LinkLoad, Meter, NotServed, TransferCut, Unreachable
from locomm.peer.transport.shaper import SLICE, Bucket, Shaper, attach, shaper_of
from locomm.protocol.messages import (
    FAULT_CODES,
    HEADER_LEN,
    PART_LEN,
    ErrorCode,
    Message,
    ProtocolViolation,
    check_response,
    decode_header,
    pack_frame,
    read_header_length,
    response_header,
    validate_header,
)
from locomm.protocol.timing import Limits

log = logging.getLogger(__name__)
IO_CHUNK = 1 << 18
"""Bytes per read/write call: small enough for progress and stall checks, large enough to be cheap."""


class Link:
    """One stream's reads and writes under the limits (stall, floor rate over a window, size deadline)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        limits: Limits,
        meter: Meter,
        streams: int = 1,
        *,
        clock: Clock = time.monotonic,
        shaper: Shaper | None = None,
        loads: Mapping[str, LinkLoad] | None = None,
    ) -> None:
        self.reader, self.writer, self.limits, self.meter = reader, writer, limits, meter
        self.loads = loads
        """The peer's link, per direction ("send", "recv"): a stream below the floor on a busy link is not cut."""
        self.clock = clock
        self.up, self.down = (shaper.up, shaper.down) if shaper is not None else (None, None)
        meter.t0 = meter.last = clock()
        self.streams = max(1, streams)
        self.deadline: float | None = None
        self.window = FloorWindow(limits.rate_window_s)

    def expect(self, nbytes: int, streams: int | None = None) -> None:
        """A body of up to ``nbytes`` follows: set the size-based deadline from now."""
        if streams is not None:
            self.streams = max(1, streams)
        self.meter.total += nbytes
        self.deadline = self.clock() + self.limits.deadline_s(nbytes, self.streams)

    def _progress(self, n: int, waited: float, direction: str) -> None:
        now = self.clock()
        self.meter.done += n
        self.meter.last = now
        floor = self.limits.min_rate_Bps / self.streams
        if self.loads is not None:
            load = self.loads[direction]
            load.add(now, n)
            if load.busy(now, self.limits.min_rate_Bps):
                floor = 0.0  # our link is full: a slow stream shares it, it is not a slow peer
        self.window.add(n, waited, floor)
        if self.deadline is not None and now > self.deadline:
            raise TransferCut(f"past the deadline for {self.meter.total} bytes at the floor rate")

    async def _throttle(self, bucket: Bucket, n: int) -> None:
        """Take ``n`` bytes from our own cap; the time it takes moves the size deadline back (it is not theirs)."""
        t0 = self.clock()
        if await bucket.take(n):
            dt = self.clock() - t0
            self.meter.throttled_s += dt
            if self.deadline is not None:
                self.deadline += dt

    def _timeout(self) -> float:
        t = self.limits.stall_timeout_s
        if self.deadline is not None:
            t = min(t, max(0.0, self.deadline - self.clock()))
        return t

    def _cut(self, stalled: str) -> TransferCut:
        """A wait with nothing moving timed out: at the size deadline, or else a stall (``stalled`` says what)."""
        past = self.deadline is not None and self.clock() >= self.deadline
        return TransferCut(f"past the deadline for {self.meter.total} bytes at the floor rate" if past else stalled)

    # -- reads -------------------------------------------------------------------------

    async def _read_frame(self, timeout_s: float, what: str) -> dict[str, Any]:
        """One ``u32 length | msgpack`` header within ``timeout_s``; a stream that ends first is a broken link
        (a sender that hung up, cancelled or shutting down, is not a violation)."""
        try:
            async with asyncio.timeout(timeout_s):
                prefix = await self.reader.readexactly(HEADER_LEN.size)
                raw = await self.reader.readexactly(read_header_length(prefix))
        except asyncio.IncompleteReadError:
            raise ConnectionError(f"stream ended before the whole {what}") from None
        except TimeoutError:
            raise TransferCut(f"no {what} within {timeout_s:.0f} s") from None
        if self.down is not None:
            await self._throttle(self.down, len(prefix) + len(raw))
        return decode_header(raw)

    async def read_header(self, timeout_s: float | None = None) -> dict[str, Any]:
        """A bounded header read: ``timeout_s`` (at most request_timeout_s) for the whole header."""
        limit = self.limits.request_timeout_s
        return await self._read_frame(limit if timeout_s is None else min(timeout_s, limit), "header")

    async def read_exact(self, n: int) -> bytearray:
        """Exactly ``n`` bytes (already bounded by a validated declaration), in chunks under the limits."""
        buf = bytearray(n)
        view = memoryview(buf)
        got, step = 0, SLICE if self.down is not None else IO_CHUNK
        while got < n:
            t0, wait_s = self.clock(), self._timeout()
            try:
                chunk = await asyncio.wait_for(self.reader.read(min(step, n - got)), wait_s)
            except TimeoutError:
                raise self._cut(f"no bytes for {wait_s:.0f} s ({got} of {n} read)") from None
            if not chunk:
                raise ConnectionError(f"stream ended after {got} of {n} bytes")
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
            wire = self.clock() - t0
            if self.down is not None:
                await self._throttle(self.down, len(chunk))
            self._progress(len(chunk), wire, "recv")
        return buf

    async def discard(self, max_bytes: int = 8 << 20, max_s: float = 1.0) -> None:
        """Take in (and drop) a little of what the sender is still writing: closing with unread bytes resets
        the stream, and the reset can overtake an answer we already wrote."""
        end, left = self.clock() + max_s, max_bytes
        with contextlib.suppress(Exception):
            while left > 0 and self.clock() < end:
                chunk = await asyncio.wait_for(self.reader.read(min(IO_CHUNK, left)), max(0.01, end - self.clock()))
                if not chunk:
                    return
                left -= len(chunk)
                if self.down is not None:
                    await self.down.take(len(chunk))

    async def read_part(self, max_bytes: int) -> bytearray:
        """One ``u32 length | bytes`` part whose length must not exceed ``max_bytes``."""
        prefix = await self.read_exact(PART_LEN.size)
        n = PART_LEN.unpack(prefix)[0]
        if n > max_bytes:
            raise ProtocolViolation(ErrorCode.TOO_LARGE, f"part of {n} bytes, at most {max_bytes} allowed")
        return await self.read_exact(n)

    # -- writes ------------------------------------------------------------------------

    async def write_header(self, header: Mapping[str, Any]) -> None:
        frame = pack_frame(header)
        if self.up is not None:
            await self._throttle(self.up, len(frame))
        self.writer.write(frame)
        try:
            await asyncio.wait_for(self.writer.drain(), self.limits.request_timeout_s)
        except TimeoutError:
            raise TransferCut("could not send a header within request_timeout_s") from None

    async def write_bytes(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        step = SLICE if self.up is not None else IO_CHUNK
        for off in range(0, len(view), step):
            piece = view[off : off + step]
            if self.up is not None:
                await self._throttle(self.up, len(piece))
            t0, wait_s = self.clock(), self._timeout()
            self.writer.write(piece)
            try:
                await asyncio.wait_for(self.writer.drain(), wait_s)
            except TimeoutError:
                raise self._cut(f"the receiver took nothing for {wait_s:.0f} s") from None
            self._progress(len(piece), self.clock() - t0, "send")

    async def write_part(self, data: bytes | bytearray | memoryview) -> None:
        if len(data) < IO_CHUNK:  # a small part goes out with its length in one write
            await self.write_bytes(PART_LEN.pack(len(data)) + bytes(data))
        else:
            await self.write_bytes(PART_LEN.pack(len(data)))
            await self.write_bytes(data)

    async def read_answer(self, extra_s: float = 0.0) -> tuple[ErrorCode, dict[str, Any]]:
        """The peer's answer header: waits a stall timeout (plus ``extra_s`` for its decoding)."""
        resp = await self._read_frame(self.limits.stall_timeout_s + self.limits.request_timeout_s + extra_s, "answer")
        return check_response(resp), resp


# ------------------------------------------------------------------------------ server

Authorize = Callable[[str, str], Awaitable[bool]]
"""(remote peer id, policy) -> allowed."""


@dataclass
class Call:
    """One incoming request, as a handler sees it."""

    remote: str
    msg: Message
    link: Link
    server: RpcServer
    answered: bool = False

    async def answer(self, code: ErrorCode = ErrorCode.OK, message: str = "", **fields: Any) -> None:
        self.answered = True
        await self.link.write_header(response_header(code, message, **fields))


Handler = Callable[[Call], Awaitable[None]]


@dataclass
class Service:
    name: str
    """Handler name suffix: the stream handler is ``locomm.{run}.{name}``."""
    handlers: dict[str, Handler]
    """Message type -> handler."""
    policy: str = "member"
    """``member``: admitted members only; ``announced``: any peer with a heartbeat (joiners too)."""


@dataclass
class RpcStats:
    errors_answered: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cut: int = 0


CODEC_QUEUE = 2
"""Jobs of :meth:`RpcServer.decode` in the codec pool at once (its width: the pool never idles while more wait).
Submitted as they came, every part our partners had pushed queued ahead of our own payload's first encode: with
their pushes arriving when our round ended, round 0's first part went out 11-17 s late (docs/results/links.md)."""


class RpcServer:
    """Serves locomm's services on one P2P instance."""

    def __init__(
        self,
        p2p: P2P,
        run_id: str,
        limits: Limits,
        pool: Executor,
        *,
        authorize: Authorize | None = None,
        is_banned: Callable[[str], bool] = lambda _: False,
        on_fault: Callable[[str, str], None] = lambda *_: None,
        clock: Clock = time.monotonic,
        shaper: Shaper | None = None,
    ) -> None:
        self.p2p, self.run_id, self.limits, self.pool = p2p, run_id, limits, pool
        self.shaper = shaper
        """The peer's traffic cap, attached to ``p2p``: client links on it (``open_link``, ``request``) use it too."""
        if shaper is not None:
            attach(p2p, shaper)
        self.clock = clock  # of every link it serves, and of the Gossip on it unless told otherwise
        self.authorize = authorize
        self.is_banned = is_banned
        self.on_fault = on_fault
        self.open_streams: dict[str, int] = defaultdict(int)
        self.inbound = 0
        """Streams admitted past the caps and not yet closed (refused ones are not counted)."""
        self.meters: list[Meter] = []
        self.loads = {d: LinkLoad(limits.rate_window_s) for d in ("send", "recv")}
        """What our link moves per direction, every stream together (served and opened: see ``open_link``)."""
        self.stats = RpcStats()
        self._codec_slots = asyncio.Semaphore(CODEC_QUEUE)

    def handler_name(self, service: str) -> str:
        return f"locomm.{self.run_id}.{service}"

    async def add(self, service: Service) -> None:
        async def serve(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(service, info.peer_id.to_base58(), reader, writer)

        await self.p2p.add_binary_stream_handler(self.handler_name(service.name), serve)

    async def decode(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a decode (or a pipeline frame's encode) in the codec pool, off the loop and off the compute thread;
        at most ``CODEC_QUEUE`` at once, the rest wait here, so our own payload's encodes (``Outgoing``, submitted
        to the pool directly) wait behind that many, not behind every part our partners have sent."""
        async with self._codec_slots:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def _serve(
        self, service: Service, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        meter = Meter(remote, "recv")
        link = Link(reader, writer, self.limits, meter, clock=self.clock, shaper=self.shaper, loads=self.loads)
        call: Call | None = None
        if self.open_streams.get(remote, 0) >= self.limits.max_streams_per_peer:
            return await self._refuse(service, remote, link, "too many open streams from this peer")
        # Who may use the service is known from the stream alone: ask before it takes one of the slots every
        # peer shares (an outsider's streams, slow headers and all, never hold an honest member's slot).
        if (
            self.authorize is not None
            and not self.is_banned(remote)
            and not await self.authorize(remote, service.policy)
        ):
            why = f"not allowed by the {service.policy!r} policy"
            return await self._refuse(service, remote, link, why, ErrorCode.UNAUTHORIZED, DRAIN_BYTES)
        if self.inbound >= self.limits.max_inbound_streams:
            return await self._refuse(service, remote, link, "too many open streams")
        self.open_streams[remote] += 1
        self.inbound += 1
        self.meters.append(meter)
        try:
            code, message = ErrorCode.OK, ""
            try:
                if self.is_banned(remote):
                    # Read (and drop) the bounded header so the answer is not lost to a reset; never the body.
                    with contextlib.suppress(ProtocolViolation, TransferCut, ConnectionError):
                        await link.read_header()
                    raise ProtocolViolation(ErrorCode.BANNED, "banned")
                header = await link.read_header(HEADER_TIMEOUT_S)
                msg = validate_header(
                    header, run_id=self.run_id, expected=None, max_body_bytes=1 << 62, types=tuple(service.handlers)
                )
                if msg.sender != remote:
                    raise ProtocolViolation(ErrorCode.MALFORMED, "sender does not match the stream's peer id")
                call = Call(remote, msg, link, self)
                await service.handlers[msg.type](call)
            except ProtocolViolation as v:
                code, message = v.code, v.message
                if v.code in FAULT_CODES:
                    self.on_fault(remote, v.message)
            except TransferCut as e:
                self.stats.cut += 1
                log.info("%s from %s cut off: %s", service.name, remote[-8:], e)
                code, message = ErrorCode.TIMEOUT, str(e)
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                log.info("%s from %s: the stream broke: %s", service.name, remote[-8:], e)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug must not take the peer down
                log.exception("%s handler failed", service.name)
                code, message = ErrorCode.INTERNAL, type(e).__name__
            if code != ErrorCode.OK:
                self.stats.errors_answered[code.name] += 1
                log.info("%s from %s answered %s: %s", service.name, remote[-8:], code.name, message)
            if call is None or not call.answered:
                with contextlib.suppress(Exception):
                    await link.write_header(response_header(code, message))
            if code != ErrorCode.OK:
                await link.discard(DRAIN_BYTES, DRAIN_S)
        finally:
            self.inbound -= 1
            self.open_streams[remote] -= 1
            if self.open_streams[remote] <= 0:
                del self.open_streams[remote]
            with contextlib.suppress(ValueError):
                self.meters.remove(meter)
            writer.close()

    async def _refuse(
        self,
        service: Service,
        remote: str,
        link: Link,
        why: str,
        code: ErrorCode = ErrorCode.NOT_READY,
        drain: int = 0,
    ) -> None:
        """A stream over a cap (or from a peer the policy refuses): ``code`` at once (no header buffered), then a
        little of it drained, so the answer is not lost to the reset of closing with unread bytes."""
        self.stats.errors_answered[code.name] += 1
        log.debug("%s from %s refused: %s", service.name, remote[-8:], why)
        try:
            with contextlib.suppress(Exception):
                await link.write_header(response_header(code, why))
            await link.discard(drain or REFUSED_DRAIN_BYTES, DRAIN_S)
        finally:
            link.writer.close()


HEADER_TIMEOUT_S = 10.0
"""A stream's header must arrive this soon after the stream opened (a sender writes it at once: it encodes
first, then dials). A slow header holds one of the sender's own per-peer slots, and only that long."""
DRAIN_BYTES = 8 << 20
DRAIN_S = 1.0
REFUSED_DRAIN_BYTES = 1 << 16


# ------------------------------------------------------------------------------ client


async def open_link(
    p2p: P2P,
    peer: str,
    handler: str,
    limits: Limits,
    direction: str = "send",
    streams: int = 1,
    *,
    clock: Clock = time.monotonic,
    shaper: Shaper | None = None,
    loads: Mapping[str, LinkLoad] | None = None,
) -> Link:
    """A stream to ``peer``'s ``handler``, under ``shaper`` (default: the one attached to ``p2p``, if any);
    ``loads``: the peer's link per direction (``RpcServer.loads``), shared by every stream it serves and opens."""
    try:
        async with asyncio.timeout(limits.request_timeout_s):
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler)
    except asyncio.CancelledError:
        raise
    except (Exception, TimeoutError) as e:  # noqa: BLE001 - p2pd reports dial failures in several ways
        if f"{NotServed.MARK}: [{handler}]" in str(e):  # this handler, not a relay's hop protocol
            raise NotServed(f"{type(e).__name__}: {e}") from None
        raise Unreachable(f"{type(e).__name__}: {e}") from None
    shaper = shaper if shaper is not None else shaper_of(p2p)
    return Link(reader, writer, limits, Meter(peer, direction), streams, clock=clock, shaper=shaper, loads=loads)


async def request(
    p2p: P2P,
    peer: str,
    handler: str,
    header: Mapping[str, Any],
    limits: Limits,
    body: Callable[[Link, dict[str, Any]], Awaitable[Any]] | None = None,
    *,
    clock: Clock = time.monotonic,
    shaper: Shaper | None = None,
) -> tuple[dict[str, Any], Any]:
    """One request: send ``header``, read the answer; ``body(link, answer)`` reads what follows an OK."""
    link = await open_link(p2p, peer, handler, limits, "recv", clock=clock, shaper=shaper)
    try:
        await link.write_header(header)
        code, resp = await link.read_answer()
        if code != ErrorCode.OK:
            raise ProtocolViolation(code, str(resp.get("msg", "")))
        return resp, (await body(link, resp) if body is not None else None)
    finally:
        link.writer.close()
