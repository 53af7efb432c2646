"""Canonical, length-limited Huffman tables and the closed-form Gaussian exponent model.

Notable:
- Everything here is deterministic integer arithmetic once the symbol
  frequencies are integers, so encoder and decoder (possibly on different
  machines) derive identical tables. The Gaussian model quantizes its
  probabilities to integers at 2**-24 resolution before building codes; a
  libm difference in the last ulp of ``erfc`` would have to land exactly on a
  rounding boundary to matter.
- Alphabet: 256 float symbols + 1 escape (``ESC``). A symbol without a code is
  sent as ESC + 8 raw bits; the Gaussian model only gives codes to symbols
  with non-negligible probability, which keeps the code space for the likely
  ones (a code for all 256 exponents would cost ~0.1 bit per symbol).
- Code lengths are limited to ``TABLE_BITS`` (12) by flooring small
  frequencies and rebuilding, so decoding is one table lookup per symbol.
"""

from __future__ import annotations

import functools
import heapq
import math

import numpy as np

from locomm.compression.base import CodecError

TABLE_BITS = 12
"""Maximum code length, and the width of the one-level decode table (part of the wire format)."""

ESC = 256
"""Symbol index of the escape code."""

NSYM = 257
"""256 byte symbols + the escape symbol."""

SIGMA_STEPS = 16
"""The model's sigma is quantized to 2**(q/16): at most 2.2% off, and tables cache by q."""

MODEL_SCALE = 1 << 24
"""Integer resolution of the model's probabilities."""


def huffman_lengths(freqs: np.ndarray, max_len: int = TABLE_BITS) -> np.ndarray:
    """Code lengths (0 = no code) for integer frequencies, limited to ``max_len``.

    A single used symbol gets length 1. Ties are broken by symbol index, so
    the result is a pure function of ``freqs``.
    """
    freqs = np.asarray(freqs, dtype=np.int64)
    used = [int(s) for s in np.nonzero(freqs > 0)[0]]
    lengths = np.zeros(len(freqs), dtype=np.int64)
    if not used:
        return lengths
    if len(used) == 1:
        lengths[used[0]] = 1
        return lengths
    if len(used) > (1 << max_len):
        raise ValueError("alphabet too large for the length limit")
    f = {s: int(freqs[s]) for s in used}
    floor = 0
    while True:
        w = {s: max(v, floor) for s, v in f.items()}
        depth = _huffman_depths(w)
        if max(depth.values()) <= max_len:
            for s, d in depth.items():
                lengths[s] = d
            return lengths
        # Raise the floor until the rare symbols fit: doubling converges in a few rounds.
        floor = max(1, floor * 2, max(w.values()) >> max_len)


def _huffman_depths(w: dict[int, int]) -> dict[int, int]:
    heap: list[tuple[int, int, int]] = [(v, s, s) for s, v in sorted(w.items())]
    heapq.heapify(heap)
    parent: dict[int, int] = {}
    next_id = NSYM + 1
    while len(heap) > 1:
        v1, _, a = heapq.heappop(heap)
        v2, _, b = heapq.heappop(heap)
        parent[a] = next_id
        parent[b] = next_id
        heapq.heappush(heap, (v1 + v2, next_id, next_id))
        next_id += 1
    depth: dict[int, int] = {}
    for s in w:
        d, node = 0, s
        while node in parent:
            node = parent[node]
            d += 1
        depth[s] = d
    return depth


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical code values (MSB-first) for the code lengths; 0 where length is 0."""
    codes = np.zeros(len(lengths), dtype=np.uint32)
    order = sorted((int(l), s) for s, l in enumerate(lengths) if l > 0)
    code = 0
    prev_len = order[0][0] if order else 0
    for i, (ln, s) in enumerate(order):
        if i:
            code = (code + 1) << (ln - prev_len)
        codes[s] = code
        prev_len = ln
    return codes


def check_lengths(lengths: np.ndarray) -> None:
    """Raise :class:`CodecError` unless the lengths form a valid prefix code."""
    if lengths.shape != (NSYM,) or lengths.min() < 0 or lengths.max() > TABLE_BITS:
        raise CodecError("code lengths out of range")
    kraft = sum(1 << (TABLE_BITS - int(l)) for l in lengths if l > 0)
    if kraft == 0 or kraft > (1 << TABLE_BITS):
        raise CodecError("code lengths do not form a prefix code")


def decode_table(lengths: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """One-level decode table: entry ``(sym << 4) | len`` for every TABLE_BITS-bit prefix."""
    table = np.zeros(1 << TABLE_BITS, dtype=np.uint16)
    for s in np.nonzero(lengths)[0]:
        ln = int(lengths[s])
        lo = int(codes[s]) << (TABLE_BITS - ln)
        table[lo : lo + (1 << (TABLE_BITS - ln))] = (int(s) << 4) | ln
    return table


class Table:
    """Encoder and decoder views of one code: lengths, codes, escape, decode table."""

    __slots__ = ("lengths", "codes", "enc_lens", "enc_codes", "esc_len", "esc_code", "dec", "ideal_bits")

    def __init__(self, lengths: np.ndarray, freqs: np.ndarray | None = None) -> None:
        self.lengths = lengths.astype(np.int64)
        self.codes = canonical_codes(self.lengths)
        self.enc_lens = self.lengths[:256].astype(np.uint8)
        self.enc_codes = self.codes[:256].copy()
        self.esc_len = int(self.lengths[ESC])
        self.esc_code = int(self.codes[ESC])
        self.dec = decode_table(self.lengths, self.codes)
        # -log2 of the model probability per byte symbol (escapes: ESC + 8 bits);
        # used to measure the model's cross-entropy against a chunk's histogram.
        self.ideal_bits: np.ndarray | None = None
        if freqs is not None:
            f = freqs.astype(np.float64)
            bits = -np.log2(np.maximum(f, 1e-300) / f.sum())
            self.ideal_bits = np.where(f[:256] > 0, bits[:256], bits[ESC] + 8.0)

    def cross_entropy_bits(self, sym_hist: np.ndarray) -> float:
        """Ideal coded size of a histogram under this table's model (model tables only)."""
        assert self.ideal_bits is not None
        return float(np.dot(sym_hist.astype(np.float64), self.ideal_bits))

    def cost_bits(self, sym_hist: np.ndarray) -> int:
        """Exact coded size in bits of a symbol histogram (256 entries), or -1 if some
        used symbol has neither a code nor an escape."""
        has = self.enc_lens > 0
        bits = int(np.dot(sym_hist[has], self.enc_lens[has].astype(np.int64)))
        n_esc = int(sym_hist[~has].sum())
        if n_esc:
            if self.esc_len == 0:
                return -1
            bits += n_esc * (self.esc_len + 8)
        return bits


