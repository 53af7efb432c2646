"""hivemind's p2pd control client and an answer to a call whose caller was cancelled (peer/transport/p2pd_calls.py).

The reader task is hivemind's own ``_read_from_persistent_conn``, fed the daemon's answers as p2pd frames them."""

from __future__ import annotations

import asyncio
from uuid import uuid4

import pytest
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.proto import p2pd_pb2 as p2pd_pb

from locomm.peer.transport import p2pd_calls


def _framed(call_id, data: bytes) -> bytes:
    """One PersistentConnectionResponse as p2pd writes it: a varint length, then the message."""
    msg = p2pd_pb.PersistentConnectionResponse(callId=call_id.bytes)
    msg.callUnaryResponse.response = data
    body, size, head = msg.SerializeToString(), msg.ByteSize(), bytearray()
    while True:
        head.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            return bytes(head) + body


async def _read(client: ControlClient) -> tuple[asyncio.Future, asyncio.Future]:
    """A call cancelled by its caller's timeout (its future still listed: its task has not run yet) and a live
    one; the daemon answers both, the cancelled one first."""
    cancelled, live = uuid4(), uuid4()
    client._pending_calls[cancelled] = asyncio.get_running_loop().create_future()
    client._pending_calls[live] = asyncio.get_running_loop().create_future()
    client._pending_calls[cancelled].cancel()
    reader = asyncio.StreamReader()
    reader.feed_data(_framed(cancelled, b"late") + _framed(live, b"ok"))
    reader.feed_eof()
    await client._read_from_persistent_conn(reader)
    return client._pending_calls[cancelled], client._pending_calls[live]


async def test_an_answer_to_a_cancelled_call_no_longer_ends_the_reader():
    bare = ControlClient(None, _initialized_with_create=True)
    bare._pending_calls = dict(bare._pending_calls)  # hivemind as it is: the reader dies on the late answer
    with pytest.raises(asyncio.InvalidStateError):
        await _read(bare)
    assert p2pd_calls.install() and p2pd_calls.install()  # idempotent
    client = ControlClient(None, _initialized_with_create=True)
    cancelled, live = await _read(client)  # the late answer skipped, the reader goes on to the next
    assert cancelled.cancelled() and live.result() == b"ok"
