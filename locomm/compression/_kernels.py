"""Numba kernels of the lossless exponent coder (three kernels, compiled lazily, cached).

Notable:
- ``cache=True`` stores the compiled code in ``__pycache__`` (or numba's user
  cache when that is read-only): only the first process on a machine pays the
  JIT cost, about a second per kernel and word width.
- ``nogil=True`` lets chunks be coded from a thread pool in parallel.
- A float word is split as ``sym = (w >> s) & 0xFF`` (the 8-bit symbol: the
  exponent, or for fp16 the top byte) and ``raw`` = the other bits, packed
  into ``nraw`` little-endian bytes. The symbol plane is Huffman-coded
  MSB-first; a symbol without a code is sent as the escape code + 8 raw bits.
- Each chunk's symbols are coded as ``LANES`` independent streams (contiguous
  quarters of the chunk) that the kernels advance in lock-step: a Huffman
  decoder is one long dependency chain (lookup -> length -> shift), and four
  interleaved chains keep the core busy. This is the usual trick of fast
  entropy coders (zstd's Huffman, DietGPU).
- The decoder is memory-safe for ANY input bytes: stream reads are
  bounds-checked (past the end it reads zeros and reports it), table indices
  are masked, and every write lands inside ``out``. Numba does no bounds
  checking of its own, so this holds by construction.
"""

from __future__ import annotations

import numpy as np
from numba import njit

TABLE_BITS = 12
"""Maximum code length, and the width of the one-level decode table."""

ESC = 256
"""Symbol index of the escape code."""

LANES = 4
"""Independent Huffman streams per chunk (part of the wire format)."""


