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
- Both kernels take one lane at a time, its bit buffer in registers. The
  former decoder advanced the four version-1 lanes in lock-step, written out
  by hand (310 lines) to overlap four dependency chains; a loop over lanes
  with the lanes' state in small arrays measured no faster here (numba keeps
  that state in memory, and for interleaved lanes a group's pass strides
  over the whole chunk), and the out-of-order core already overlaps one
  symbol's merge and store with the next one's lookup.
- No ``prange``: the codec already codes chunks in parallel from a thread
  pool (``nogil=True``), and numba's default threading layer (workqueue)
  aborts when parallel kernels are launched from several threads at once.
- The decoder is memory-safe for ANY input bytes: the lane plan is checked
  against the arrays first, stream reads are bounds-checked (past a lane's
  end it reads zeros and reports it), table indices are masked. Numba does
  no bounds checking of its own, so this holds by construction.
- ``cache=True`` keeps the compiled code in ``__pycache__`` (or numba's user
  cache): only the first process on a machine pays the JIT, about a second
  per kernel and word width.
"""

from __future__ import annotations

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


@njit(cache=True, nogil=True)
def merge(
    syms: np.ndarray, sym_stride: int, raw: np.ndarray, s: int, nraw: int, out: np.ndarray
) -> None:  # pragma: no cover - jitted
    """out[i] = the word of symbol ``syms[i * sym_stride]`` and raw bits ``raw[i]`` (stride 0: one symbol)."""
    lowmask = np.uint32((1 << s) - 1)
    for i in range(out.size):
        sym = np.uint32(syms[i * sym_stride])
        if nraw == 1:
            r = np.uint32(raw[i])
        else:
            r = np.uint32(raw[3 * i]) | (np.uint32(raw[3 * i + 1]) << 8) | (np.uint32(raw[3 * i + 2]) << 16)
        out[i] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)


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
def _decode_lanes(
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
) -> int:  # pragma: no cover - jitted
    lanes = first.size
    for k in range(lanes):  # the plan must lie inside the arrays before anything is read
        if not (0 <= starts[k] <= ends[k] <= stream.size) or count[k] < 0:
            return -4
        if count[k] > 0 and not (0 <= first[k] and first[k] + (count[k] - 1) * stride < out.size):
            return -4
    if raw.size < nraw * out.size:
        return -4
    lowmask = np.uint32((1 << s) - 1)
    for k in range(lanes):
        base = starts[k]
        end = ends[k]
        p = base
        acc = np.uint64(0)  # bit buffer: its low nb bits are unread
        nb = 0
        i = first[k]
        for _ in range(count[k]):
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
            ent = table[(acc >> np.uint64(nb - TABLE_BITS)) & TMASK]
            ln = np.int64(ent & 15)
            if ln == 0:
                return -1
            nb -= ln
            sym = np.uint32(ent >> 4)
            if sym == 256:  # escape: 8 literal bits follow, already in the buffer (nb >= 20 here)
                sym = np.uint32((acc >> np.uint64(nb - 8)) & U255)
                nb -= 8
            if nraw == 1:
                r = np.uint32(raw[i])
            else:
                r = np.uint32(raw[3 * i]) | (np.uint32(raw[3 * i + 1]) << 8) | (np.uint32(raw[3 * i + 2]) << 16)
            out[i] = ((r >> s) << (s + 8)) | (sym << s) | (r & lowmask)
            i += stride
        consumed = (p - base) * 8 - nb
        if consumed > (end - base) * 8:
            return -2
        if (consumed + 7) // 8 != end - base:
            return -3
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
    rc = _decode_lanes(stream, starts, ends, first, count, stride, raw, s, nraw, table, out)
    if rc != 0:
        raise StreamError(-rc)


__all__ = ["TABLE_BITS", "decode_lanes", "encode_lanes", "merge", "split", "sym_hist"]
