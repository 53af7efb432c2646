"""Async framing over hivemind P2P binary streams, and tensor (de)serialization.

Each message is one frame (see protocol/messages.py); every read is bounded by a
timeout and by the size the validated header declared, so a peer that stalls or
lies about sizes costs at most one timeout and never an unbounded allocation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from locomm.protocol.messages import (HEADER_LEN, ErrorCode, ProtocolViolation, TensorEntry, TensorSpec,
                                      decode_header, pack_frame, read_header_length)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


async def read_header(reader: asyncio.StreamReader, timeout: float) -> dict[str, Any]:
    try:
        prefix = await asyncio.wait_for(reader.readexactly(HEADER_LEN.size), timeout)
        n = read_header_length(prefix)
        raw = await asyncio.wait_for(reader.readexactly(n), timeout)
    except asyncio.IncompleteReadError:
        raise ProtocolViolation(ErrorCode.MALFORMED, "stream ended inside a header") from None
    except asyncio.TimeoutError:
        raise ProtocolViolation(ErrorCode.MALFORMED, "timed out reading a header") from None
    return decode_header(raw)


async def read_exact(reader: asyncio.StreamReader, n: int, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(n), timeout)
    except asyncio.IncompleteReadError:
        raise ProtocolViolation(ErrorCode.MALFORMED, f"stream ended before {n} body bytes") from None
    except asyncio.TimeoutError:
        raise ProtocolViolation(ErrorCode.MALFORMED, "timed out reading a body") from None


async def write_frame(writer: asyncio.StreamWriter, header: Mapping[str, Any], body: Sequence[bytes] = ()) -> None:
    writer.write(pack_frame(header))
    for part in body:
        # Large parts go in slices so the transport never holds a second full copy.
        view = memoryview(part)
        for off in range(0, len(view), 1 << 20):
            writer.write(view[off:off + (1 << 20)])
            await writer.drain()
    await writer.drain()


class TensorCoder:
    """Encodes payload tensors for the wire with one codec ('none' = raw little-endian bytes)."""

    def __init__(self, codec: str = "none") -> None:
        self.name = codec
        self._codec: Any = None
        if codec != "none":
            from locomm.compression import get_codec  # noqa: PLC0415

            self._codec = get_codec(codec)

    def encode(self, t: torch.Tensor) -> bytes:
        t = t.detach().to("cpu", torch.float32).contiguous()
        if self._codec is None:
            return t.numpy().tobytes()
        return self._codec.encode(t)

    def decode(self, entry: TensorEntry, data: bytes, spec: TensorSpec) -> torch.Tensor:
        """Decode and check shape and finiteness; raises ProtocolViolation."""
        if entry.codec != self.name:
            raise ProtocolViolation(ErrorCode.MALFORMED, f"{entry.name}: codec {entry.codec}, run uses {self.name}")
        if self._codec is None:
            if len(data) != spec.numel * 4:
                raise ProtocolViolation(ErrorCode.BAD_SHAPE, f"{entry.name}: {len(data)} bytes for {spec.shape}")
            t = torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy()).reshape(spec.shape)
        else:
            try:
                t = self._codec.decode(data)
            except Exception as e:  # the codec's own error type: a bad payload, not our crash
                raise ProtocolViolation(ErrorCode.BAD_PAYLOAD, f"{entry.name}: {e}") from None
            if tuple(t.shape) != spec.shape and t.numel() == spec.numel:
                t = t.reshape(spec.shape)
            if tuple(t.shape) != spec.shape:
                raise ProtocolViolation(ErrorCode.BAD_SHAPE, f"{entry.name}: decoded {tuple(t.shape)}, want {spec.shape}")
            t = t.float()
        if not torch.isfinite(t).all():
            raise ProtocolViolation(ErrorCode.NOT_FINITE, f"{entry.name}: non-finite values")
        return t
