"""The codec interface, the error type, tensor roles and the shared wire helpers.

Notable:
- Every codec is an object with ``encode(tensor) -> bytes`` and
  ``decode(data) -> tensor``. Stateful codecs (error feedback, SCAPE masks) keep
  their state in the object; ``decode`` never touches sender state, so one
  object can serve as sender and receiver.
- Lossy codecs derive from :class:`PartsCodec`: they split a tensor into opaque
  metadata bytes plus a list of float tensors ("parts"). A
  :class:`~locomm.compression.stack.CodecStack` feeds those parts to the next
  codec (usually the lossless exponent coder); used alone, the parts are framed
  raw.
- ``decode(data, max_numel=N)``: the receiver's own bound on what it expects (from its layout, never
  from the payload). Every decoder reads its declared shapes through :meth:`Reader.shape` with that
  bound, so a payload that claims more is refused before anything of its claimed size is allocated;
  a stack passes the bound to every stage (no stage's part is larger than the tensor it rebuilds).
- Every payload is sealed by :func:`seal`: a 4-byte magic, a version byte, and
  a trailing CRC-32 over everything before it. :func:`unseal` checks both before
  any parsing, and :class:`Reader` bounds-checks every read, so malformed input
  raises :class:`CodecError` and nothing else.
"""

from __future__ import annotations

import enum
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

WIRE_VERSION = 1
"""Version byte written into every sealed payload."""

MAX_NDIM = 8
"""Largest tensor rank a payload may claim."""

MAX_NUMEL = 1 << 40
"""Largest element count a payload may claim (before the tighter size checks)."""

MAX_SPARSE_NUMEL = 1 << 28
"""Default cap on the dense size a sparse payload (scape, topk2bit) may claim:
their size cannot be bounded by the payload length, so this bounds the
allocation a hostile payload can cause (1 GiB of fp32)."""


class CodecError(ValueError):
    """A payload is truncated, corrupted, or otherwise cannot be decoded."""


class OversizeError(CodecError):
    """A payload declares more elements than the receiver's bound (``max_numel``): a shape error, refused
    before anything of the declared size is allocated."""


class TensorRole(enum.Enum):
    """What a tensor is, so a run spec can map each kind to a codec stack."""

    PARAMETER = "parameter"
    OUTER_GRADIENT = "outer_gradient"
    ACTIVATION = "activation"
    ACT_GRADIENT = "act_gradient"
    TOKENS = "tokens"
    """A stage boundary's token window: raw ids, no codec (:func:`~locomm.compression.choice.codec_choice`)."""


# dtype <-> one byte on the wire. Codes are part of the wire format: append only.
_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.uint8: 7,
}
_CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in _DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """The wire byte for ``dtype``.

    Raises:
        TypeError: ``dtype`` has no wire code.
    """
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported on the wire") from None


def code_dtype(code: int) -> torch.dtype:
    """The dtype for a wire byte; raises :class:`CodecError` for an unknown code."""
    try:
        return _CODE_DTYPES[code]
    except KeyError:
        raise CodecError(f"unknown dtype code {code}") from None


class Writer:
    """Append-only little-endian byte builder."""

    def __init__(self) -> None:
        self._parts: list[bytes | bytearray | memoryview] = []

    def u8(self, v: int) -> None:
        self._parts.append(struct.pack("<B", v))

    def u32(self, v: int) -> None:
        self._parts.append(struct.pack("<I", v))

    def u64(self, v: int) -> None:
        self._parts.append(struct.pack("<Q", v))

    def f32(self, v: float) -> None:
        self._parts.append(struct.pack("<f", v))

    def raw(self, b: bytes | bytearray | memoryview) -> None:
        self._parts.append(b)

    def blob(self, b: bytes | bytearray | memoryview) -> None:
        """A u64 length prefix, then the bytes."""
        self.u64(len(b))
        self._parts.append(b)

    def shape(self, shape: Sequence[int]) -> None:
        self.u8(len(shape))
        for s in shape:
            self.u64(int(s))

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class Reader:
    """Bounds-checked little-endian reader over a bytes-like object.

    Every method raises :class:`CodecError` instead of reading past the end,
    and :meth:`array` checks the byte count before anything is allocated.
    """

    def __init__(self, data: bytes | bytearray | memoryview, start: int = 0, end: int | None = None) -> None:
        self._mv = memoryview(data).cast("B")
        self.pos = start
        self.end = len(self._mv) if end is None else end

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, n: int) -> memoryview:
        if n < 0 or n > self.end - self.pos:
            raise CodecError(f"truncated payload: need {n} bytes at offset {self.pos}, have {self.end - self.pos}")
        out = self._mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def f32(self) -> float:
        return float(struct.unpack("<f", self.take(4))[0])

    def blob(self) -> memoryview:
        return self.take(self.u64())

    def shape(self, max_numel: int | None = None) -> tuple[int, ...]:
        """A declared shape; :class:`CodecError` if it claims more than ``max_numel`` elements (the receiver's
        bound) or than :data:`MAX_NUMEL`, before anything is allocated."""
        ndim = self.u8()
        if ndim > MAX_NDIM:
            raise CodecError(f"tensor rank {ndim} exceeds {MAX_NDIM}")
        shape = tuple(self.u64() for _ in range(ndim))
        numel = 1
        for s in shape:
            numel *= s
        if numel > MAX_NUMEL:
            raise CodecError(f"shape {shape} claims {numel} elements (limit {MAX_NUMEL})")
        check_numel(numel, max_numel, f"shape {shape}")
        return shape

    def array(self, count: int, dtype: np.dtype | type) -> np.ndarray:
        """``count`` items of ``dtype`` as a read-only view (no copy)."""
        dt = np.dtype(dtype)
        if count < 0 or count > MAX_NUMEL:
            raise CodecError(f"bad item count {count}")
        buf = self.take(count * dt.itemsize)
        return np.frombuffer(buf, dtype=dt)

    def expect_end(self) -> None:
        if self.pos != self.end:
            raise CodecError(f"{self.end - self.pos} unexpected trailing bytes")


