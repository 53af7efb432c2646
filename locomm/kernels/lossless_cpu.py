"""Numba CPU kernels of the lossless exponent coder: launchers over arrays, both stream layouts.

Notable:
- A float word splits as ``sym = (w >> s) & 0xFF`` (the 8-bit symbol: the exponent, or for fp16
  the top byte) and ``raw`` = the other bits, packed into ``nraw`` little-endian bytes.
- A chunk's symbols are coded as independent *lanes*, each an MSB-first bit stream padded to a
  byte. Lane k holds elements ``first[k] + t * stride`` for ``t < count[k]``: the caller's plan
  says which (contiguous quarters, stride 1, in wire version 1; interleaved lanes, stride L, in
  version 2). Codes come "full" (an escape code then the symbol's 8 bits, <= 20 bits).
- Both coders advance four lanes in lock-step through an inlined step function, the lanes'
  states in scalar locals (registers): four independent dependency chains, and for interleaved
  lanes neighbouring elements. The decoder's step takes two lookups of up to 3 symbols each
  (:func:`multi_table`) from one unaligned 8-byte load, with no refill branch; the encoder's
  takes two codes and one 8-byte store. The decoder writes symbols to a buffer, then vectorized
  :func:`merge` adds the raw plane; the encoder codes each of the four lanes into a region of
  its worst-case size, then moves it down.
- Indices are unsigned where it counts (numba then adds no negative-index wraparound, and LLVM
  fuses 8 byte loads or stores into one ``movbe``), and the coders run with ``_nrt=False``: they
  allocate nothing, and numba's reference counting around every inlined call cost more than the step.
- No ``prange``: the codec already codes chunks in parallel from a thread pool (``nogil=True``),
  and numba's default threading layer (workqueue) aborts when parallel kernels are launched from
  several threads at once.
- The decoder is memory-safe for ANY input bytes: the plan is checked against the arrays first,
  every load lies inside ``stream`` (zeros past its end; a load may see the next lane's bytes,
  which only an overrunning lane uses, and its end check reports that), table indices are 12
  bits, and a step writes only slots of its own lane before the lane's last element. Numba does
  no bounds checking of its own.
- ``cache=True`` keeps the compiled code in ``__pycache__``: only a machine's first process pays the JIT.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from locomm.kernels import StreamError

TABLE_BITS = 12
"""Width of the one-level decode table these kernels index (entries ``(sym << 4) | length``)."""

U8 = np.uint64(8)
U255 = np.uint64(0xFF)
U52 = np.uint64(64 - TABLE_BITS)
U56 = np.uint64(56)


@njit(cache=True, nogil=True)
def _sym_hist(words: np.ndarray, s: int, hist: np.ndarray) -> None:  # pragma: no cover - jitted
    n = words.size
    part = np.zeros((4, 256), dtype=np.int64)  # 4 partial histograms: repeats of one symbol don't serialize
    m = n - n % 4
    for i in range(0, m, 4):
        for j in range(4):
            part[j, (np.uint32(words[i + j]) >> s) & 0xFF] += 1
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
    if nraw == 1 and not keep:  # the coded chunks' case, on its own so that it vectorizes
        for i in range(words.size):
            raw[i] = np.uint8(((np.uint32(words[i]) >> (s + 8)) << s) | (np.uint32(words[i]) & lowmask))
        return
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
def _word(sym: np.uint32, raw: np.ndarray, i: int, s: int, nraw: int, lowmask: np.uint32):  # pragma: no cover
    if nraw == 1:
        r = np.uint32(raw[i])
    else:
        r = np.uint32(raw[3 * i]) | (np.uint32(raw[3 * i + 1]) << 8) | (np.uint32(raw[3 * i + 2]) << 16)
    return ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)


@njit(cache=True, nogil=True)
def merge(
    syms: np.ndarray, sym_stride: int, raw: np.ndarray, s: int, nraw: int, out: np.ndarray
) -> None:  # pragma: no cover
    """out[i] = the word of symbol ``syms[i * sym_stride]`` and raw bits ``raw[i]`` (stride 0: one symbol)."""
    lowmask = np.uint32((1 << s) - 1)
    if sym_stride == 1 and nraw == 1:  # the decoder's case, on its own so that it vectorizes
        for i in range(out.size):
            out[i] = _word(np.uint32(syms[i]), raw, i, s, 1, lowmask)
    else:
        for i in range(out.size):
            out[i] = _word(np.uint32(syms[i * sym_stride]), raw, i, s, nraw, lowmask)


@njit(inline="always")
def _store(stream: np.ndarray, p: int, v: np.uint64) -> None:  # pragma: no cover - jitted
    """8 bytes of ``v`` big-endian at ``p`` (unsigned indices: one ``movbe`` store)."""
    b = np.uint64(p)
    for j in range(8):
        stream[b + np.uint64(j)] = np.uint8((v >> np.uint64(56 - 8 * j)) & U255)


@njit(inline="always")
def _code(words: np.ndarray, i: int, s: int, tab: np.ndarray, acc: np.uint64, nb: int):  # pragma: no cover
    """Append the code of element ``i``'s symbol to the low end of ``acc`` (``tab``: code << 5 | length)."""
    e = tab[(np.uint32(words[np.uint64(i)]) >> s) & np.uint32(0xFF)]
    ln = np.int64(e & 31)
    return (acc << np.uint64(ln)) | np.uint64(e >> 5), nb + ln