def lane_bounds(n: int) -> list[tuple[int, int]]:
    """Element ranges of the ``LANES`` lanes of an ``n``-element chunk (some may be empty)."""
    q = -(-n // LANES)
    return [(min(k * q, n), min((k + 1) * q, n)) for k in range(LANES)]


@njit(cache=True, nogil=True)
def lane_hist(words: np.ndarray, s: int, hist: np.ndarray) -> None:  # pragma: no cover - jitted
    """hist[lane, symbol] += 1 for every word; the lanes are the contiguous quarters of ``words``."""
    n = words.size
    q = (n + 3) // 4
    for k in range(4):
        for i in range(min(k * q, n), min((k + 1) * q, n)):
            hist[k, (np.uint32(words[i]) >> s) & 0xFF] += 1


U8 = np.uint64(8)
U16 = np.uint64(16)
U24 = np.uint64(24)
U32 = np.uint64(32)
U255 = np.uint64(0xFF)
TMASK = np.uint64((1 << TABLE_BITS) - 1)

# Helpers are written out by hand (not factored into small jitted functions):
# numba reference-counts array arguments on every call, which made a
# per-symbol helper 5-10x slower than the inlined loop.


@njit(cache=True, nogil=True)
def encode_chunk(
    words: np.ndarray,
    s: int,
    nraw: int,
    codes: np.ndarray,
    lens: np.ndarray,
    esc_code: int,
    esc_len: int,
    stream: np.ndarray,
    offsets: np.ndarray,
    raw: np.ndarray,
) -> None:  # pragma: no cover - jitted
    """Code the symbol plane of ``words`` as 4 lane streams and split the raw bits into ``raw``.

    Lane k's stream is written at ``stream[offsets[k]:offsets[k+1]]``; the
    caller computed those exact sizes from the lane histograms. Lanes are
    coded one after another: encoding has no long dependency chain to hide.
    """
    n = words.size
    q = (n + 3) // 4
    lowmask = np.uint32((1 << s) - 1)
    for k in range(4):
        acc = np.uint64(0)
        nb = 0
        pos = offsets[k]
        for i in range(min(k * q, n), min((k + 1) * q, n)):
            w = np.uint32(words[i])
            sym = (w >> s) & np.uint32(0xFF)
            r = ((w >> (s + 8)) << s) | (w & lowmask)
            if nraw == 1:
                raw[i] = np.uint8(r)
            else:
                raw[3 * i] = np.uint8(r & 0xFF)
                raw[3 * i + 1] = np.uint8((r >> 8) & 0xFF)
                raw[3 * i + 2] = np.uint8((r >> 16) & 0xFF)
            ln = lens[sym]
            if ln == 0:  # escape code, then the symbol's 8 bits
                acc = (acc << np.uint64(esc_len)) | np.uint64(esc_code)
                acc = (acc << U8) | np.uint64(sym)
                nb += esc_len + 8
            else:
                acc = (acc << np.uint64(ln)) | np.uint64(codes[sym])
                nb += ln
            if nb >= 32:
                nb -= 32
                v = acc >> np.uint64(nb)
                stream[pos] = np.uint8((v >> U24) & U255)
                stream[pos + 1] = np.uint8((v >> U16) & U255)
                stream[pos + 2] = np.uint8((v >> U8) & U255)
                stream[pos + 3] = np.uint8(v & U255)
                pos += 4
        while nb > 0:
            if nb >= 8:
                nb -= 8
                stream[pos] = np.uint8((acc >> np.uint64(nb)) & U255)
            else:
                stream[pos] = np.uint8((acc << np.uint64(8 - nb)) & U255)
                nb = 0
            pos += 1


@njit(cache=True, nogil=True)
def decode_chunk(
    stream: np.ndarray,
    offsets: np.ndarray,
    raw: np.ndarray,
    s: int,
    nraw: int,
    table: np.ndarray,
    out: np.ndarray,
) -> int:  # pragma: no cover - jitted
    """Decode ``out.size`` symbols from the 4 lane streams and merge them with ``raw``.

    ``offsets`` (5 entries, non-decreasing, last = ``stream.size``) delimit
    the lanes. ``table`` has ``2**TABLE_BITS`` entries ``(sym << 4) | length``;
    length 0 marks a bit pattern that is no code. ``raw`` holds
    ``nraw * out.size`` bytes (checked by the caller). Returns 0 on success,
    -1 for an invalid code, -2 when a lane's stream ran out, -3 when stream
    bytes were left unread. The four lanes are advanced in lock-step (the
    body below is the same block written out once per lane).
    """
    n = out.size
    q = (n + 3) // 4
    lowmask = np.uint32((1 << s) - 1)
    a0 = np.uint64(0)
    a1 = np.uint64(0)
    a2 = np.uint64(0)
    a3 = np.uint64(0)
    n0 = 0
    n1 = 0
    n2 = 0
    n3 = 0
    p0 = offsets[0]
    p1 = offsets[1]
    p2 = offsets[2]
    p3 = offsets[3]
    e0 = offsets[1]
    e1 = offsets[2]
    e2 = offsets[3]
    e3 = offsets[4]
    m = min(q, max(n - 3 * q, 0))  # rows where all four lanes have an element
    for i in range(m):
        if n0 < 32:
            if p0 + 4 <= e0:
                a0 = (
                    (a0 << U32)
                    | (np.uint64(stream[p0]) << U24)
                    | (np.uint64(stream[p0 + 1]) << U16)
                    | (np.uint64(stream[p0 + 2]) << U8)
                    | np.uint64(stream[p0 + 3])
                )
            else:  # near the lane's end: shift in zeros past it (reported as an overrun below)
                for _ in range(4):
                    b = np.uint64(0)
                    if p0 < e0:
                        b = np.uint64(stream[p0])
                    a0 = (a0 << U8) | b
                    p0 += 1
                p0 -= 4
            p0 += 4
            n0 += 32
        t = table[(a0 >> np.uint64(n0 - 12)) & TMASK]
        ln = np.int64(t & 15)
        if ln == 0:
            return -1
        n0 -= ln
        sym = np.uint32(t >> 4)
        if sym == 256:  # escape: n >= 32 - 12 >= 8, so the 8 literal bits are already in the accumulator
            sym = np.uint32((a0 >> np.uint64(n0 - 8)) & U255)
            n0 -= 8
        j = 0 * q + i
        if nraw == 1:
            r = np.uint32(raw[j])
        else:
            r = np.uint32(raw[3 * j]) | (np.uint32(raw[3 * j + 1]) << 8) | (np.uint32(raw[3 * j + 2]) << 16)
        out[j] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)
        if n1 < 32:
            if p1 + 4 <= e1:
                a1 = (
                    (a1 << U32)
                    | (np.uint64(stream[p1]) << U24)
                    | (np.uint64(stream[p1 + 1]) << U16)
                    | (np.uint64(stream[p1 + 2]) << U8)
                    | np.uint64(stream[p1 + 3])
                )
            else:  # near the lane's end: shift in zeros past it (reported as an overrun below)
                for _ in range(4):
                    b = np.uint64(0)
                    if p1 < e1:
                        b = np.uint64(stream[p1])
                    a1 = (a1 << U8) | b
                    p1 += 1
                p1 -= 4
            p1 += 4
            n1 += 32
        t = table[(a1 >> np.uint64(n1 - 12)) & TMASK]
        ln = np.int64(t & 15)
        if ln == 0:
            return -1
        n1 -= ln
        sym = np.uint32(t >> 4)
        if sym == 256:  # escape: n >= 32 - 12 >= 8, so the 8 literal bits are already in the accumulator
            sym = np.uint32((a1 >> np.uint64(n1 - 8)) & U255)
            n1 -= 8
        j = 1 * q + i
        if nraw == 1:
            r = np.uint32(raw[j])
        else:
            r = np.uint32(raw[3 * j]) | (np.uint32(raw[3 * j + 1]) << 8) | (np.uint32(raw[3 * j + 2]) << 16)
        out[j] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)
        if n2 < 32:
            if p2 + 4 <= e2:
                a2 = (
                    (a2 << U32)
                    | (np.uint64(stream[p2]) << U24)
                    | (np.uint64(stream[p2 + 1]) << U16)
                    | (np.uint64(stream[p2 + 2]) << U8)
                    | np.uint64(stream[p2 + 3])
                )
            else:  # near the lane's end: shift in zeros past it (reported as an overrun below)
                for _ in range(4):
                    b = np.uint64(0)
                    if p2 < e2:
                        b = np.uint64(stream[p2])
                    a2 = (a2 << U8) | b
                    p2 += 1
                p2 -= 4
            p2 += 4
            n2 += 32
        t = table[(a2 >> np.uint64(n2 - 12)) & TMASK]
        ln = np.int64(t & 15)
        if ln == 0:
            return -1
        n2 -= ln
        sym = np.uint32(t >> 4)
        if sym == 256:  # escape: n >= 32 - 12 >= 8, so the 8 literal bits are already in the accumulator
            sym = np.uint32((a2 >> np.uint64(n2 - 8)) & U255)
            n2 -= 8
        j = 2 * q + i
        if nraw == 1:
            r = np.uint32(raw[j])
        else:
            r = np.uint32(raw[3 * j]) | (np.uint32(raw[3 * j + 1]) << 8) | (np.uint32(raw[3 * j + 2]) << 16)
        out[j] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)
        if n3 < 32:
            if p3 + 4 <= e3:
                a3 = (
                    (a3 << U32)
                    | (np.uint64(stream[p3]) << U24)
                    | (np.uint64(stream[p3 + 1]) << U16)
                    | (np.uint64(stream[p3 + 2]) << U8)
                    | np.uint64(stream[p3 + 3])
                )
            else:  # near the lane's end: shift in zeros past it (reported as an overrun below)
                for _ in range(4):
                    b = np.uint64(0)
                    if p3 < e3:
                        b = np.uint64(stream[p3])
                    a3 = (a3 << U8) | b
                    p3 += 1
                p3 -= 4
            p3 += 4
            n3 += 32
        t = table[(a3 >> np.uint64(n3 - 12)) & TMASK]
        ln = np.int64(t & 15)
        if ln == 0:
            return -1
        n3 -= ln
        sym = np.uint32(t >> 4)
        if sym == 256:  # escape: n >= 32 - 12 >= 8, so the 8 literal bits are already in the accumulator
            sym = np.uint32((a3 >> np.uint64(n3 - 8)) & U255)
            n3 -= 8
        j = 3 * q + i
        if nraw == 1:
            r = np.uint32(raw[j])
        else:
            r = np.uint32(raw[3 * j]) | (np.uint32(raw[3 * j + 1]) << 8) | (np.uint32(raw[3 * j + 2]) << 16)
        out[j] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)
    for i in range(m, q):
        if 0 * q + i < n:
            if n0 < 32:
                if p0 + 4 <= e0:
                    a0 = (
                        (a0 << U32)
                        | (np.uint64(stream[p0]) << U24)
                        | (np.uint64(stream[p0 + 1]) << U16)
                        | (np.uint64(stream[p0 + 2]) << U8)
                        | np.uint64(stream[p0 + 3])
                    )
                else:  # near the lane's end: shift in zeros past it (reported as an overrun below)
                    for _ in range(4):
                        b = np.uint64(0)
                        if p0 < e0:
                            b = np.uint64(stream[p0])
                        a0 = (a0 << U8) | b
                        p0 += 1
                    p0 -= 4
                p0 += 4
                n0 += 32
            t = table[(a0 >> np.uint64(n0 - 12)) & TMASK]
            ln = np.int64(t & 15)
            if ln == 0:
                return -1
            n0 -= ln
            sym = np.uint32(t >> 4)
            if sym == 256:  # escape: n >= 32 - 12 >= 8, so the 8 literal bits are already in the accumulator
                sym = np.uint32((a0 >> np.uint64(n0 - 8)) & U255)
                n0 -= 8
            j = 0 * q + i
            if nraw == 1:
                r = np.uint32(raw[j])
            else:
                r = np.uint32(raw[3 * j]) | (np.uint32(raw[3 * j + 1]) << 8) | (np.uint32(raw[3 * j + 2]) << 16)
            out[j] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)
        if 1 * q + i < n:
            if n1 < 32:
                if p1 + 4 <= e1:
                    a1 = (
                        (a1 << U32)
                        | (np.uint64(stream[p1]) << U24)
                        | (np.uint64(stream[p1 + 1]) << U16)
                        | (np.uint64(stream[p1 + 2]) << U8)
                        | np.uint64(stream[p1 + 3])
                    )
                else:  # near the lane's end: shift in zeros past it (reported as an overrun below)
                    for _ in range(4):
                        b = np.uint64(0)
                        if p1 < e1:
                            b = np.uint64(stream[p1])
                        a1 = (a1 << U8) | b
                        p1 += 1
                    p1 -= 4
                p1 += 4
                n1 += 32
            t = table[(a1 >> np.uint64(n1 - 12)) & TMASK]
            ln = np.int64(t & 15)
            if ln == 0:
                return -1
            n1 -= ln
            sym = np.uint32(t >> 4)
            if sym == 256:  # escape: n >= 32 - 12 >= 8, so the 8 literal bits are already in the accumulator
                sym = np.uint32((a1 >> np.uint64(n1 - 8)) & U255)
                n1 -= 8
            j = 1 * q + i
            if nraw == 1:
                r = np.uint32(raw[j])
            else:
                r = np.uint32(raw[3 * j]) | (np.uint32(raw[3 * j + 1]) << 8) | (np.uint32(raw[3 * j + 2]) << 16)
            out[j] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)
        if 2 * q + i < n:
            if n2 < 32:
                if p2 + 4 <= e2:
                    a2 = (
                        (a2 << U32)
                        | (np.uint64(stream[p2]) << U24)
                        | (np.uint64(stream[p2 + 1]) << U16)
                        | (np.uint64(stream[p2 + 2]) << U8)
                        | np.uint64(stream[p2 + 3])
                    )
                else:  # near the lane's end: shift in zeros past it (reported as an overrun below)
                    for _ in range(4):
                        b = np.uint64(0)
                        if p2 < e2:
                            b = np.uint64(stream[p2])
                        a2 = (a2 << U8) | b
                        p2 += 1
                    p2 -= 4
                p2 += 4
                n2 += 32
            t = table[(a2 >> np.uint64(n2 - 12)) & TMASK]
            ln = np.int64(t & 15)
            if ln == 0:
                return -1
            n2 -= ln
            sym = np.uint32(t >> 4)
            if sym == 256:  # escape: n >= 32 - 12 >= 8, so the 8 literal bits are already in the accumulator
                sym = np.uint32((a2 >> np.uint64(n2 - 8)) & U255)
                n2 -= 8
            j = 2 * q + i
            if nraw == 1:
                r = np.uint32(raw[j])
            else:
                r = np.uint32(raw[3 * j]) | (np.uint32(raw[3 * j + 1]) << 8) | (np.uint32(raw[3 * j + 2]) << 16)
            out[j] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)
        if 3 * q + i < n:
            if n3 < 32:
                if p3 + 4 <= e3:
                    a3 = (
                        (a3 << U32)
                        | (np.uint64(stream[p3]) << U24)
                        | (np.uint64(stream[p3 + 1]) << U16)
                        | (np.uint64(stream[p3 + 2]) << U8)
                        | np.uint64(stream[p3 + 3])
                    )
                else:  # near the lane's end: shift in zeros past it (reported as an overrun below)
                    for _ in range(4):
                        b = np.uint64(0)
                        if p3 < e3:
                            b = np.uint64(stream[p3])
                        a3 = (a3 << U8) | b
                        p3 += 1
                    p3 -= 4
                p3 += 4
                n3 += 32
            t = table[(a3 >> np.uint64(n3 - 12)) & TMASK]
            ln = np.int64(t & 15)
            if ln == 0:
                return -1
            n3 -= ln
            sym = np.uint32(t >> 4)
            if sym == 256:  # escape: n >= 32 - 12 >= 8, so the 8 literal bits are already in the accumulator
                sym = np.uint32((a3 >> np.uint64(n3 - 8)) & U255)
                n3 -= 8
            j = 3 * q + i
            if nraw == 1:
                r = np.uint32(raw[j])
            else:
                r = np.uint32(raw[3 * j]) | (np.uint32(raw[3 * j + 1]) << 8) | (np.uint32(raw[3 * j + 2]) << 16)
            out[j] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)
    consumed = (p0 - offsets[0]) * 8 - n0
    if consumed > (e0 - offsets[0]) * 8:
        return -2
    if (consumed + 7) // 8 != e0 - offsets[0]:
        return -3
    consumed = (p1 - offsets[1]) * 8 - n1
    if consumed > (e1 - offsets[1]) * 8:
        return -2
    if (consumed + 7) // 8 != e1 - offsets[1]:
        return -3
    consumed = (p2 - offsets[2]) * 8 - n2
    if consumed > (e2 - offsets[2]) * 8:
        return -2
    if (consumed + 7) // 8 != e2 - offsets[2]:
        return -3
    consumed = (p3 - offsets[3]) * 8 - n3
    if consumed > (e3 - offsets[3]) * 8:
        return -2
    if (consumed + 7) // 8 != e3 - offsets[3]:
        return -3
    return 0