# ------------------------------------------------------------------ Gaussian model

# Float layouts: (exponent bias, first symbol bit `s`, whether the symbol is the
# fp16 top byte (sign, 5 exponent bits, 2 mantissa bits)).
_LAYOUT = {"bf16": (127, 7, False), "fp32": (127, 23, False), "fp16": (15, 8, True)}


def sigma_to_q(sigma: float) -> int:
    return int(round(SIGMA_STEPS * math.log2(sigma)))


def q_to_sigma(q: int) -> float:
    return float(np.float32(2.0 ** (q / SIGMA_STEPS)))


Q_MIN, Q_MAX = -160 * SIGMA_STEPS, 130 * SIGMA_STEPS


def _tail(x: float) -> float:
    """P(|X| >= x) for X ~ N(0, 1)."""
    return math.erfc(x / math.sqrt(2.0))


def model_probs(kind: str, sigma: float) -> np.ndarray:
    """P(symbol) for x ~ N(0, sigma^2): the ZipCCL closed form
    P(exponent = e) = 2 (Phi(2^(e+1)/sigma) - Phi(2^e/sigma)).

    For fp16 the symbol also holds the sign (1/2 each) and the top two
    mantissa bits, whose probabilities follow from the same CDF.
    """
    bias, _, top_byte = _LAYOUT[kind]
    p = np.zeros(256, dtype=np.float64)
    if not top_byte:
        p[0] = 1.0 - _tail(2.0 ** (1 - bias) / sigma)  # zeros and subnormals
        for e in range(1, 255):
            lo = 2.0 ** (e - bias)
            p[e] = _tail(lo / sigma) - _tail(2.0 * lo / sigma)
        return p
    for e in range(0, 31):
        base = 2.0 ** (max(e, 1) - bias)
        for m in range(4):
            if e == 0:  # subnormal: value = (mantissa / 1024) * 2^-14
                lo, hi = base * m / 4, base * (m + 1) / 4
            else:
                lo, hi = base * (1 + m / 4), base * (1 + (m + 1) / 4)
            pm = (_tail(lo / sigma) if lo > 0 else 1.0) - _tail(hi / sigma)
            sym = (e << 2) | m
            p[sym] = 0.5 * pm  # positive
            p[0x80 | sym] = 0.5 * pm  # negative
    return p


@functools.lru_cache(maxsize=256)
def model_table(kind: str, q: int) -> Table:
    """The coding table the Gaussian model gives for sigma = 2**(q/16)."""
    p = model_probs(kind, q_to_sigma(q))
    freqs = np.zeros(NSYM, dtype=np.int64)
    freqs[:256] = np.floor(p * MODEL_SCALE + 0.5).astype(np.int64)
    # Everything too unlikely to get a frequency goes through the escape.
    freqs[ESC] = max(1, int(round((1.0 - float(p[freqs[:256] > 0].sum())) * MODEL_SCALE)))
    return Table(huffman_lengths(freqs), freqs)


def empirical_table(sym_hist: np.ndarray) -> Table:
    freqs = np.zeros(NSYM, dtype=np.int64)
    freqs[:256] = sym_hist
    return Table(huffman_lengths(freqs))


def pack_lengths(lengths: np.ndarray) -> bytes:
    """257 lengths (0..12) as 4-bit nibbles: 129 bytes."""
    l = np.zeros(NSYM + 1, dtype=np.uint8)
    l[:NSYM] = lengths
    return (l[0::2] | (l[1::2] << 4)).astype(np.uint8).tobytes()


def unpack_lengths(b: bytes | memoryview) -> np.ndarray:
    a = np.frombuffer(b, dtype=np.uint8)
    l = np.empty(2 * len(a), dtype=np.int64)
    l[0::2] = a & 15
    l[1::2] = a >> 4
    if l[NSYM:].any():
        raise CodecError("padding nibble of the code-length table is not zero")
    lengths = l[:NSYM]
    check_lengths(lengths)
    return lengths


PACKED_LENGTHS_BYTES = (NSYM + 1) // 2