@njit(inline="always")
def _put2(words, i, st, s, tab, acc, nb, stream, p):  # pragma: no cover - jitted
    """Two codes (at most 40 bits on the < 8 pending), then every whole byte out by one 8-byte store."""
    acc, nb = _code(words, i, s, tab, acc, nb)
    acc, nb = _code(words, i + st, s, tab, acc, nb)
    _store(stream, p, acc << np.uint64(64 - nb))
    return acc, nb & 7, p + (nb >> 3)


@njit(inline="always")
def _put_room(i: int, last: int, st: int, p: int, limit: int) -> int:  # pragma: no cover - jitted
    """:func:`_put2` steps that surely fit: 2 elements each up to ``last``, 5 bytes each, stores before ``limit``."""
    return min(((last - i) // st + 1) // 2, (limit - 8 - p) // 5)


@njit(cache=True, nogil=True, _nrt=False)
def _close(words, i, last, st, s, tab, acc, nb, stream, p, limit, q0, dst, sizes, k) -> int:  # pragma: no cover
    """Finish lane k, whose bytes start at ``q0`` (``p`` so far, up to ``limit``): whole steps while they fit,
    then byte by byte; then move it down to ``dst``. Returns where its bytes end there, or -1."""
    if dst < 0:
        return -1
    n = _put_room(i, last, st, p, limit)
    while n > 0:
        for _ in range(n):
            acc, nb, p = _put2(words, i, st, s, tab, acc, nb, stream, p)
            i += 2 * st
        n = _put_room(i, last, st, p, limit)
    while i <= last or nb > 0:
        if i <= last:
            acc, nb = _code(words, i, s, tab, acc, nb)
            i += st
        elif nb < 8:
            acc <<= np.uint64(8 - nb)
            nb = 8
        while nb >= 8:
            if p >= limit:
                return -1
            nb -= 8
            stream[p] = np.uint8((acc >> np.uint64(nb)) & U255)
            p += 1
    sizes[k] = p - q0
    if q0 != dst:
        for b in range(q0, p):  # forward: dst < q0
            stream[dst + b - q0] = stream[b]
    return dst + p - q0


@njit(cache=True, nogil=True, _nrt=False)
def _encode_lanes(words, s, tab, maxlen, first, count, stride, sizes, stream) -> int:  # pragma: no cover - jitted
    st = np.int64(stride)
    lanes = first.size
    p = 0  # where the next lane's bytes go
    for k in range(0, lanes - lanes % 4, 4):  # four lanes in lock-step, each in a worst-case region from p
        r1 = p + (maxlen * count[k] + 7) // 8  # p <= the lanes before's worst: the regions fit
        r2 = r1 + (maxlen * count[k + 1] + 7) // 8
        r3 = r2 + (maxlen * count[k + 2] + 7) // 8
        r4 = r3 + (maxlen * count[k + 3] + 7) // 8
        if r4 > stream.size:
            return -1
        i0, i1, i2, i3 = first[k], first[k + 1], first[k + 2], first[k + 3]
        z0, z1 = i0 + (count[k] - 1) * st, i1 + (count[k + 1] - 1) * st  # the lanes' last elements
        z2, z3 = i2 + (count[k + 2] - 1) * st, i3 + (count[k + 3] - 1) * st
        p0, p1, p2, p3 = p, r1, r2, r3
        a0 = a1 = a2 = a3 = np.uint64(0)
        n0 = n1 = n2 = n3 = 0
        while True:
            n = min(
                min(_put_room(i0, z0, st, p0, r1), _put_room(i1, z1, st, p1, r2)),
                min(_put_room(i2, z2, st, p2, r3), _put_room(i3, z3, st, p3, r4)),
            )
            if n <= 0:
                break
            for _ in range(n):
                a0, n0, p0 = _put2(words, i0, st, s, tab, a0, n0, stream, p0)
                a1, n1, p1 = _put2(words, i1, st, s, tab, a1, n1, stream, p1)
                a2, n2, p2 = _put2(words, i2, st, s, tab, a2, n2, stream, p2)
                a3, n3, p3 = _put2(words, i3, st, s, tab, a3, n3, stream, p3)
                i0, i1, i2, i3 = i0 + 2 * st, i1 + 2 * st, i2 + 2 * st, i3 + 2 * st
        p = _close(words, i0, z0, st, s, tab, a0, n0, stream, p0, r1, p, p, sizes, k)
        p = _close(words, i1, z1, st, s, tab, a1, n1, stream, p1, r2, r1, p, sizes, k + 1)
        p = _close(words, i2, z2, st, s, tab, a2, n2, stream, p2, r3, r2, p, sizes, k + 2)
        p = _close(words, i3, z3, st, s, tab, a3, n3, stream, p3, r4, r3, p, sizes, k + 3)
        if p < 0:
            return -1
    for k in range(lanes - lanes % 4, lanes):
        z = first[k] + (count[k] - 1) * st
        p = _close(words, first[k], z, st, s, tab, np.uint64(0), 0, stream, p, stream.size, p, p, sizes, k)
    return p


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
) -> int:
    """Code the symbols of ``words`` as lanes written one after another into ``stream``.

    Lane k codes ``words[first[k] + t * stride]``, ``t < count[k]``; its byte
    size goes to ``sizes[k]``. Returns the bytes used. ``stream`` must hold
    ``ceil(20 n / 8) + lanes`` bytes (a smaller one raises ValueError).
    """
    tab = (code_full.astype(np.uint32) << np.uint32(5)) | len_full.astype(np.uint32)
    used = _encode_lanes(words, s, tab, int(len_full.max()), first, count, stride, sizes, stream)
    if used < 0:
        raise ValueError("stream buffer too small for the lanes' worst case")
    return used


@njit(cache=True, nogil=True)
def _multi_table(dec: np.ndarray, m: np.ndarray) -> None:  # pragma: no cover - jitted
    """Up to 3 symbols an entry: bits 0-3 the code bits, 4-5 the count, 7 "special" (an escape, whose 8
    literal bits follow; with 0 bits, no code), 8-31 the symbols. A code joins if it fits and is no escape."""
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
    """8 stream bytes from ``byte``, big-endian (unsigned indices: one ``movbe`` load)."""
    b = np.uint64(byte)
    acc = np.uint64(0)
    for j in range(8):
        acc = (acc << U8) | np.uint64(stream[b + np.uint64(j)])
    return acc


@njit(inline="always")
def _look(acc: np.uint64, m: np.ndarray, syms: np.ndarray, o: int, st: int, bad: bool):  # pragma: no cover
    """One lookup at the top of ``acc``: 3 slots ``syms[o + j * st]`` written, 1 to 3 of them symbols."""
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
    """Steps a lane surely has room for: 6 symbols each up to ``last``, 40 bits each, loads inside ``stream``."""
    return min(((last - o) // st + 1) // 6, (size * 8 - 64 - bp) // 40)


@njit(cache=True, nogil=True, _nrt=False)
def _finish_lane(stream, start, end, bp, o, last, st, m, dec, syms) -> int:  # pragma: no cover - jitted
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
        acc = np.uint64(0)
        for j in range((bp >> 3), (bp >> 3) + 8):  # bounds-checked: zeros past the stream
            acc = (acc << U8) | np.uint64(stream[np.uint64(j)] if j < stream.size else 0)
        acc <<= np.uint64(bp & 7)
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
    consumed = bp - start * 8  # then 0 if the codes ended in the lane's last byte, 2 past it, 3 before it
    if consumed > (end - start) * 8:
        return 2
    return 0 if (consumed + 7) // 8 == end - start else 3


@njit(cache=True, nogil=True, _nrt=False)
def _decode_syms(stream, starts, ends, first, count, stride, dec, m, syms) -> int:  # pragma: no cover - jitted
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

    Lane k is ``stream[starts[k]:ends[k]]`` and holds elements ``first[k] + t * stride``,
    ``t < count[k]`` (int64 arrays). ``table`` has ``2**TABLE_BITS`` entries ``(sym << 4) | length``,
    length 0 marking a bit pattern that is no code and symbol 256 an escape (8 literal bits
    follow). ``raw`` holds ``nraw`` bytes per element of ``out``.

    Raises:
        StreamError: an invalid code, a lane that runs past its end or leaves
            bytes unread, or a plan outside the arrays.
    """
    last = np.where(count > 0, first + (count - 1) * stride, -1)
    if raw.size < nraw * out.size or int(last.max(initial=-1)) >= out.size:
        raise StreamError(4)
    # Interleaved lanes: rows padded by 64 bytes, or a lane's slots 1 KiB apart fill 4 of L1's 64 sets.
    rows = stride > 1 and int(first.max(initial=0)) < stride
    lp = stride + 64 if rows else stride
    syms = np.empty(-(-out.size // stride) * lp if rows else out.size, dtype=np.uint8)
    rc = _decode_syms(stream, starts, ends, first, count, lp, table, multi_table(table), syms)
    if rc != 0:
        raise StreamError(-rc)
    _merge_rows(syms, lp, raw, s, nraw, out, stride if rows else max(out.size, 1))


@njit(cache=True, nogil=True)
def _merge_rows(syms, lp, raw, s, nraw, out, row) -> None:  # pragma: no cover - jitted
    """:func:`merge` of ``out[t * row + c]`` with symbol ``syms[t * lp + c]``, row by row."""
    for a in range(0, out.size, row):
        b = min(out.size, a + row)
        merge(syms[a // row * lp : a // row * lp + b - a], 1, raw[nraw * a : nraw * b], s, nraw, out[a:b])


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


__all__ = ["TABLE_BITS", "decode_lanes", "encode_lanes", "merge", "multi_table", "split", "sym_hist"]