# ------------------------------------------------------------------ segmented layout (lossless v2)
#
# The 4-lane layout above is one long dependency chain per quarter-chunk, which
# a GPU cannot spread over thousands of threads. Version 2 cuts each chunk into
# L = ceil(n / lane_syms) lanes, interleaved (element i belongs to lane i % L,
# at step i // L), each its own MSB-first bit stream padded to a byte, with its
# byte length in the chunk header. Thousands of lanes decode independently and
# at each step neighbouring lanes touch neighbouring elements (coalesced on a
# GPU, sequential on a CPU). The Triton kernels in locomm/kernels/lossless.py
# write and read exactly these bytes. Codes are "full": a symbol without a code
# is its escape code followed by its 8 bits, at most TABLE_BITS + 8 = 20 bits.


@njit(cache=True, nogil=True)
def split_raw(words: np.ndarray, s: int, nraw: int, raw: np.ndarray) -> None:  # pragma: no cover - jitted
    """The raw plane: every word's bits but its 8-bit symbol, in ``nraw`` little-endian bytes."""
    lowmask = np.uint32((1 << s) - 1)
    for i in range(words.size):
        w = np.uint32(words[i])
        r = ((w >> (s + 8)) << s) | (w & lowmask)
        if nraw == 1:
            raw[i] = np.uint8(r)
        else:
            raw[3 * i] = np.uint8(r & 0xFF)
            raw[3 * i + 1] = np.uint8((r >> 8) & 0xFF)
            raw[3 * i + 2] = np.uint8((r >> 16) & 0xFF)


