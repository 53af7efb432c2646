"""``lossless``: bit-exact exponent coding for bf16, fp16 and fp32 (ZipCCL / ZipNN idea).

A float's sign and mantissa are close to incompressible; its exponent carries
the redundancy. Each element is split into an 8-bit symbol (the exponent; for
fp16 the top byte: sign, 5 exponent bits, 2 mantissa bits) and the remaining
bits, stored raw (1 byte per element for bf16/fp16, 3 for fp32). The symbol
plane is coded with a canonical Huffman code (max 12 bits, one table lookup
per symbol) chosen per chunk from:

- ``MODEL``: the closed-form table for x ~ N(0, sigma^2) (ZipCCL):
  P(e) = 2 (Phi(2^(e+1)/sigma) - Phi(2^e/sigma)), sigma = the chunk's RMS,
  quantized to 2^(q/16) and sent as one float32. No table on the wire.
- ``EMPIRICAL``: a Huffman code built from the chunk's own histogram, sent as
  129 bytes of code lengths. Used when the model's cross-entropy exceeds the
  histogram's entropy by more than ``gap_bits`` per symbol (the tensor is far
  from Gaussian: many exact zeros, outliers, non-zero mean) and the exact
  coded size, table included, is smaller.
- ``CONST`` (one symbol value in the chunk, e.g. all zeros) and ``STORED``
  (symbols raw, when coding would not pay).

Wire format (little-endian)::

    "LCLS" | version u8 | dtype u8 | ndim u8 | shape u64*ndim | chunk_elems u32
    then per chunk: chunk_len u32 | mode u8 | mode header | stream | raw plane
    then crc32 u32 over everything before it

Chunks are independent, so they are coded and decoded in parallel
(``threads``) and a sender can stream them (:meth:`LosslessCodec.iter_encode`).
Every header field is checked against the bytes actually present before
anything is allocated, and the CRC is checked before parsing.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Iterator

import numpy as np
import torch

from locomm.compression import _huffman as hf
from locomm.compression import _kernels as kn
from locomm.compression.base import (
    WIRE_VERSION,
    Codec,
    CodecError,
    Reader,
    Writer,
    code_dtype,
    dtype_code,
    numel_of,
)

MAGIC = b"LCLS"

MODE_STORED, MODE_CONST, MODE_MODEL, MODE_EMPIRICAL = 0, 1, 2, 3

MAX_CHUNK_ELEMS = 1 << 26
"""Upper bound on ``chunk_elems`` so a chunk's byte length fits its u32 prefix."""


class _Layout:
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
        t = x.view(torch.int16 if self.word.itemsize == 2 else torch.int32)
        return t.numpy().reshape(-1).view(self.word)


_LAYOUTS: dict[torch.dtype, _Layout] = {
    torch.bfloat16: _Layout("bf16", np.uint16, 7, 1, False),
    torch.float16: _Layout("fp16", np.uint16, 8, 1, True),
    torch.float32: _Layout("fp32", np.uint32, 23, 3, False),
}

_IDENTITY = hf.Table(np.array([8] * 256 + [0], dtype=np.int64))
"""8-bit identity code: STORED chunks go through the same kernels."""


@functools.lru_cache(maxsize=8)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="locomm-lossless")


