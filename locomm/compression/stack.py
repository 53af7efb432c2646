"""Codec stacks: lossy stages first, then the lossless coder on the floats that remain.

``CodecStack([a, b, c])`` encodes ``x`` as: ``a.encode_parts(x)`` -> (meta,
float parts); each part goes through the rest of the stack (``b`` then
``c``); the last codec's ``encode`` finishes each part. ``"bf16+lossless"``
is ``CodecStack([Bf16Codec(), LosslessCodec()])``. Only the outermost payload
is sealed with the stack's own magic and CRC (the last codec seals its own).
Context such as ``tokens=`` is passed to every stage; stages ignore what
they do not use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from locomm.compression.base import Codec, CodecError, PartsCodec, Reader, Writer, seal, unseal

_MAX_PARTS = 16


class CodecStack(Codec):
    """Apply codecs in order; every codec but the last must be a :class:`PartsCodec`."""

    name: ClassVar[str] = "stack"
    magic: ClassVar[bytes] = b"LCST"

    def __init__(self, codecs: Sequence[Codec]) -> None:
        if not codecs:
            raise ValueError("a codec stack needs at least one codec")
        for c in codecs[:-1]:
            if not isinstance(c, PartsCodec):
                raise ValueError(f"{c!r} cannot be followed by another codec (only lossy stages can)")
        self.codecs = list(codecs)

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return all(c.lossless for c in self.codecs)

    @property
    def spec(self) -> str:
        return "+".join(c.name for c in self.codecs)

    def __repr__(self) -> str:
        return f"CodecStack({self.codecs!r})"

    def encode(self, x: torch.Tensor, **context: Any) -> bytes:
        if len(self.codecs) == 1:
            return self.codecs[0].encode(x, **context)
        return seal(self.magic, self._enc(0, x, context))

    def decode(self, data: bytes | bytearray | memoryview, **context: Any) -> torch.Tensor:
        if len(self.codecs) == 1:
            return self.codecs[0].decode(data, **context)
        return self._dec(0, unseal(self.magic, data), context)

    def _enc(self, level: int, x: torch.Tensor, context: dict[str, Any]) -> bytes:
        codec = self.codecs[level]
        if level == len(self.codecs) - 1:
            return codec.encode(x, **context)
        assert isinstance(codec, PartsCodec)
        meta, parts = codec.encode_parts(x, **context)
        w = Writer()
        w.blob(meta)
        w.u8(len(parts))
        for p in parts:
            w.blob(self._enc(level + 1, p, context))
        return w.getvalue()

    def _dec(self, level: int, data: memoryview, context: dict[str, Any]) -> torch.Tensor:
        codec = self.codecs[level]
        if level == len(self.codecs) - 1:
            return codec.decode(data, **context)
        assert isinstance(codec, PartsCodec)
        r = Reader(data)
        meta = r.blob()
        n_parts = r.u8()
        if n_parts > _MAX_PARTS:
            raise CodecError(f"{n_parts} parts (limit {_MAX_PARTS})")
        parts = [self._dec(level + 1, r.blob(), context) for _ in range(n_parts)]
        r.expect_end()
        return codec.decode_parts(meta, parts, **context)
