"""Seeing a peer alive: the smallest stream there is, both ways (what it proves: ``protocol/sightings.py``).

``locomm.{run}.hello`` answers one byte and closes. Opening it to a peer id makes libp2p's secure channel check
that whoever answers holds that id's private key, so a completed hello is that identity, live, now; the one who
opened it is proven alike to the one who answers (``on_sight`` is called with its id). Nothing is read from the
opener, so the handler holds nothing and costs one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from hivemind.p2p import P2P, PeerID

ASK_TIMEOUT_S = 10.0
"""A hello unanswered by then is a miss (a dial through a relay on a slow link takes a few seconds)."""
ANSWER = b"\x01"


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
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler_name(run_id))
            return await reader.readexactly(1) == ANSWER
    except asyncio.CancelledError:
        raise
    except (Exception, TimeoutError):  # noqa: BLE001 - p2pd reports dial failures in several ways
        return False
    finally:
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.close()