@njit(cache=True, nogil=True)
def seg_encode(
    words: np.ndarray,
    s: int,
    nraw: int,
    code_full: np.ndarray,
    len_full: np.ndarray,
    n_lanes: int,
    sizes: np.ndarray,
    stream: np.ndarray,
    raw: np.ndarray,
) -> int:  # pragma: no cover - jitted
    """Code ``words`` as ``n_lanes`` interleaved lanes, one after another into ``stream``.

    Fills ``sizes[l]`` (bytes of lane l) and ``raw``; returns the stream's
    length. ``stream`` must hold ``ceil(20 n / 8) + n_lanes`` bytes (every code
    is at most 20 bits). Lane by lane: strided reads, sequential writes, and
    the bit accumulator stays in registers.
    """
    n = words.size
    split_raw(words, s, nraw, raw)
    p = 0
    for l in range(min(n_lanes, n)):
        start = p
        acc = np.uint64(0)
        nb = 0
        for i in range(l, n, n_lanes):
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
        while nb > 0:
            if nb >= 8:
                nb -= 8
                stream[p] = np.uint8((acc >> np.uint64(nb)) & U255)
            else:
                stream[p] = np.uint8((acc << np.uint64(8 - nb)) & U255)
                nb = 0
            p += 1
        sizes[l] = p - start
    return p


