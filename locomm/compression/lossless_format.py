"""The wire format of the ``lossless`` codec: layouts, modes, header, payload and chunk parsing, code tables.

One module that every implementation plans by: the codec's CPU path
(compression/lossless.py, numba kernels in locomm/kernels/lossless_cpu.py)
and its device path (compression/lossless_device.py, Triton kernels in
locomm/kernels/lossless.py). The kernels themselves see only arrays and
integers produced here.

Payload (little-endian)::

    "LCLS" | version u8 | dtype u8 | ndim u8 | shape u64*ndim | chunk_elems u32
    [version 2: lane_syms u32]
    then per chunk: chunk_len u32 | mode u8 | mode header | stream | raw plane
    then crc32 u32 over everything before it

Mode headers: ``CONST`` the symbol (u8); ``STORED`` nothing (then ``n``
symbol bytes); ``MODEL`` sigma (f32); ``EMPIRICAL`` 129 bytes of packed code
lengths. A coded chunk (``MODEL``/``EMPIRICAL``) then gives its lane stream
sizes: version 1, ``LANES`` (4) u32 for the contiguous quarters of the chunk;
version 2, one u16 per lane for L = ceil(n / lane_syms) interleaved lanes
(element i in lane i % L). Every lane stream is MSB-first, padded to a byte.

Parsing checks every field against the bytes present before anything is
allocated.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from typing import NamedTuple

import numpy as np
import torch

from locomm.compression import _huffman as hf
from locomm.compression.base import CodecError, Reader, Writer, code_dtype, dtype_code, numel_of

MAGIC = b"LCLS"

MODE_STORED, MODE_CONST, MODE_MODEL, MODE_EMPIRICAL = 0, 1, 2, 3

MAX_CHUNK_ELEMS = 1 << 26
"""Upper bound on ``chunk_elems`` so a chunk's byte length fits its u32 prefix."""

VERSION_LANES, VERSION_SEGMENTS = 1, 2
"""Version byte of the two stream layouts (the 4-lane one is the original wire version 1)."""

MAX_LANE_SYMS = 1 << 14
"""Upper bound on ``lane_syms``: a lane's byte size (at most 20 bits a symbol) fits its u16."""

LAYOUTS = {"lanes": VERSION_LANES, "segments": VERSION_SEGMENTS}

LANES = 4
"""Lane streams of a version-1 chunk (its contiguous quarters)."""

MAX_CODE_BITS = hf.TABLE_BITS + 8
"""Longest code of a version-2 stream: an escape code, then the symbol's 8 bits."""


class FloatLayout:
    """How one float dtype splits into (8-bit symbol, raw bits)."""

    def __init__(self, kind: str, word: type, s: int, nraw: int, top_byte: bool) -> None:
        self.kind = kind
        self.word = np.dtype(word)
        self.s = s  # first bit of the symbol
        self.nraw = nraw  # raw bytes per element
        self.top_byte = top_byte
        self.lowmask = (1 << s) - 1

    @functools.cached_property
    def sym_sq(self) -> np.ndarray:
        """E[x^2 | symbol] if values spread evenly over the symbol's range (0 for inf/NaN).

        Only feeds the starting point of the sigma search, so a rough value is fine.
        """
        sq = np.zeros(256, dtype=np.float64)
        bias = 15 if self.top_byte else 127
        for sym in range(256):
            if self.top_byte:
                e, m = (sym >> 2) & 31, sym & 3
                if e == 31:
                    continue
                lo = 2.0 ** (max(e, 1) - bias) * ((m / 4) if e == 0 else (1 + m / 4))
                hi = lo + 2.0 ** (max(e, 1) - bias) / 4
            else:
                if sym in (0, 255):
                    continue
                lo = 2.0 ** (sym - bias)
                hi = 2 * lo
            sq[sym] = (hi**3 - lo**3) / (3 * (hi - lo))
        return sq

    @functools.cached_property
    def sym_finite(self) -> np.ndarray:
        syms = np.arange(256)
        inf_nan = ((syms >> 2) & 31) == 31 if self.top_byte else syms == 255
        return (~inf_nan).astype(np.float64)

    def words_of(self, x: torch.Tensor) -> np.ndarray:
        """The tensor's bits as unsigned words (a view of a contiguous CPU tensor)."""
        t = x.view(torch.int16 if self.word.itemsize == 2 else torch.int32)
        return t.numpy().reshape(-1).view(self.word)