def check_numel(numel: int, max_numel: int | None, what: str) -> None:
    """Refuse a declared element count above the receiver's bound (None: no bound given)."""
    if max_numel is not None and numel > max_numel:
        raise OversizeError(f"{what} claims {numel} elements, the receiver expects at most {max_numel}")


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def seal(magic: bytes, body: bytes | bytearray | memoryview) -> bytes:
    """Frame ``body`` as ``magic | version | body | crc32`` (CRC over all before it)."""
    head = magic + bytes([WIRE_VERSION])
    crc = zlib.crc32(body, zlib.crc32(head))
    return b"".join((head, body, struct.pack("<I", crc)))


def unseal(magic: bytes, data: bytes | bytearray | memoryview) -> memoryview:
    """Check magic, version and CRC-32 of a sealed payload; return the body.

    Raises:
        CodecError: wrong type, too short, wrong magic/version, or checksum mismatch.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes-like, got {type(data).__name__}")
    mv = memoryview(data).cast("B")
    head_len = len(magic) + 1
    if len(mv) < head_len + 4:
        raise CodecError(f"payload too short ({len(mv)} bytes)")
    if bytes(mv[: len(magic)]) != magic:
        raise CodecError(f"bad magic {bytes(mv[: len(magic)])!r}, expected {magic!r}")
    if mv[len(magic)] != WIRE_VERSION:
        raise CodecError(f"unsupported wire version {mv[len(magic)]} (this build speaks {WIRE_VERSION})")
    (crc,) = struct.unpack("<I", mv[-4:])
    if zlib.crc32(mv[:-4]) != crc:
        raise CodecError("checksum mismatch: payload corrupted or truncated")
    return mv[head_len:-4]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (CPU, contiguous), without a copy when possible."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def tensor_from_bytes(buf: memoryview | bytes, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A fresh tensor of ``dtype``/``shape`` copied from raw bytes (size already checked)."""
    n = numel_of(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(buf) != n * itemsize:
        raise CodecError(f"expected {n * itemsize} bytes for {tuple(shape)} {dtype}, got {len(buf)}")
    if dtype == torch.bfloat16:
        arr = np.frombuffer(buf, dtype=np.int16).copy()
        return torch.from_numpy(arr).view(torch.bfloat16).reshape(tuple(shape))
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    arr = np.frombuffer(buf, dtype=np_dtype).copy()
    return torch.from_numpy(arr).reshape(tuple(shape))


class Codec(ABC):
    """One compression step: ``encode(tensor) -> bytes``, ``decode(bytes) -> tensor``.

    Attributes:
        name: registry name of the codec.
        lossless: whether ``decode(encode(x))`` is bit-exact.
    """

    name: ClassVar[str] = "codec"
    lossless: ClassVar[bool] = False

    @abstractmethod
    def encode(self, x: torch.Tensor, **context: Any) -> bytes:
        """Encode ``x`` (any device; read on CPU). ``context`` carries codec-specific
        side inputs such as ``tokens=`` for the subspace codec."""

    @abstractmethod
    def decode(self, data: bytes | bytearray | memoryview, **context: Any) -> torch.Tensor:
        """Decode a payload made by :meth:`encode`; raises :class:`CodecError` on bad input.

        ``max_numel=N`` in ``context`` bounds every tensor the payload declares (module docstring)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PartsCodec(Codec):
    """A lossy codec whose payload is metadata bytes plus float tensors ("parts").

    Subclasses implement :meth:`encode_parts` / :meth:`decode_parts`; this class
    provides the standalone wire format (parts framed raw). Part dtypes and
    shapes are framed by the caller, so ``decode_parts`` must validate that the
    parts it gets have the shapes its metadata implies.
    """

    magic: ClassVar[bytes] = b"LCxx"

    @abstractmethod
    def encode_parts(self, x: torch.Tensor, **context: Any) -> tuple[bytes, list[torch.Tensor]]:
        """Split ``x`` into (metadata, float tensors)."""

    @abstractmethod
    def decode_parts(self, meta: memoryview, parts: list[torch.Tensor], **context: Any) -> torch.Tensor:
        """Rebuild the tensor from metadata and parts; raises :class:`CodecError`."""

    def encode(self, x: torch.Tensor, **context: Any) -> bytes:
        meta, parts = self.encode_parts(x, **context)
        w = Writer()
        w.blob(meta)
        w.u8(len(parts))
        for p in parts:
            w.u8(dtype_code(p.dtype))
            w.shape(p.shape)
            w.raw(tensor_bytes(p))
        return seal(self.magic, w.getvalue())

    def decode(
        self, data: bytes | bytearray | memoryview, max_numel: int | None = None, **context: Any
    ) -> torch.Tensor:
        r = Reader(unseal(self.magic, data))
        meta = r.blob()
        n_parts = r.u8()
        parts = []
        for _ in range(n_parts):
            dt = code_dtype(r.u8())
            shape = r.shape(max_numel)
            nbytes = numel_of(shape) * torch.empty((), dtype=dt).element_size()
            parts.append(tensor_from_bytes(r.take(nbytes), dt, shape))
        r.expect_end()
        return self.decode_parts(meta, parts, max_numel=max_numel, **context)


def check_part(
    parts: list[torch.Tensor], i: int, shape: Sequence[int], dtypes: Sequence[torch.dtype] | None = None
) -> torch.Tensor:
    """Return ``parts[i]`` after checking it exists and has the expected shape/dtype."""
    if i >= len(parts):
        raise CodecError(f"missing part {i} (got {len(parts)})")
    p = parts[i]
    if tuple(p.shape) != tuple(shape):
        raise CodecError(f"part {i} has shape {tuple(p.shape)}, expected {tuple(shape)}")
    if dtypes is not None and p.dtype not in dtypes:
        raise CodecError(f"part {i} has dtype {p.dtype}, expected one of {list(dtypes)}")
    return p


class SparsePartsCodec(PartsCodec):
    """A sparse :class:`PartsCodec` (``topk2bit``, ``topktiles``): its payload is (flat indices, values) of a
    dense tensor, which :meth:`_parse` reads and checks; decoding builds the tensor or returns the pairs."""

    @abstractmethod
    def _parse(
        self, meta: memoryview, parts: list[torch.Tensor], max_numel: int | None = None
    ) -> tuple[torch.dtype, tuple[int, ...], torch.Tensor, torch.Tensor]:
        """(dtype, shape, flat indices int64, fp32 values); raises :class:`CodecError` before allocating
        anything a payload claims past ``max_numel``."""

    def decode_parts(
        self,
        meta: memoryview,
        parts: list[torch.Tensor],
        device: str | torch.device | None = None,
        max_numel: int | None = None,
        **context: Any,
    ) -> torch.Tensor:
        """The dense tensor, built on ``device`` (default CPU)."""
        dtype, shape, idx, values = self._parse(meta, parts, max_numel)
        dev = torch.device("cpu") if device is None else torch.device(device)
        out = torch.zeros(numel_of(shape), dtype=torch.float32, device=dev)
        out.index_put_((idx.to(dev),), values.to(dev), accumulate=False)
        return out.reshape(shape).to(dtype)

    def decode_sparse(
        self, data: bytes | bytearray | memoryview, max_numel: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(flat indices int64, fp32 values, shape) of a standalone payload of at most ``max_numel`` elements."""
        r = Reader(unseal(self.magic, data))
        meta = r.blob()
        if r.u8() != 0:
            raise CodecError(f"{self.name} payload has unexpected float parts")
        r.expect_end()
        _, shape, idx, values = self._parse(meta, [], max_numel)
        return idx, values, shape
