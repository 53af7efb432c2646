"""The versioned wire schema: frames, message headers, validation, error codes.

Sans-IO: functions here turn bytes into checked headers and back; the daemon does
the reading and writing. A frame is

    u32 big-endian header length | msgpack header | body (the tensors' bytes, in header order)

and a header is a msgpack map. Everything a peer sends is validated against the
run spec *before* any tensor is allocated: the protocol version, the run's spec
hash, the message type, each tensor's name, shape and dtype, the codec, and each
declared byte size against what that tensor can take. A violation is answered
with an :class:`ErrorCode` and the sender's fault is counted; the receiving peer
goes on training.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from locomm import PROTOCOL_VERSION

HEADER_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 20
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
ALLOWED_CODECS = {"none", "lossless", "fp16", "bf16", "blockwise8", "topk2bit"}


class ErrorCode(enum.IntEnum):
    OK = 0
    BAD_VERSION = 1
    WRONG_RUN = 2
    MALFORMED = 3
    TOO_LARGE = 4
    UNEXPECTED_TENSOR = 5
    BAD_SHAPE = 6
    BAD_PAYLOAD = 7
    NOT_FINITE = 8
    NOT_READY = 9
    STALE_ROUND = 10
    BANNED = 11
    INTERNAL = 12


class ProtocolViolation(Exception):
    """A message that breaks the schema; carries the code to answer with."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def max_encoded_bytes(self) -> int:
        """The most bytes any allowed codec may produce for this tensor (raw size plus framing slack)."""
        return int(self.numel * DTYPE_SIZES[self.dtype] * 1.1) + 65536


@dataclass(frozen=True)
class TensorEntry:
    name: str
    codec: str
    nbytes: int


@dataclass(frozen=True)
class Message:
    """A validated header."""

    type: str
    round: int
    sender: str
    fields: dict[str, Any]
    tensors: tuple[TensorEntry, ...]

    @property
    def body_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def pack_frame(header: Mapping[str, Any], body: bytes | None = None) -> bytes:
    h = msgpack.packb(dict(header), use_bin_type=True)
    return HEADER_LEN.pack(len(h)) + h + (body or b"")


def read_header_length(prefix: bytes) -> int:
    if len(prefix) != HEADER_LEN.size:
        raise ProtocolViolation(ErrorCode.MALFORMED, "truncated frame length")
    n = HEADER_LEN.unpack(prefix)[0]
    if n == 0 or n > MAX_HEADER_BYTES:
        raise ProtocolViolation(ErrorCode.TOO_LARGE if n else ErrorCode.MALFORMED,
                                f"header length {n} outside (0, {MAX_HEADER_BYTES}]")
    return n


def decode_header(raw: bytes) -> dict[str, Any]:
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0,
                            max_array_len=100_000, max_map_len=100_000, max_str_len=MAX_HEADER_BYTES)
    except Exception as e:  # msgpack raises several types on garbage; all mean the same to us
        raise ProtocolViolation(ErrorCode.MALFORMED, f"header is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(h, dict):
        raise ProtocolViolation(ErrorCode.MALFORMED, "header is not a map")
    return h


def _field(h: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    v = h.get(name)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise ProtocolViolation(ErrorCode.MALFORMED, f"field {name!r} missing or of the wrong type")
    return v


def validate_header(h: Mapping[str, Any], *, run_id: str, expected: Mapping[str, TensorSpec] | None,
                    max_body_bytes: int, types: tuple[str, ...]) -> Message:
    """Check a request header against the run; raises ProtocolViolation with the code to answer."""
    if h.get("v") != PROTOCOL_VERSION:
        raise ProtocolViolation(ErrorCode.BAD_VERSION, f"protocol version {h.get('v')!r}, expected {PROTOCOL_VERSION}")
    if h.get("run") != run_id:
        raise ProtocolViolation(ErrorCode.WRONG_RUN, "message is for another run spec")
    mtype = _field(h, "type", str)
    if mtype not in types:
        raise ProtocolViolation(ErrorCode.MALFORMED, f"unknown message type {mtype!r}")
    rnd = _field(h, "round", int)
    if rnd < 0:
        raise ProtocolViolation(ErrorCode.MALFORMED, "negative round")
    sender = _field(h, "sender", str)
    raw_tensors = h.get("tensors", [])
    if not isinstance(raw_tensors, list):
        raise ProtocolViolation(ErrorCode.MALFORMED, "'tensors' is not a list")
    entries: list[TensorEntry] = []
    seen: set[str] = set()
    total = 0
    for t in raw_tensors:
        if not isinstance(t, dict):
            raise ProtocolViolation(ErrorCode.MALFORMED, "tensor entry is not a map")
        name, codec, nbytes = _field(t, "name", str), _field(t, "codec", str), _field(t, "nbytes", int)
        if expected is not None and name not in expected:
            raise ProtocolViolation(ErrorCode.UNEXPECTED_TENSOR, f"tensor {name!r} is not in this run's payload")
        if name in seen:
            raise ProtocolViolation(ErrorCode.UNEXPECTED_TENSOR, f"tensor {name!r} sent twice")
        seen.add(name)
        if codec not in ALLOWED_CODECS:
            raise ProtocolViolation(ErrorCode.MALFORMED, f"codec {codec!r} is not allowed")
        if expected is not None:
            spec = expected[name]
            shape = t.get("shape")
            if shape is not None and tuple(shape) != spec.shape:
                raise ProtocolViolation(ErrorCode.BAD_SHAPE, f"{name}: shape {shape} != {list(spec.shape)}")
            if not 0 <= nbytes <= spec.max_encoded_bytes():
                raise ProtocolViolation(ErrorCode.TOO_LARGE, f"{name}: {nbytes} bytes is more than it can take")
        elif nbytes < 0:
            raise ProtocolViolation(ErrorCode.MALFORMED, f"{name}: negative size")
        total += nbytes
        entries.append(TensorEntry(name, codec, nbytes))
    if total > max_body_bytes:
        raise ProtocolViolation(ErrorCode.TOO_LARGE, f"message body {total} bytes exceeds the limit {max_body_bytes}")
    extra = {k: v for k, v in h.items() if k not in ("v", "run", "type", "round", "sender", "tensors")}
    return Message(type=mtype, round=rnd, sender=sender, fields=extra, tensors=tuple(entries))


def response_header(code: ErrorCode, message: str = "", **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "status": int(code), "msg": message, **fields}


def check_response(h: Mapping[str, Any]) -> ErrorCode:
    status = h.get("status")
    if not isinstance(status, int) or status not in ErrorCode._value2member_map_:
        raise ProtocolViolation(ErrorCode.MALFORMED, "response without a valid status")
    return ErrorCode(status)