FLOAT_LAYOUTS: dict[torch.dtype, FloatLayout] = {
    torch.bfloat16: FloatLayout("bf16", np.uint16, 7, 1, False),
    torch.float16: FloatLayout("fp16", np.uint16, 8, 1, True),
    torch.float32: FloatLayout("fp32", np.uint32, 23, 3, False),
}

IDENTITY = hf.Table(np.array([8] * 256 + [0], dtype=np.int64))
"""8-bit identity code: STORED chunks go through the same kernels."""


def header(
    version: int, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size, chunk_elems: int, lane_syms: int
) -> bytes:
    """The payload's fixed header (magic, version, dtype, shape, chunk size[, lane size])."""
    w = Writer()
    w.raw(MAGIC + bytes([version]))
    w.u8(dtype_code(dtype))
    w.shape(shape)
    w.u32(chunk_elems)
    if version == VERSION_SEGMENTS:
        w.u32(lane_syms)
    return w.getvalue()


def n_lanes(n: int, lane_syms: int) -> int:
    """Lanes of an ``n``-element chunk in the segmented layout."""
    return max(1, -(-n // lane_syms))


@functools.lru_cache(maxsize=64)
def lane_plan(version: int, n: int, lane_syms: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The lanes of an ``n``-element coded chunk as (first element, element count, stride).

    Lane k holds elements ``first[k] + t * stride`` for ``t < count[k]``: in
    version 1 the contiguous quarters of the chunk (stride 1; some may be
    empty), in version 2 ``n_lanes`` interleaved lanes (stride L). The arrays
    are int64 and read-only (cached).
    """
    if version == VERSION_LANES:
        q = -(-n // LANES)
        first = np.minimum(np.arange(LANES, dtype=np.int64) * q, n)
        count = np.minimum(first + q, n) - first
        stride = 1
    else:
        stride = n_lanes(n, lane_syms)
        first = np.arange(stride, dtype=np.int64)
        count = np.maximum(n - first + stride - 1, 0) // stride
    first.flags.writeable = False
    count.flags.writeable = False
    return first, count, stride


def check_crc(mv: memoryview) -> None:
    """Raise :class:`CodecError` unless the payload's last 4 bytes are the CRC-32 of the rest."""
    (crc,) = struct.unpack("<I", mv[-4:])
    if zlib.crc32(mv[:-4]) != crc:
        raise CodecError("checksum mismatch: payload corrupted or truncated")


class Parsed(NamedTuple):
    """A checked payload, split into chunk spans (see :func:`parse`)."""

    mv: memoryview
    version: int
    dtype: torch.dtype
    layout: FloatLayout
    shape: tuple[int, ...]
    numel: int
    chunk_elems: int
    lane_syms: int
    spans: list[tuple[int, int, int]]


class Chunk(NamedTuple):
    """One chunk's header (see :func:`parse_chunk`); byte positions are absolute."""

    mode: int
    first: int
    n: int
    table: hf.Table | None
    sym: int  # CONST: the symbol
    offsets: np.ndarray  # coded: lane stream bounds (L + 1); STORED: [symbols, raw]
    raw0: int


def parse(data: bytes | bytearray | memoryview, check: bool = True, max_numel: int | None = None) -> Parsed:
    """Check a payload's frame and header and split it into chunks (nothing decoded yet).

    With ``check=False`` the caller checks the CRC itself (before it returns
    anything); every read here is bounds-checked either way. A shape of more
    than ``max_numel`` elements (the receiver's bound) is refused.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes-like, got {type(data).__name__}")
    mv = memoryview(data).cast("B")
    if len(mv) < len(MAGIC) + 1 + 4:
        raise CodecError(f"payload too short ({len(mv)} bytes)")
    if bytes(mv[:4]) != MAGIC:
        raise CodecError(f"bad magic {bytes(mv[:4])!r}, expected {MAGIC!r}")
    version = mv[4]
    if version not in (VERSION_LANES, VERSION_SEGMENTS):
        raise CodecError(f"unsupported wire version {version}")
    if check:
        check_crc(mv)
    r = Reader(mv, 5, len(mv) - 4)
    dtype = code_dtype(r.u8())
    if dtype not in FLOAT_LAYOUTS:
        raise CodecError(f"lossless payload claims unsupported dtype {dtype}")
    layout = FLOAT_LAYOUTS[dtype]
    shape = r.shape(max_numel)
    numel = numel_of(shape)
    chunk_elems = r.u32()
    if not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
        raise CodecError(f"bad chunk size {chunk_elems}")
    lane_syms = 0
    if version == VERSION_SEGMENTS:
        lane_syms = r.u32()
        if not 1 <= lane_syms <= MAX_LANE_SYMS:
            raise CodecError(f"bad lane size {lane_syms}")
    # Every element costs at least nraw bytes: refuse sizes the payload cannot hold
    # before allocating the output.
    if numel * layout.nraw > r.remaining:
        raise CodecError(f"shape {shape} needs at least {numel * layout.nraw} bytes, payload has {r.remaining}")
    n_chunks = -(-numel // chunk_elems)
    spans: list[tuple[int, int, int]] = []  # (first element, byte start, byte end)
    for c in range(n_chunks):
        ln = r.u32()
        start = r.pos
        r.take(ln)
        spans.append((c * chunk_elems, start, start + ln))
    r.expect_end()
    return Parsed(mv, version, dtype, layout, shape, numel, chunk_elems, lane_syms, spans)


def parse_chunk(p: Parsed, c: int) -> Chunk:
    """Parse chunk ``c``'s header: mode, table, lane and raw-plane positions (absolute in the payload)."""
    first, b0, b1 = p.spans[c]
    n = min(p.chunk_elems, p.numel - first)
    layout = p.layout
    r = Reader(p.mv, b0, b1)
    mode = r.u8()
    if mode == MODE_CONST:
        sym = r.u8()
        raw0 = r.pos
        r.take(n * layout.nraw)
        r.expect_end()
        return Chunk(mode, first, n, None, sym, np.zeros(1, dtype=np.int64), raw0)
    if mode == MODE_STORED:
        s0 = r.pos
        r.take(n)
        raw0 = r.pos
        r.take(n * layout.nraw)
        r.expect_end()
        return Chunk(mode, first, n, IDENTITY, 0, np.array([s0, raw0], dtype=np.int64), raw0)
    if mode not in (MODE_MODEL, MODE_EMPIRICAL):
        raise CodecError(f"unknown chunk mode {mode}")
    if mode == MODE_MODEL:
        sigma = r.f32()
        if not (math.isfinite(sigma) and sigma > 0):
            raise CodecError(f"bad model sigma {sigma}")
        q = hf.sigma_to_q(sigma)
        if not hf.Q_MIN <= q <= hf.Q_MAX or hf.q_to_sigma(q) != sigma:
            raise CodecError(f"model sigma {sigma} is not a quantized value")
        table = hf.model_table(layout.kind, q)
    else:
        table = hf.Table(hf.unpack_lengths(r.take(hf.PACKED_LENGTHS_BYTES)))
    if p.version == VERSION_LANES:
        sizes = np.array([r.u32() for _ in range(LANES)], dtype=np.int64)
    else:
        sizes = r.array(n_lanes(n, p.lane_syms), np.dtype("<u2")).astype(np.int64)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    offsets[0] = r.pos
    offsets[1:] = r.pos + np.cumsum(sizes)
    r.take(int(offsets[-1] - offsets[0]))
    raw0 = r.pos
    r.take(n * layout.nraw)
    r.expect_end()
    return Chunk(mode, first, n, table, 0, offsets, raw0)


@functools.lru_cache(maxsize=512)
def _full_codes_cached(key: bytes) -> tuple[np.ndarray, np.ndarray]:
    table = hf.Table(np.frombuffer(key, dtype=np.int64).copy())
    codes = table.enc_codes.astype(np.uint32)
    lens = table.enc_lens.astype(np.uint8)
    esc = lens == 0
    codes = np.where(esc, (np.uint32(table.esc_code) << np.uint32(8)) | np.arange(256, dtype=np.uint32), codes)
    lens = np.where(esc, np.uint8(table.esc_len + 8), lens)
    return codes.astype(np.uint32), lens.astype(np.uint8)


def full_codes(table: hf.Table) -> tuple[np.ndarray, np.ndarray]:
    """Per-symbol (code, length) with escapes folded in: ESC code then the symbol's 8 bits (<= 20 bits).

    Only valid for tables whose every symbol is coded or escapable (model
    tables have an escape, empirical ones code every used symbol).
    """
    return _full_codes_cached(table.lengths.astype(np.int64).tobytes())
