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
from locomm.compression.payload import MAX_PART_ELEMS, Part, PayloadCodec, allowed_stack

HEADER_LEN = struct.Struct(">I")
PART_LEN = struct.Struct(">I")
"""Each part of a streamed body is framed as u32 big-endian length | bytes."""
MAX_HEADER_BYTES = 1 << 20
MAX_STREAMS = 16
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


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
    TIMEOUT = 13
    """A transfer stalled or fell below the floor rate: slowness, not a fault."""
    UNAUTHORIZED = 14
    """The sender is not allowed to use this service (not an admitted member, say): not a fault."""


FAULT_CODES = frozenset(
    {
        ErrorCode.BAD_VERSION,
        ErrorCode.WRONG_RUN,
        ErrorCode.MALFORMED,
        ErrorCode.TOO_LARGE,
        ErrorCode.UNEXPECTED_TENSOR,
        ErrorCode.BAD_SHAPE,
        ErrorCode.BAD_PAYLOAD,
        ErrorCode.NOT_FINITE,
    }
)
"""Violations that count against the sender; slowness, refusals and our own errors never do."""


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
        raise ProtocolViolation(
            ErrorCode.TOO_LARGE if n else ErrorCode.MALFORMED, f"header length {n} outside (0, {MAX_HEADER_BYTES}]"
        )
    return n


def decode_header(raw: bytes) -> dict[str, Any]:
    try:
        h = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=100_000,
            max_map_len=100_000,
            max_str_len=MAX_HEADER_BYTES,
        )
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


def validate_header(
    h: Mapping[str, Any],
    *,
    run_id: str,
    expected: Mapping[str, TensorSpec] | None,
    max_body_bytes: int,
    types: tuple[str, ...],
) -> Message:
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
        if not allowed_stack(codec):
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


# ---------------------------------------------------------------- request builders and validators


def envelope(run_id: str, mtype: str, round_idx: int, sender: str, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "run": run_id, "type": mtype, "round": round_idx, "sender": sender, **fields}


@dataclass(frozen=True)
class Transfer:
    """A validated push stream (or pull answer): which parts of the run's payload layout it carries."""

    xfer: int
    stream: int
    streams: int
    enc: dict[str, int]
    """Byte length of each value the algorithm encoded itself."""
    parts: tuple[Part, ...]

    def max_bytes(self, codec: PayloadCodec) -> int:
        return sum(codec.max_part_bytes(p) + PART_LEN.size for p in self.parts)


def transfer_fields(xfer: int, stream: int, streams: int, enc: Mapping[str, int], parts: list[Part]) -> dict[str, Any]:
    return {
        "xfer": xfer,
        "stream": stream,
        "streams": streams,
        "enc": dict(enc),
        "parts": [[p.tensor, p.start, p.count] for p in parts],
    }


def check_round(round_idx: int, current: int, window: int, receive_window: int) -> None:
    """Refuse a payload of ``round_idx`` at a receiver in round ``current``: far off (``window``), applied
    already (a refusal: the sender moves on), or not open yet (the sender retries)."""
    if abs(round_idx - current) > window:
        raise ProtocolViolation(ErrorCode.STALE_ROUND, f"round {round_idx}, we are at {current}")
    if round_idx < current - receive_window:
        raise ProtocolViolation(ErrorCode.STALE_ROUND, f"round {round_idx} is over here (we are at {current})")
    if round_idx > current + receive_window:
        raise ProtocolViolation(ErrorCode.NOT_READY, f"round {round_idx} is not open yet (we are at {current})")


def validate_transfer(fields: Mapping[str, Any], codec: PayloadCodec, max_body_bytes: int) -> Transfer:
    """Check a transfer's layout against the run's payload layout; nothing is allocated here."""
    xfer, stream, streams = _field(fields, "xfer", int), _field(fields, "stream", int), _field(fields, "streams", int)
    if not 1 <= streams <= MAX_STREAMS or not 0 <= stream < streams:
        raise ProtocolViolation(ErrorCode.MALFORMED, f"stream {stream} of {streams}")
    enc = fields.get("enc")
    want_enc = {t.name: t for t in codec.tensors if t.encoded}
    if not isinstance(enc, dict) or set(enc) != set(want_enc):
        raise ProtocolViolation(ErrorCode.UNEXPECTED_TENSOR, "encoded values do not match the run's payload")
    for name, n in enc.items():
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= want_enc[name].max_bytes():
            raise ProtocolViolation(ErrorCode.TOO_LARGE, f"{name}: {n!r} bytes is more than it can take")
    raw = fields.get("parts")
    if not isinstance(raw, list) or not raw:
        raise ProtocolViolation(ErrorCode.MALFORMED, "'parts' is not a non-empty list")
    canonical = set(codec.parts(enc))
    parts: list[Part] = []
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in item)
        ):
            raise ProtocolViolation(ErrorCode.MALFORMED, "a part is not [tensor, start, count]")
        part = Part(*item)
        if part not in canonical or part.count > MAX_PART_ELEMS * 4:
            raise ProtocolViolation(ErrorCode.BAD_SHAPE, f"part {item} is not in this run's payload layout")
        parts.append(part)
    if len(set(parts)) != len(parts):
        raise ProtocolViolation(ErrorCode.UNEXPECTED_TENSOR, "a part is listed twice")
    t = Transfer(xfer, stream, streams, {k: int(v) for k, v in enc.items()}, tuple(parts))
    if t.max_bytes(codec) > max_body_bytes:
        raise ProtocolViolation(
            ErrorCode.TOO_LARGE, f"transfer of up to {t.max_bytes(codec)} bytes exceeds the limit {max_body_bytes}"
        )
    return t


