"""Seeing a peer alive: the smallest stream there is, both ways (what it proves: ``protocol/sightings.py``); and
asking a peer whom it has seen alive, since when.

``locomm.{run}.hello`` answers one byte and closes. Opening it to a peer id makes libp2p's secure channel check
that whoever answers holds that id's private key, so a completed hello is that identity, live, now; the one who
opened it is proven alike to the one who answers (``on_sight`` is called with its id). Nothing is read from the
opener, so the handler holds nothing and costs one stream.

``locomm.{run}.seen`` answers the peer's sightings: per identity, its round when it first saw that identity alive
(``Host.since``), the ``SEEN_MAX`` seen first, as JSON. A joiner has seen nobody for longer than a few seconds;
it asks the ``--initial-peers`` it trusts, so that identities minted minutes ago do not stand level with peers
that have trained for hours (``membership.state_donors``' observed age). Nothing is read from the opener.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from hivemind.p2p import P2P, PeerID

from locomm.protocol.membership import MAX_ROUND

ASK_TIMEOUT_S = 10.0
"""A hello unanswered by then is a miss (a dial through a relay on a slow link takes a few seconds)."""
ANSWER = b"\x01"
T = TypeVar("T")
SEEN_MAX = 512
"""Identities one ``seen`` answer names at most (those seen first): a donor list needs a handful."""
SEEN_MAX_BYTES = 64 * 1024
"""A ``seen`` answer longer than this is refused unread (512 ids of 52 characters with a round: about 32 kB)."""
MAX_ID_CHARS = 128


def handler_name(run_id: str) -> str:
    return f"locomm.{run_id}.hello"


async def serve(p2p: P2P, run_id: str, on_sight: Callable[[str], None]) -> None:
    """Answer hellos on ``p2p``; ``on_sight(peer)`` for each one opened to us."""

    async def hello(info: Any, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        on_sight(info.peer_id.to_base58())
        try:
            writer.write(ANSWER)
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(handler_name(run_id), hello)


async def ask(p2p: P2P, run_id: str, peer: str, timeout_s: float = ASK_TIMEOUT_S) -> bool:
    """Whether ``peer`` answered a hello within ``timeout_s`` (a ghost, an unreachable or a dead peer: False)."""

    async def answered(reader: asyncio.StreamReader) -> bool:
        return await reader.readexactly(1) == ANSWER

    return bool(await _call(p2p, peer, handler_name(run_id), timeout_s, answered))


async def _call(
    p2p: P2P, peer: str, name: str, timeout_s: float, read: Callable[[asyncio.StreamReader], Awaitable[T]]
) -> T | None:
    """Open ``name`` to ``peer`` and ``read`` its answer, all within ``timeout_s``; None when anything fails."""
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), name)
            return await read(reader)
    except asyncio.CancelledError:
        raise
    except (Exception, TimeoutError):  # noqa: BLE001 - p2pd reports dial failures in several ways
        return None
    finally:
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()


def seen_handler_name(run_id: str) -> str:
    return f"locomm.{run_id}.seen"


async def serve_seen(
    p2p: P2P,
    run_id: str,
    view: Callable[[], Mapping[str, int]],
    allow: Callable[[str], Awaitable[bool]],
) -> None:
    """Answer ``seen`` asks on ``p2p`` with ``view()`` (identity -> our round when we first saw it alive), to the
    peers ``allow`` lets in (the host's: announced peers; who trains in a closed swarm is not an outsider's to
    read); another gets the stream closed with nothing written."""

    async def seen(info: Any, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not await allow(info.peer_id.to_base58()):
                return
            first = sorted(view().items(), key=lambda kv: kv[1])[:SEEN_MAX]
            writer.write(json.dumps(dict(first), separators=(",", ":")).encode())
            async with asyncio.timeout(ASK_TIMEOUT_S):  # a reader that never reads does not hold the stream
                await writer.drain()
        except (ConnectionError, OSError, TimeoutError):
            pass
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(seen_handler_name(run_id), seen)


def parse_seen(data: bytes) -> dict[str, int] | None:
    """A ``seen`` answer checked (a JSON object of at most ``SEEN_MAX`` short ids to rounds), else None."""
    if len(data) > SEEN_MAX_BYTES:
        return None
    try:
        view = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: "[[[[..." nested past the stack
        return None
    if not isinstance(view, dict) or len(view) > SEEN_MAX:
        return None
    ok = all(
        isinstance(k, str) and 0 < len(k) <= MAX_ID_CHARS and type(v) is int and 0 <= v <= MAX_ROUND
        for k, v in view.items()
    )
    return view if ok else None


async def ask_seen(p2p: P2P, run_id: str, peer: str, timeout_s: float = ASK_TIMEOUT_S) -> dict[str, int] | None:
    """``peer``'s sightings (:func:`serve_seen`), or None (no answer within ``timeout_s``, or not a valid one)."""

    async def seen(reader: asyncio.StreamReader) -> dict[str, int] | None:
        data = b""
        while len(data) <= SEEN_MAX_BYTES and (chunk := await reader.read(SEEN_MAX_BYTES + 1 - len(data))):
            data += chunk
        return parse_seen(data)

    return await _call(p2p, peer, seen_handler_name(run_id), timeout_s, seen)
