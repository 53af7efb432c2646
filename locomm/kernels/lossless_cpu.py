"""Numba CPU kernels of the lossless exponent coder: launchers over arrays, both stream layouts.

Notable:
- A float word splits as ``sym = (w >> s) & 0xFF`` (the 8-bit symbol: the
  exponent, or for fp16 the top byte) and ``raw`` = the other bits, packed
  into ``nraw`` little-endian bytes.
- A chunk's symbols are coded as independent *lanes*, each an MSB-first bit
  stream padded to a byte. Lane k holds elements ``first[k] + t * stride``
  for ``t < count[k]``: the caller's plan says which (contiguous quarters,
  stride 1, in wire version 1; interleaved lanes, stride L, in version 2).
  Codes come "full" (an escape code then the symbol's 8 bits, <= 20 bits).
- The decoder works in two passes: the lanes' symbols into a per-thread
  byte buffer in element order, then one vectorized merge with the raw
  plane. Its table (:func:`multi_table`, derived from the one-symbol table
  and cached) gives up to 3 symbols per 12-bit lookup; every step takes two
  lookups from one unaligned 8-byte load at the lane's bit position (no
  refill branch), and four lanes advance in lock-step through an inlined
  step function, their states in scalar locals (registers): four
  independent dependency chains. Indices are unsigned so numba adds no
  negative-index wraparound (LLVM then fuses the 8 byte loads into one
  ``movbe``), and the kernels run with ``_nrt=False``: they allocate
  nothing, and the reference counting numba would add around every inlined
  call is what made an earlier lock-step loop slower than one lane at a time.
- The encoder takes one lane at a time, its bit buffer in registers.
- No ``prange``: the codec already codes chunks in parallel from a thread
  pool (``nogil=True``), and numba's default threading layer (workqueue)
  aborts when parallel kernels are launched from several threads at once.
- The decoder is memory-safe for ANY input bytes: the lane plan is checked
  against the arrays first, every 8-byte load lies inside ``stream`` (near
  its end bytes past it read as zeros; a load may see the next lane's
  bytes, which only an overrunning lane uses and its end check reports),
  table indices are masked, and a step writes only slots of its own lane
  that lie before the lane's last element. Numba does no bounds checking of
  its own, so this holds by construction.
- ``cache=True`` keeps the compiled code in ``__pycache__`` (or numba's user
  cache): only the first process on a machine pays the JIT, about a second
  per kernel and word width.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
from numba import njit

from locomm.kernels import StreamError

TABLE_BITS = 12
"""Width of the one-level decode table these kernels index (entries ``(sym << 4) | length``)."""

U8 = np.uint64(8)
U16 = np.uint64(16)
U24 = np.uint64(24)
U32 = np.uint64(32)
U255 = np.uint64(0xFF)
U52 = np.uint64(64 - TABLE_BITS)
U56 = np.uint64(56)
TMASK = np.uint64((1 << TABLE_BITS) - 1)


@njit(cache=True, nogil=True)
def _sym_hist(words: np.ndarray, s: int, hist: np.ndarray) -> None:  # pragma: no cover - jitted
    n = words.size
    part = np.zeros((4, 256), dtype=np.int64)  # 4 partial histograms: repeats of one symbol don't serialize
    m = n - n % 4
    for i in range(0, m, 4):
        part[0, (np.uint32(words[i]) >> s) & 0xFF] += 1
        part[1, (np.uint32(words[i + 1]) >> s) & 0xFF] += 1
        part[2, (np.uint32(words[i + 2]) >> s) & 0xFF] += 1
        part[3, (np.uint32(words[i + 3]) >> s) & 0xFF] += 1
    for i in range(m, n):
        part[0, (np.uint32(words[i]) >> s) & 0xFF] += 1
    for b in range(256):
        hist[b] += part[0, b] + part[1, b] + part[2, b] + part[3, b]


def sym_hist(words: np.ndarray, s: int) -> np.ndarray:
    """The 256-bin histogram (int64) of the symbols ``(w >> s) & 0xFF`` of ``words``."""
    hist = np.zeros(256, dtype=np.int64)
    _sym_hist(words, s, hist)
    return hist


@njit(cache=True, nogil=True)
def split(words: np.ndarray, s: int, nraw: int, raw: np.ndarray, syms: np.ndarray) -> None:  # pragma: no cover
    """The raw plane (every word's bits but its symbol, ``nraw`` little-endian bytes) into ``raw``, and
    the symbols into ``syms`` when it is not empty."""
    lowmask = np.uint32((1 << s) - 1)
    keep = syms.size > 0
    for i in range(words.size):
        w = np.uint32(words[i])
        r = ((w >> (s + 8)) << s) | (w & lowmask)
        if nraw == 1:
            raw[i] = np.uint8(r)
        else:
            raw[3 * i] = np.uint8(r & 0xFF)
            raw[3 * i + 1] = np.uint8((r >> 8) & 0xFF)
            raw[3 * i + 2] = np.uint8((r >> 16) & 0xFF)
        if keep:
            syms[i] = np.uint8((w >> s) & 0xFF)


@njit(inline="always")
def _word(
    sym: np.uint32, raw: np.ndarray, i: int, s: int, nraw: int, lowmask: np.uint32
) -> np.uint32:  # pragma: no cover
    if nraw == 1:
        r = np.uint32(raw[i])
    else:
        r = np.uint32(raw[3 * i]) | (np.uint32(raw[3 * i + 1]) << 8) | (np.uint32(raw[3 * i + 2]) << 16)
    return ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)


@njit(cache=True, nogil=True)
def merge(
    syms: np.ndarray, sym_stride: int, raw: np.ndarray, s: int, nraw: int, out: np.ndarray
) -> None:  # pragma: no cover - jitted
    """out[i] = the word of symbol ``syms[i * sym_stride]`` and raw bits ``raw[i]`` (stride 0: one symbol).

    One loop per (stride, raw width) so that each is a plain vectorizable loop.
    """
    lowmask = np.uint32((1 << s) - 1)
    if sym_stride == 1 and nraw == 1:
        for i in range(out.size):
            out[i] = _word(np.uint32(syms[i]), raw, i, s, 1, lowmask)
    elif sym_stride == 1:
        for i in range(out.size):
            out[i] = _word(np.uint32(syms[i]), raw, i, s, 3, lowmask)
    elif sym_stride == 0 and nraw == 1:
        sym = np.uint32(syms[0])
        for i in range(out.size):
            out[i] = _word(sym, raw, i, s, 1, lowmask)
    else:
        for i in range(out.size):
            out[i] = _word(np.uint32(syms[i * sym_stride]), raw, i, s, nraw, lowmask)


@njit(cache=True, nogil=True)
def encode_lanes(
    words: np.ndarray,
    s: int,
    code_full: np.ndarray,
    len_full: np.ndarray,
    first: np.ndarray,
    count: np.ndarray,
    stride: int,
    sizes: np.ndarray,
    stream: np.ndarray,
) -> int:  # pragma: no cover - jitted
    """Code the symbols of ``words`` as lanes written one after another into ``stream``.

    Lane k codes ``words[first[k] + t * stride]``, ``t < count[k]``; its byte
    size goes to ``sizes[k]``. Returns the bytes used. ``stream`` must hold
    ``ceil(20 n / 8) + lanes`` bytes. Lane by lane: encoding has no long
    dependency chain to hide, and the bit accumulator stays in registers.
    """
    p = 0
    for k in range(first.size):
        start = p
        acc = np.uint64(0)
        nb = 0
        i = first[k]
        for _ in range(count[k]):
            sym = (np.uint32(words[i]) >> s) & np.uint32(0xFF)
            ln = np.int64(len_full[sym])
            acc = (acc << np.uint64(ln)) | np.uint64(code_full[sym])
            nb += ln
            if nb >= 32:
                nb -= 32
                v = acc >> np.uint64(nb)
                stream[p] = np.uint8((v >> U24) & U255)
                stream[p + 1] = np.uint8((v >> U16) & U255)
                stream[p + 2] = np.uint8((v >> U8) & U255)
                stream[p + 3] = np.uint8(v & U255)
                p += 4
            i += stride
        while nb > 0:
            if nb >= 8:
                nb -= 8
                stream[p] = np.uint8((acc >> np.uint64(nb)) & U255)
            else:
                stream[p] = np.uint8((acc << np.uint64(8 - nb)) & U255)
                nb = 0
            p += 1
        sizes[k] = p - start
    return p


@njit(cache=True, nogil=True)
def _multi_table(dec: np.ndarray, m: np.ndarray) -> None:  # pragma: no cover - jitted
    """From the one-symbol table ``dec`` (entries ``(sym << 4) | length``), entries of up to 3 symbols.

    Entry bits: 0-3 the code bits it consumes, 4-5 its symbol count, 7 "special"
    (an escape: 8 literal bits follow; with 0 bits, no code), 8-31 the symbols.
    A later code joins the entry when it ends inside the window and is no escape.
    """
    mask = (1 << TABLE_BITS) - 1
    for idx in range(1 << TABLE_BITS):
        e = np.int64(dec[idx])
        ln = e & 15
        if ln == 0 or e >> 4 == 256:
            m[idx] = 0x90 | ln
            continue
        word = (e >> 4) << 8
        cnt = 1
        while cnt < 3:
            e2 = np.int64(dec[(idx << ln) & mask])  # the code that starts after ``ln`` bits, if it fits
            l2 = e2 & 15
            if l2 == 0 or e2 >> 4 == 256 or ln + l2 > TABLE_BITS:
                break
            word |= (e2 >> 4) << (8 + 8 * cnt)
            ln += l2
            cnt += 1
        m[idx] = np.uint32(word | (cnt << 4) | ln)


@njit(inline="always")
def _load(stream: np.ndarray, byte: int) -> np.uint64:  # pragma: no cover - jitted
    """8 stream bytes from ``byte``, big-endian. Unsigned indices: numba adds no negative-index
    wraparound, and LLVM fuses the eight loads into one ``movbe``."""
    b = np.uint64(byte)
    acc = np.uint64(0)
    for j in range(8):
        acc = (acc << U8) | np.uint64(stream[b + np.uint64(j)])
    return acc


@njit(inline="always")
def _load_safe(stream: np.ndarray, byte: int) -> np.uint64:  # pragma: no cover - jitted
    """:func:`_load` near the end of ``stream``: zeros past it."""
    acc = np.uint64(0)
    for j in range(8):
        c = np.uint64(0)
        if byte + j < stream.size:
            c = np.uint64(stream[np.uint64(byte + j)])
        acc = (acc << U8) | c
    return acc


@njit(inline="always")
def _look(acc: np.uint64, m: np.ndarray, syms: np.ndarray, o: int, st: int, bad: bool):  # pragma: no cover
    """One lookup at the top of ``acc``: up to 3 symbols to ``syms[o + j * st]`` (always 3 written,
    so the caller keeps 3 slots of the lane ahead). Returns (acc, bits, o, bad)."""
    e = m[acc >> U52]
    ln = np.int64(e & 15)
    if e & 0x80:  # rare: an escape (its literal is the next 8 bits) or no code at all
        bad |= ln == 0
        e = (e & np.uint32(0xFF)) | (np.uint32((acc << np.uint64(ln)) >> U56) << 8)
        ln += 8
    syms[np.uint64(o)] = e >> 8
    syms[np.uint64(o + st)] = e >> 16
    syms[np.uint64(o + 2 * st)] = e >> 24
    return acc << np.uint64(ln), ln, o + st * np.int64((e >> 4) & 3), bad


@njit(inline="always")
def _step(stream: np.ndarray, bp: int, o: int, st: int, m: np.ndarray, syms: np.ndarray, bad: bool):  # pragma: no cover
    """Two lookups from one 8-byte load at bit ``bp``: at most 40 of its >= 57 fresh bits, 2 to 6 symbols."""
    acc = _load(stream, bp >> 3) << np.uint64(bp & 7)
    acc, l1, o, bad = _look(acc, m, syms, o, st, bad)
    acc, l2, o, bad = _look(acc, m, syms, o, st, bad)
    return bp + l1 + l2, o, bad


@njit(inline="always")
def _room(bp: int, o: int, last: int, st: int, size: int) -> int:  # pragma: no cover - jitted
    """Steps a lane surely has room for: 6 symbols each up to its ``last`` element, 40 bits each with
    the 8-byte loads inside ``stream`` (they may read the next lane's bytes: never used unless the lane
    overruns, which its end check reports)."""
    return min(((last - o) // st + 1) // 6, (size * 8 - 64 - bp) // 40)


@njit(inline="always")
def _lane_end(bp: int, start: int, end: int) -> int:  # pragma: no cover - jitted
    """0 when a lane's codes ended in its last byte; 2 past it, 3 before it."""
    consumed = bp - start * 8
    if consumed > (end - start) * 8:
        return 2
    if (consumed + 7) // 8 != end - start:
        return 3
    return 0


@njit(cache=True, nogil=True, _nrt=False)
def _finish_lane(
    stream: np.ndarray,
    start: int,
    end: int,
    bp: int,
    o: int,
    last: int,
    st: int,
    m: np.ndarray,
    dec: np.ndarray,
    syms: np.ndarray,
) -> int:  # pragma: no cover - jitted
    """Finish one lane from bit ``bp`` and element ``o``: whole steps while they fit, then one code at
    a time (bounds-checked loads) up to its ``last`` element, then its end check. Returns 0 or an error."""
    bad = False
    n = _room(bp, o, last, st, stream.size)
    while n > 0:
        for _ in range(n):
            bp, o, bad = _step(stream, bp, o, st, m, syms, bad)
        n = _room(bp, o, last, st, stream.size)
    if bad:
        return 1
    while o <= last:
        acc = _load_safe(stream, bp >> 3) << np.uint64(bp & 7)
        e = dec[acc >> U52]
        ln = np.int64(e & 15)
        if ln == 0:
            return 1
        sym = np.uint32(e >> 4)
        if sym == 256:
            sym = np.uint32((acc << np.uint64(ln)) >> U56)
            ln += 8
        syms[np.uint64(o)] = sym
        bp += ln
        o += st
    return _lane_end(bp, start, end)


@njit(cache=True, nogil=True, _nrt=False)
def _decode_syms(
    stream: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    first: np.ndarray,
    count: np.ndarray,
    stride: int,
    dec: np.ndarray,
    m: np.ndarray,
    syms: np.ndarray,
) -> int:  # pragma: no cover - jitted
    """The lanes' symbols into ``syms`` (element order). ``_nrt=False``: nothing is allocated here, and
    numba's reference counting of the arrays passed to the inlined steps would cost more than the steps."""
    lanes = first.size
    for k in range(lanes):  # the plan must lie inside the arrays before anything is read
        if not (0 <= starts[k] <= ends[k] <= stream.size) or count[k] < 0:
            return -4
        if count[k] > 0 and not (0 <= first[k] and first[k] + (count[k] - 1) * stride < syms.size):
            return -4
    st = np.int64(stride)
    size = stream.size
    for k in range(0, lanes - lanes % 4, 4):  # four lanes in lock-step, their state in registers
        bp0, bp1, bp2, bp3 = starts[k] * 8, starts[k + 1] * 8, starts[k + 2] * 8, starts[k + 3] * 8
        o0, o1, o2, o3 = first[k], first[k + 1], first[k + 2], first[k + 3]
        z0, z1 = o0 + (count[k] - 1) * st, o1 + (count[k + 1] - 1) * st  # the lanes' last elements
        z2, z3 = o2 + (count[k + 2] - 1) * st, o3 + (count[k + 3] - 1) * st
        bad = False
        while True:
            n = min(
                min(_room(bp0, o0, z0, st, size), _room(bp1, o1, z1, st, size)),
                min(_room(bp2, o2, z2, st, size), _room(bp3, o3, z3, st, size)),
            )
            if n <= 0:
                break
            for _ in range(n):
                bp0, o0, bad = _step(stream, bp0, o0, st, m, syms, bad)
                bp1, o1, bad = _step(stream, bp1, o1, st, m, syms, bad)
                bp2, o2, bad = _step(stream, bp2, o2, st, m, syms, bad)
                bp3, o3, bad = _step(stream, bp3, o3, st, m, syms, bad)
        if bad:
            return -1
        for j, bp, o, z in ((0, bp0, o0, z0), (1, bp1, o1, z1), (2, bp2, o2, z2), (3, bp3, o3, z3)):
            rc = _finish_lane(stream, starts[k + j], ends[k + j], bp, o, z, st, m, dec, syms)
            if rc:
                return -rc
    for k in range(lanes - lanes % 4, lanes):
        z = first[k] + (count[k] - 1) * st
        rc = _finish_lane(stream, starts[k], ends[k], starts[k] * 8, first[k], z, st, m, dec, syms)
        if rc:
            return -rc
    return 0


def decode_lanes(
    stream: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    first: np.ndarray,
    count: np.ndarray,
    stride: int,
    raw: np.ndarray,
    s: int,
    nraw: int,
    table: np.ndarray,
    out: np.ndarray,
) -> None:
    """Decode lane streams into ``out``, merging each symbol with its raw bits.

    Lane k is ``stream[starts[k]:ends[k]]`` and holds elements
    ``first[k] + t * stride``, ``t < count[k]`` (int64 arrays). ``table`` has
    ``2**TABLE_BITS`` entries ``(sym << 4) | length``, length 0 marking a bit
    pattern that is no code and symbol 256 an escape (8 literal bits
    follow). ``raw`` holds ``nraw`` bytes per element of ``out``.

    Raises:
        StreamError: an invalid code, a lane that runs past its end or leaves
            bytes unread, or a plan outside the arrays.
    """
    if raw.size < nraw * out.size:
        raise StreamError(4)
    syms = _scratch(out.size)
    rc = _decode_syms(stream, starts, ends, first, count, stride, table, multi_table(table), syms)
    if rc != 0:
        raise StreamError(-rc)
    merge(syms, 1, raw, s, nraw, out)


@functools.lru_cache(maxsize=64)
def _multi_cached(dec: bytes) -> np.ndarray:
    m = np.empty(1 << TABLE_BITS, dtype=np.uint32)
    _multi_table(np.frombuffer(dec, dtype=np.uint16), m)
    m.flags.writeable = False
    return m


def multi_table(table: np.ndarray) -> np.ndarray:
    """The multi-symbol decode table (uint32, cached) of a one-symbol table of ``2**TABLE_BITS`` entries."""
    if table.shape != (1 << TABLE_BITS,):
        raise StreamError(4)
    return _multi_cached(table.astype(np.uint16, copy=False).tobytes())


_SCRATCH_KEEP = 1 << 22
_local = threading.local()


def _scratch(n: int) -> np.ndarray:
    """A per-thread symbol buffer of ``n`` bytes, kept between calls up to ``_SCRATCH_KEEP``."""
    buf = getattr(_local, "syms", None)
    if buf is None or buf.size < n:
        buf = np.empty(n, dtype=np.uint8)
        if n <= _SCRATCH_KEEP:
            _local.syms = buf
    return buf[:n]


__all__ = ["TABLE_BITS", "decode_lanes", "encode_lanes", "merge", "multi_table", "split", "sym_hist"]