def push_header(
    run_id: str,
    round_idx: int,
    sender: str,
    xfer: int,
    stream: int,
    streams: int,
    enc: Mapping[str, int],
    parts: list[Part],
) -> dict[str, Any]:
    return envelope(run_id, "push", round_idx, sender, **transfer_fields(xfer, stream, streams, enc, parts))


def pull_header(run_id: str, round_idx: int, sender: str) -> dict[str, Any]:
    """Ask a partner for its payload of a round (a peer that cannot be dialled fetches what it cannot be sent)."""
    return envelope(run_id, "pull", round_idx, sender)


# ---------------------------------------------------------------- pipeline activation frames

STAGE_MESSAGES = ("fwd", "eval")
"""``fwd``: a training micro-batch (the answer carries dL/dh); ``eval``: forward only (the answer carries the loss)."""
TOKEN_BYTES = 2
"""Token ids travel as uint16."""


@dataclass(frozen=True)
class ActivationFrame:
    """A validated activation frame: which micro-batch, its shape, and the two parts that follow."""

    stage: int
    origin: str
    mb: int
    batch: int
    seq: int
    tokens_nbytes: int
    act_nbytes: int
    codec: str


def activation_header(
    run_id: str,
    sender: str,
    mtype: str,
    *,
    step: int,
    stage: int,
    origin: str,
    mb: int,
    batch: int,
    seq: int,
    codec: str,
    tokens_nbytes: int,
    act_nbytes: int,
) -> dict[str, Any]:
    """A micro-batch for ``stage``: the token window (B, T+1) as uint16, then the coded residual stream h."""
    return envelope(
        run_id,
        mtype,
        step,
        sender,
        stage=stage,
        origin=origin,
        mb=mb,
        batch=batch,
        seq=seq,
        tensors=[
            {"name": "tokens", "codec": "none", "nbytes": tokens_nbytes},
            {"name": "h", "codec": codec, "nbytes": act_nbytes},
        ],
    )


def validate_activation(
    msg: Message, *, stage: int, max_batch: int, max_seq: int, codec: str, max_act_bytes: int
) -> ActivationFrame:
    """Check an activation frame against this stage before anything is read or allocated.

    A frame for another stage is refused (NOT_READY: a stale route, not a fault); a shape outside the
    run's micro-batch, a token part of the wrong size or a foreign codec is the sender's fault.
    """
    f = msg.fields
    want_stage = _field(f, "stage", int)
    origin = _field(f, "origin", str)
    mb, batch, seq = _field(f, "mb", int), _field(f, "batch", int), _field(f, "seq", int)
    if want_stage != stage:
        raise ProtocolViolation(ErrorCode.NOT_READY, f"this peer serves stage {stage}, not {want_stage}")
    if mb < 0 or len(origin) > 256:
        raise ProtocolViolation(ErrorCode.MALFORMED, "bad micro-batch id or origin")
    if not 1 <= batch <= max_batch or not 1 <= seq <= max_seq:
        raise ProtocolViolation(ErrorCode.BAD_SHAPE, f"micro-batch {batch} x {seq} outside {max_batch} x {max_seq}")
    names = [t.name for t in msg.tensors]
    if names != ["tokens", "h"]:
        raise ProtocolViolation(ErrorCode.UNEXPECTED_TENSOR, f"an activation frame carries tokens, h; got {names}")
    tok, act = msg.tensors
    if tok.codec != "none" or tok.nbytes != batch * (seq + 1) * TOKEN_BYTES:
        raise ProtocolViolation(ErrorCode.BAD_SHAPE, f"token part of {tok.nbytes} bytes for {batch} x {seq + 1}")
    if act.codec != codec:
        raise ProtocolViolation(ErrorCode.MALFORMED, f"activation codec {act.codec!r}, this run sends {codec!r}")
    if not 0 < act.nbytes <= max_act_bytes:
        raise ProtocolViolation(ErrorCode.TOO_LARGE, f"activation of {act.nbytes} bytes, at most {max_act_bytes}")
    return ActivationFrame(stage, origin, mb, batch, seq, tok.nbytes, act.nbytes, codec)
