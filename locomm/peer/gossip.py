"""Outer-update exchanges over hivemind P2P binary streams: push, mailbox, faults and bans.

A round's exchange is symmetric push: each worker opens a stream to each of its
round partners and sends its payload; the partner validates it, stores it in its
mailbox (even when it has not reached that round yet) and answers with a status
code. A worker then waits, up to the configured timeout, for its partners' pushes
to arrive, and the round goes on with whoever answered. No global barrier.

Validation order for an incoming push (nothing is allocated for tensors until
the header has passed): the stream's authenticated peer id is not banned and
matches the header's sender; version, run hash, type, round window; every
tensor's name, shape and codec and its declared size against what that tensor
can take; then each body is read (exactly the declared bytes), decoded and
checked for shape and finite values.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID

from locomm import PROTOCOL_VERSION
from locomm.protocol.messages import ErrorCode, ProtocolViolation, TensorSpec, check_response, response_header, \
    validate_header
from locomm.peer.wire import TensorCoder, read_exact, read_header, write_frame

log = logging.getLogger(__name__)

ROUND_WINDOW = 4
"""Pushes for rounds more than this far from ours are refused (STALE_ROUND)."""
MAX_SENDERS_PER_ROUND = 64
"""Mailbox bound: payloads from at most this many peers per round are buffered."""


@dataclass
class GossipStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    exchanges_ok: int = 0
    exchanges_failed: int = 0
    faults: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    errors_answered: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    last_exchange: float = 0.0


class Gossip:
    """One node's side of the exchange protocol."""

    def __init__(self, p2p: P2P, *, run_id: str, me: str, expected: Mapping[str, TensorSpec], codec: str,
                 timeout: float, max_body_bytes: int, max_faults: int, raw_bytes_tensors: frozenset[str] = frozenset(),
                 raw_decoder: Any = None) -> None:
        self.p2p = p2p
        self.run_id = run_id
        self.me = me
        self.expected = dict(expected)
        self.coder = TensorCoder(codec)
        self.timeout = timeout
        self.max_body_bytes = max_body_bytes
        self.max_faults = max_faults
        # Tensors that travel as an algorithm codec's bytes (SparseLoCo): checked with raw_decoder, kept as bytes.
        self.raw_bytes_tensors = raw_bytes_tensors
        self.raw_decoder = raw_decoder
        self.handler_name = f"locomm.{run_id}.push"
        self.mailbox: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
        self.arrived = asyncio.Condition()
        self.current_round = 0
        self.banned: set[str] = set()
        self.stats = GossipStats()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._handle)

    # -- faults ------------------------------------------------------------------------

    def record_fault(self, peer: str, why: str) -> None:
        self.stats.faults[peer] += 1
        log.warning("fault from %s (%d): %s", peer[-8:], self.stats.faults[peer], why)
        if self.stats.faults[peer] >= self.max_faults and peer not in self.banned:
            self.banned.add(peer)
            log.warning("banned %s after %d faults", peer[-8:], self.stats.faults[peer])

    # -- server side ---------------------------------------------------------------------

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote = info.peer_id.to_base58()
        try:
            code, msg = await self._receive(remote, reader)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or a transport error must not take the peer down
            log.exception("push handler failed")
            code, msg = ErrorCode.INTERNAL, type(e).__name__
        if code != ErrorCode.OK:
            self.stats.errors_answered[code.name] += 1
        try:
            await asyncio.wait_for(write_frame(writer, response_header(code, msg)), self.timeout)
        except Exception:  # noqa: BLE001 - the sender may be gone; nothing to do
            pass
        finally:
            writer.close()

    async def _receive(self, remote: str, reader: asyncio.StreamReader) -> tuple[ErrorCode, str]:
        if remote in self.banned:
            # Read (and drop) the bounded header so the answer is not lost to a reset; never the body.
            with contextlib.suppress(ProtocolViolation):
                await read_header(reader, min(self.timeout, 5.0))
            return ErrorCode.BANNED, "banned"
        try:
            header = await read_header(reader, self.timeout)
            msg = validate_header(header, run_id=self.run_id, expected=self.expected,
                                  max_body_bytes=self.max_body_bytes, types=("push",))
            if msg.sender != remote:
                raise ProtocolViolation(ErrorCode.MALFORMED, "sender does not match the stream's peer id")
            if abs(msg.round - self.current_round) > ROUND_WINDOW:
                raise ProtocolViolation(ErrorCode.STALE_ROUND, f"round {msg.round}, we are at {self.current_round}")
            pending = self.mailbox.get(msg.round, {})
            if len(pending) >= MAX_SENDERS_PER_ROUND and remote not in pending:
                return ErrorCode.NOT_READY, "mailbox full for this round"
            if set(t.name for t in msg.tensors) != set(self.expected):
                raise ProtocolViolation(ErrorCode.UNEXPECTED_TENSOR, "payload does not hold every expected tensor")
            # Read every declared body first (sizes are validated and bounded): a sender whose payload
            # turns out bad still gets its error code instead of a reset stream.
            bodies = []
            for entry in msg.tensors:
                bodies.append(await read_exact(reader, entry.nbytes, self.timeout))
                self.stats.bytes_received += entry.nbytes
            payload: dict[str, Any] = {}
            for entry, data in zip(msg.tensors, bodies):
                spec = self.expected[entry.name]
                if entry.name in self.raw_bytes_tensors:
                    self._check_raw(entry.name, data, spec)
                    payload[entry.name] = data
                else:
                    payload[entry.name] = self.coder.decode(entry, data, spec)
        except ProtocolViolation as v:
            self.record_fault(remote, v.message)
            return v.code, v.message
        async with self.arrived:
            self.mailbox[msg.round][remote] = payload
            self.arrived.notify_all()
        return ErrorCode.OK, ""

    def _check_raw(self, name: str, data: bytes, spec: TensorSpec) -> None:
        try:
            t = self.raw_decoder(data)
        except Exception as e:  # the codec's error type
            raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"{name}: {e}") from None
        if t.numel() != spec.numel:
            raise ProtocolViolation(ErrorCode.BAD_SHAPE, f"{name}: {t.numel()} values for {spec.shape}")
        if not torch.isfinite(t).all():
            raise ProtocolViolation(ErrorCode.NOT_FINITE, f"{name}: non-finite values")

    # -- client side ---------------------------------------------------------------------

    def encode_payload(self, round_idx: int, payload: Mapping[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
        """Header and body parts for a push (encoding once, sent to every partner)."""
        entries, body = [], []
        for name in sorted(payload):
            v = payload[name]
            data = bytes(v) if isinstance(v, (bytes, bytearray, memoryview)) else self.coder.encode(v)
            codec = "topk2bit" if name in self.raw_bytes_tensors else self.coder.name
            entries.append({"name": name, "codec": codec, "nbytes": len(data),
                            "shape": list(self.expected[name].shape)})
            body.append(data)
        header = {"v": PROTOCOL_VERSION, "run": self.run_id, "type": "push", "round": round_idx, "sender": self.me,
                  "tensors": entries}
        return header, body

    async def push(self, peer: str, header: Mapping[str, Any], body: list[bytes]) -> ErrorCode:
        """Send one encoded payload to one peer; returns the answer (or records a fault)."""
        try:
            async with asyncio.timeout(self.timeout):
                _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer),
                                                                             self.handler_name)
                try:
                    await write_frame(writer, header, body)
                    code = check_response(await read_header(reader, self.timeout))
                finally:
                    writer.close()
        except asyncio.CancelledError:
            raise
        except (Exception, TimeoutError) as e:  # unreachable, reset, timed out: data, not a crash
            self.record_fault(peer, f"push failed: {type(e).__name__}: {e}")
            self.stats.exchanges_failed += 1
            return ErrorCode.INTERNAL
        if code == ErrorCode.OK:
            self.stats.bytes_sent += sum(len(b) for b in body)
            self.stats.exchanges_ok += 1
            self.stats.last_exchange = time.time()
        else:
            self.stats.exchanges_failed += 1
            log.warning("push to %s answered %s", peer[-8:], code.name)
        return code

    async def exchange(self, round_idx: int, peers: list[str], payload: Mapping[str, Any]) -> dict[str, Any]:
        """Push to every partner, then wait for theirs; returns {peer: payload} of who answered."""
        peers = [p for p in peers if p not in self.banned and p != self.me]
        if not peers:
            return {}
        header, body = self.encode_payload(round_idx, payload)
        results = await asyncio.gather(*(self.push(p, header, body) for p in peers))
        # Wait only for partners that accepted our push: one that refused or was unreachable will not send.
        waiting = {p for p, code in zip(peers, results) if code == ErrorCode.OK}
        deadline = time.monotonic() + self.timeout
        async with self.arrived:
            while not waiting <= set(self.mailbox.get(round_idx, {})):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self.arrived.wait(), left)
                except TimeoutError:
                    break
            got = {p: v for p, v in self.mailbox.get(round_idx, {}).items() if p in set(peers)}
        missing = set(peers) - set(got)
        if missing:
            log.info("round %d: no payload from %s; going on with %d of %d", round_idx,
                     ", ".join(m[-8:] for m in missing), len(got), len(peers))
        return got

    def advance(self, round_idx: int) -> None:
        """We are now in ``round_idx``: drop mailbox rounds that can no longer be used."""
        self.current_round = round_idx
        for r in [r for r in self.mailbox if r < round_idx - 1]:
            del self.mailbox[r]