@njit(cache=True, nogil=True)
def seg_decode(
    stream: np.ndarray,
    offsets: np.ndarray,
    raw: np.ndarray,
    s: int,
    nraw: int,
    n_lanes: int,
    table: np.ndarray,
    out: np.ndarray,
) -> int:  # pragma: no cover - jitted
    """Decode ``out.size`` symbols from ``n_lanes`` interleaved lane streams and merge them with ``raw``.

    Memory-safe for any input: reads past a lane's end see zeros, table
    indices are 12-bit by construction. Returns 0, or -1 (invalid code), -2
    (a lane ran past its end), -3 (a lane has unread bytes), as
    :func:`decode_chunk` does. Lane by lane, with a 64-bit bit buffer.
    """
    n = out.size
    lowmask = np.uint32((1 << s) - 1)
    for l in range(min(n_lanes, n)):
        base = offsets[l]
        end = offsets[l + 1]
        p = base
        acc = np.uint64(0)
        nb = 0
        for i in range(l, n, n_lanes):
            if nb < 32:
                if p + 4 <= end:
                    acc = (
                        (acc << U32)
                        | (np.uint64(stream[p]) << U24)
                        | (np.uint64(stream[p + 1]) << U16)
                        | (np.uint64(stream[p + 2]) << U8)
                        | np.uint64(stream[p + 3])
                    )
                else:  # past the lane's end: shift in zeros (reported as an overrun below)
                    for j in range(4):
                        c = np.uint64(0)
                        if p + j < end:
                            c = np.uint64(stream[p + j])
                        acc = (acc << U8) | c
                p += 4
                nb += 32
            t = table[(acc >> np.uint64(nb - 12)) & TMASK]
            ln = np.int64(t & 15)
            if ln == 0:
                return -1
            nb -= ln
            sym = np.uint32(t >> 4)
            if sym == 256:  # 8 literal bits follow (nb >= 20 here)
                sym = np.uint32((acc >> np.uint64(nb - 8)) & U255)
                nb -= 8
            if nraw == 1:
                r = np.uint32(raw[i])
            else:
                r = np.uint32(raw[3 * i]) | (np.uint32(raw[3 * i + 1]) << 8) | (np.uint32(raw[3 * i + 2]) << 16)
            out[i] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)
        consumed = (p - base) * 8 - nb
        if consumed > (end - base) * 8:
            return -2
        if (consumed + 7) // 8 != end - base:
            return -3
    for l in range(min(n_lanes, n), n_lanes):  # lanes with no element must be empty
        if offsets[l + 1] != offsets[l]:
            return -3
    return 0