class LosslessCodec(Codec):
    """Bit-exact exponent coder for bf16/fp16/fp32 tensors (see module docstring).

    Args:
        chunk_elems: elements per independently coded chunk.
        threads: chunks coded/decoded in parallel (1 = the calling thread only).
        table: ``"auto"`` (model unless the gap test fails), ``"model"`` or
            ``"empirical"`` to force one table kind (benchmarks, tests).
        gap_bits: per-symbol excess of the model's cross-entropy over the
            chunk's entropy above which the empirical table is tried.
    """

    name: ClassVar[str] = "lossless"
    lossless: ClassVar[bool] = True

    def __init__(self, chunk_elems: int = 1 << 20, threads: int = 1, table: str = "auto", gap_bits: float = 0.02) -> None:
        if not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
            raise ValueError(f"chunk_elems must be in [1, {MAX_CHUNK_ELEMS}], got {chunk_elems}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if table not in ("auto", "model", "empirical"):
            raise ValueError(f"table must be auto, model or empirical, got {table!r}")
        self.chunk_elems = int(chunk_elems)
        self.threads = int(threads)
        self.table = table
        self.gap_bits = float(gap_bits)

    def __repr__(self) -> str:
        return f"LosslessCodec(chunk_elems={self.chunk_elems}, threads={self.threads}, table={self.table!r})"

    # ------------------------------------------------------------------ encode

    def encode(self, x: torch.Tensor, **context: Any) -> bytes:
        return b"".join(self.iter_encode(x))

    def iter_encode(self, x: torch.Tensor) -> Iterator[bytes | memoryview]:
        """The payload as a sequence of pieces (header, chunks, CRC) for streaming.

        ``b"".join(codec.iter_encode(x)) == codec.encode(x)``.
        """
        if x.dtype not in _LAYOUTS:
            raise TypeError(f"lossless codes bfloat16, float16 and float32 tensors, got {x.dtype}")
        layout = _LAYOUTS[x.dtype]
        x = x.detach().to("cpu").contiguous()
        words = layout.words_of(x)
        w = Writer()
        w.raw(MAGIC + bytes([WIRE_VERSION]))
        w.u8(dtype_code(x.dtype))
        w.shape(x.shape)
        w.u32(self.chunk_elems)
        head = w.getvalue()
        crc = zlib.crc32(head)
        yield head
        starts = range(0, words.size, self.chunk_elems)
        chunks = (words[i : i + self.chunk_elems] for i in starts)
        if self.threads > 1 and len(starts) > 1:
            results: Iterator[list[bytes | memoryview]] = _pool(self.threads).map(
                functools.partial(self._encode_chunk, layout), chunks
            )
        else:
            results = (self._encode_chunk(layout, c) for c in chunks)
        for pieces in results:
            for p in pieces:
                crc = zlib.crc32(p, crc)
                yield p
        yield struct.pack("<I", crc)

    def _choose(self, layout: _Layout, words: np.ndarray) -> tuple[int, hf.Table | None, bytes, np.ndarray]:
        """Pick the chunk's mode: (mode, table, mode header bytes, lane stream sizes)."""
        n = words.size
        lane_hist = np.zeros((kn.LANES, 256), dtype=np.int64)
        kn.lane_hist(words, layout.s, lane_hist)
        sym_hist = lane_hist.sum(axis=0)
        used = np.nonzero(sym_hist)[0]
        if len(used) == 1:
            return MODE_CONST, None, bytes([int(used[0])]), np.zeros(kn.LANES, dtype=np.int64)
        lane_counts = np.array([hi - lo for lo, hi in kn.lane_bounds(n)], dtype=np.int64)
        best: tuple[int, hf.Table | None, bytes, np.ndarray] = (MODE_STORED, _IDENTITY, b"", lane_counts)
        best_bits = 8 * n
        model: hf.Table | None = None
        if self.table != "empirical":
            found = self._fit_sigma(layout, sym_hist)
            if found is not None:
                q, model, bits = found
                if bits + 32 + 32 * kn.LANES < best_bits:
                    best_bits = bits + 32 + 32 * kn.LANES
                    best = (MODE_MODEL, model, struct.pack("<f", hf.q_to_sigma(q)), self._lane_bytes(model, lane_hist))
        if self.table == "empirical" or (self.table == "auto" and self._gap_too_big(sym_hist, model, n)):
            table = hf.empirical_table(sym_hist)
            bits = table.cost_bits(sym_hist) + 8 * hf.PACKED_LENGTHS_BYTES + 32 * kn.LANES
            if bits < best_bits:
                best = (MODE_EMPIRICAL, table, hf.pack_lengths(table.lengths), self._lane_bytes(table, lane_hist))
        return best

    @staticmethod
    def _fit_sigma(layout: _Layout, sym_hist: np.ndarray) -> tuple[int, hf.Table, int] | None:
        """The quantized sigma whose closed-form table codes ``sym_hist`` smallest.

        Starts from the RMS implied by the histogram and searches +-3 steps
        (+-14% in sigma); tables are cached, so this is a few dot products.
        """
        n_finite = float(sym_hist @ layout.sym_finite)
        sumsq = float(sym_hist @ layout.sym_sq)
        if n_finite <= 0 or sumsq <= 0:
            return None
        q0 = hf.sigma_to_q(math.sqrt(sumsq / n_finite))
        best: tuple[int, hf.Table, int] | None = None
        for q in range(max(q0 - 3, hf.Q_MIN), min(q0 + 3, hf.Q_MAX) + 1):
            table = hf.model_table(layout.kind, q)
            bits = table.cost_bits(sym_hist)
            if bits >= 0 and (best is None or bits < best[2]):
                best = (q, table, bits)
        return best

    @staticmethod
    def _lane_bytes(table: hf.Table, lane_hist: np.ndarray) -> np.ndarray:
        return np.array([(table.cost_bits(h) + 7) // 8 for h in lane_hist], dtype=np.int64)

    def _gap_too_big(self, sym_hist: np.ndarray, model: hf.Table | None, n: int) -> bool:
        """The ZipCCL fallback test: model cross-entropy minus histogram entropy, per symbol."""
        if model is None:
            return True
        h = sym_hist[sym_hist > 0].astype(np.float64)
        entropy_bits = float(-(h * np.log2(h / n)).sum())
        return model.cross_entropy_bits(sym_hist) - entropy_bits > self.gap_bits * n

    def _encode_chunk(self, layout: _Layout, words: np.ndarray) -> list[bytes | memoryview]:
        n = words.size
        mode, table, mode_head, lane_bytes = self._choose(layout, words)
        raw = np.empty(n * layout.nraw, dtype=np.uint8)
        if mode == MODE_CONST:
            # the kernel still splits off the raw bits; its (identity) stream is discarded
            table = _IDENTITY
            lane_bytes = np.array([hi - lo for lo, hi in kn.lane_bounds(n)], dtype=np.int64)
        assert table is not None
        offsets = np.zeros(kn.LANES + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(lane_bytes)
        stream = np.empty(int(offsets[-1]), dtype=np.uint8)
        kn.encode_chunk(
            words, layout.s, layout.nraw, table.enc_codes, table.enc_lens, table.esc_code, table.esc_len,
            stream, offsets, raw,
        )
        if mode == MODE_CONST:
            body = [bytes([mode]) + mode_head, memoryview(raw)]
        else:
            lanes_head = b"" if mode == MODE_STORED else struct.pack(f"<{kn.LANES}I", *lane_bytes)
            body = [bytes([mode]) + mode_head + lanes_head, memoryview(stream), memoryview(raw)]
        total = sum(len(b) for b in body)
        return [struct.pack("<I", total), *body]

    # ------------------------------------------------------------------ decode

    def decode(self, data: bytes | bytearray | memoryview, **context: Any) -> torch.Tensor:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise CodecError(f"payload must be bytes-like, got {type(data).__name__}")
        mv = memoryview(data).cast("B")
        if len(mv) < len(MAGIC) + 1 + 4:
            raise CodecError(f"payload too short ({len(mv)} bytes)")
        if bytes(mv[:4]) != MAGIC:
            raise CodecError(f"bad magic {bytes(mv[:4])!r}, expected {MAGIC!r}")
        if mv[4] != WIRE_VERSION:
            raise CodecError(f"unsupported wire version {mv[4]}")
        (crc,) = struct.unpack("<I", mv[-4:])
        if zlib.crc32(mv[:-4]) != crc:
            raise CodecError("checksum mismatch: payload corrupted or truncated")
        r = Reader(mv, 5, len(mv) - 4)
        dtype = code_dtype(r.u8())
        if dtype not in _LAYOUTS:
            raise CodecError(f"lossless payload claims unsupported dtype {dtype}")
        layout = _LAYOUTS[dtype]
        shape = r.shape()
        numel = numel_of(shape)
        chunk_elems = r.u32()
        if not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
            raise CodecError(f"bad chunk size {chunk_elems}")
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
        out = torch.empty(numel, dtype=torch.int16 if layout.word.itemsize == 2 else torch.int32)
        out_words = out.numpy().view(layout.word)

        def one(span: tuple[int, int, int]) -> None:
            first, b0, b1 = span
            n = min(chunk_elems, numel - first)
            self._decode_chunk(layout, Reader(mv, b0, b1), out_words[first : first + n])

        if self.threads > 1 and n_chunks > 1:
            list(_pool(self.threads).map(one, spans))
        else:
            for sp in spans:
                one(sp)
        return out.view(dtype).reshape(shape)

    def _decode_chunk(self, layout: _Layout, r: Reader, out: np.ndarray) -> None:
        n = out.size
        mode = r.u8()
        if mode == MODE_CONST:
            sym = r.u8()
            raw = r.array(n * layout.nraw, np.uint8)
            r.expect_end()
            if layout.nraw == 1:
                rv = raw.astype(np.uint32)
            else:
                rv = np.zeros(n, dtype=np.uint32)
                b = raw.reshape(n, 3).astype(np.uint32)
                rv = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
            s = layout.s
            out[:] = (((rv >> s) << (s + 8)) | (sym << s) | (rv & layout.lowmask)).astype(layout.word)
            return
        if mode == MODE_STORED:
            table = _IDENTITY
            lane_bytes = [hi - lo for lo, hi in kn.lane_bounds(n)]
        elif mode in (MODE_MODEL, MODE_EMPIRICAL):
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
            lane_bytes = [r.u32() for _ in range(kn.LANES)]
        else:
            raise CodecError(f"unknown chunk mode {mode}")
        offsets = np.zeros(kn.LANES + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(lane_bytes)
        stream = r.array(int(offsets[-1]), np.uint8)
        raw = r.array(n * layout.nraw, np.uint8)
        r.expect_end()
        rc = kn.decode_chunk(stream, offsets, raw, layout.s, layout.nraw, table.dec, out)
        if rc != 0:
            raise CodecError({-1: "invalid code in stream", -2: "coded stream truncated",
                              -3: "trailing bytes after coded stream"}.get(rc, f"decoder error {rc}"))
