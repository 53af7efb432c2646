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
    [version 2: lane_syms u32]
    then per chunk: chunk_len u32 | mode u8 | mode header | stream | raw plane
    then crc32 u32 over everything before it

Two layouts of a coded chunk's stream, told apart by the version byte:

- version 1 (``layout="lanes"``): 4 lane streams (contiguous quarters), their
  byte sizes as u32 after the mode header. Fast on one CPU core, but one long
  dependency chain per quarter: a GPU cannot decode it in parallel.
- version 2 (``layout="segments"``, the default): L = ceil(n / lane_syms)
  interleaved lanes (element i is in lane i % L), each an MSB-first stream
  padded to a byte, sizes as u16 after the mode header. CPU (numba) and GPU
  (Triton, locomm/kernels/lossless.py) encoders write the same bytes, and
  thousands of lanes decode independently.

``CONST`` and ``STORED`` chunks are the same in both versions. Every version
stays decodable.

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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from locomm.compression import _huffman as hf
from locomm.compression import _kernels as kn
from locomm.compression.base import (
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

VERSION_LANES, VERSION_SEGMENTS = 1, 2
"""Version byte of the two stream layouts (the 4-lane one is the original wire version 1)."""

MAX_LANE_SYMS = 1 << 14
"""Upper bound on ``lane_syms``: a lane's byte size (at most 20 bits a symbol) fits its u16."""

LAYOUTS = {"lanes": VERSION_LANES, "segments": VERSION_SEGMENTS}


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
        layout: ``"segments"`` (version 2, default: CPU and GPU speak it) or
            ``"lanes"`` (version 1, CPU only). Decoding reads both.
        lane_syms: symbols per lane of the segmented layout (at most
            :data:`MAX_LANE_SYMS`); more lanes decode more in parallel and cost
            ~3 bytes of header and padding each.
        impl: ``"auto"`` (Triton kernels for CUDA tensors, numba for CPU
            tensors), ``"cpu"`` or ``"triton"`` (forced; on CPU tensors it needs
            ``TRITON_INTERPRET=1``). Same bytes either way.
    """

    name: ClassVar[str] = "lossless"
    lossless: ClassVar[bool] = True

    def __init__(
        self,
        chunk_elems: int = 1 << 20,
        threads: int = 1,
        table: str = "auto",
        gap_bits: float = 0.02,
        layout: str = "segments",
        lane_syms: int = 1024,
        impl: str = "auto",
    ) -> None:
        from locomm.kernels import check_impl

        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if not 1 <= lane_syms <= MAX_LANE_SYMS:
            raise ValueError(f"lane_syms must be in [1, {MAX_LANE_SYMS}], got {lane_syms}")
        self.layout = layout
        self.version = LAYOUTS[layout]
        self.lane_syms = int(lane_syms)
        self.impl = check_impl(impl)
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
        return (
            f"LosslessCodec(chunk_elems={self.chunk_elems}, threads={self.threads}, table={self.table!r}, "
            f"layout={self.layout!r}, impl={self.impl!r})"
        )

    # ------------------------------------------------------------------ encode

    def encode(self, x: torch.Tensor, **context: Any) -> bytes:
        return b"".join(self.iter_encode(x))

    def iter_encode(self, x: torch.Tensor) -> Iterator[bytes | memoryview]:
        """The payload as a sequence of pieces (header, chunks, CRC) for streaming.

        ``b"".join(codec.iter_encode(x)) == codec.encode(x)``. A CUDA tensor
        (or ``impl="triton"``) is coded by the Triton kernels where it lies
        and comes back as one piece.
        """
        if x.dtype not in _LAYOUTS:
            raise TypeError(f"lossless codes bfloat16, float16 and float32 tensors, got {x.dtype}")
        from locomm.kernels import resolve_impl

        if self.version == VERSION_SEGMENTS and resolve_impl(self.impl, x.device) == "triton":
            from locomm.kernels import lossless as kl

            yield kl.encode(self, x)
            return
        layout = _LAYOUTS[x.dtype]
        x = x.detach().to("cpu").contiguous()
        words = layout.words_of(x)
        head = self.header(x.dtype, x.shape)
        crc = zlib.crc32(head)
        yield head
        starts = range(0, words.size, self.chunk_elems)
        chunks = (words[i : i + self.chunk_elems] for i in starts)
        enc = self._encode_chunk if self.version == VERSION_LANES else self._encode_chunk_v2
        if self.threads > 1 and len(starts) > 1:
            results: Iterator[list[bytes | memoryview]] = _pool(self.threads).map(
                functools.partial(enc, layout), chunks
            )
        else:
            results = (enc(layout, c) for c in chunks)
        for pieces in results:
            for p in pieces:
                crc = zlib.crc32(p, crc)
                yield p
        yield struct.pack("<I", crc)

    def header(self, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> bytes:
        """The payload's fixed header (magic, version, dtype, shape, chunk size[, lane size])."""
        w = Writer()
        w.raw(MAGIC + bytes([self.version]))
        w.u8(dtype_code(dtype))
        w.shape(shape)
        w.u32(self.chunk_elems)
        if self.version == VERSION_SEGMENTS:
            w.u32(self.lane_syms)
        return w.getvalue()

    def n_lanes(self, n: int) -> int:
        """Lanes of an ``n``-element chunk in the segmented layout."""
        return max(1, -(-n // self.lane_syms))

    def _choose(self, layout: _Layout, words: np.ndarray) -> tuple[int, hf.Table | None, bytes, np.ndarray]:
        """Pick a version-1 chunk's mode: (mode, table, mode header bytes, lane stream sizes)."""
        n = words.size
        lane_hist = np.zeros((kn.LANES, 256), dtype=np.int64)
        kn.lane_hist(words, layout.s, lane_hist)
        mode, table, head = self.pick(layout, lane_hist.sum(axis=0), n, 32 * kn.LANES)
        if mode == MODE_CONST:
            return mode, None, head, np.zeros(kn.LANES, dtype=np.int64)
        if mode == MODE_STORED:
            return mode, _IDENTITY, head, np.array([hi - lo for lo, hi in kn.lane_bounds(n)], dtype=np.int64)
        assert table is not None
        return mode, table, head, self._lane_bytes(table, lane_hist)

    def pick(
        self, layout: _Layout, sym_hist: np.ndarray, n: int, lanes_bits: int
    ) -> tuple[int, hf.Table | None, bytes]:
        """A chunk's mode from its symbol histogram alone: (mode, table, mode header bytes).

        ``lanes_bits`` is what a coded chunk's lane sizes (and padding) cost
        on top of the codes. A pure function of integers, so every
        implementation (numba, Triton) that counts the same histogram makes
        the same choice and writes the same bytes.
        """
        used = np.nonzero(sym_hist)[0]
        if len(used) == 1:
            return MODE_CONST, None, bytes([int(used[0])])
        best: tuple[int, hf.Table | None, bytes] = (MODE_STORED, _IDENTITY, b"")
        best_bits = 8 * n
        model: hf.Table | None = None
        if self.table != "empirical":
            found = self._fit_sigma(layout, sym_hist)
            if found is not None:
                q, model, bits = found
                if bits + 32 + lanes_bits < best_bits:
                    best_bits = bits + 32 + lanes_bits
                    best = (MODE_MODEL, model, struct.pack("<f", hf.q_to_sigma(q)))
        if self.table == "empirical" or (self.table == "auto" and self._gap_too_big(sym_hist, model, n)):
            table = hf.empirical_table(sym_hist)
            bits = table.cost_bits(sym_hist) + 8 * hf.PACKED_LENGTHS_BYTES + lanes_bits
            if bits < best_bits:
                best = (MODE_EMPIRICAL, table, hf.pack_lengths(table.lengths))
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

    def _encode_chunk(
        self,
        layout: _Layout,
        words: np.ndarray,
        choice: tuple[int, hf.Table | None, bytes, np.ndarray | None] | None = None,
    ) -> list[bytes | memoryview]:
        n = words.size
        mode, table, mode_head, lane_bytes = self._choose(layout, words) if choice is None else choice
        raw = np.empty(n * layout.nraw, dtype=np.uint8)
        if mode == MODE_STORED and lane_bytes is None:
            lane_bytes = np.array([hi - lo for lo, hi in kn.lane_bounds(n)], dtype=np.int64)
        if mode == MODE_CONST:
            # the kernel still splits off the raw bits; its (identity) stream is discarded
            table = _IDENTITY
            lane_bytes = np.array([hi - lo for lo, hi in kn.lane_bounds(n)], dtype=np.int64)
        assert table is not None
        offsets = np.zeros(kn.LANES + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(lane_bytes)
        stream = np.empty(int(offsets[-1]), dtype=np.uint8)
        kn.encode_chunk(
            words,
            layout.s,
            layout.nraw,
            table.enc_codes,
            table.enc_lens,
            table.esc_code,
            table.esc_len,
            stream,
            offsets,
            raw,
        )
        if mode == MODE_CONST:
            body = [bytes([mode]) + mode_head, memoryview(raw)]
        else:
            lanes_head = b"" if mode == MODE_STORED else struct.pack(f"<{kn.LANES}I", *lane_bytes)
            body = [bytes([mode]) + mode_head + lanes_head, memoryview(stream), memoryview(raw)]
        total = sum(len(b) for b in body)
        return [struct.pack("<I", total), *body]

    def _encode_chunk_v2(self, layout: _Layout, words: np.ndarray) -> list[bytes | memoryview]:
        n = words.size
        lane_hist = np.zeros((kn.LANES, 256), dtype=np.int64)
        kn.lane_hist(words, layout.s, lane_hist)
        n_lanes = self.n_lanes(n)
        mode, table, mode_head = self.pick(layout, lane_hist.sum(axis=0), n, 24 * n_lanes)
        if mode in (MODE_CONST, MODE_STORED):  # the same bytes in both versions
            return self._encode_chunk(layout, words, (mode, table, mode_head, None))
        assert table is not None
        code_full, len_full = full_codes(table)
        sizes = np.zeros(n_lanes, dtype=np.int64)
        stream = np.empty(-(-20 * n // 8) + n_lanes, dtype=np.uint8)
        raw = np.empty(n * layout.nraw, dtype=np.uint8)
        used = kn.seg_encode(words, layout.s, layout.nraw, code_full, len_full, n_lanes, sizes, stream, raw)
        body = [bytes([mode]) + mode_head + sizes.astype("<u2").tobytes(), memoryview(stream)[:used], memoryview(raw)]
        total = sum(len(b) for b in body)
        return [struct.pack("<I", total), *body]

    # ------------------------------------------------------------------ decode

    def decode(
        self, data: bytes | bytearray | memoryview, device: str | torch.device | None = None, **context: Any
    ) -> torch.Tensor:
        """Decode a payload of either version onto ``device`` (default CPU).

        A version-2 payload decoded onto a CUDA device (or with
        ``impl="triton"``) runs the Triton kernels there; version 1 decodes on
        the CPU and is then moved.
        """
        from locomm.kernels import resolve_impl

        dev = torch.device("cpu") if device is None else torch.device(device)
        fast = resolve_impl(self.impl, dev) == "triton"
        p = self.parse(data, check_crc=not fast)  # the Triton path checks the CRC on the device
        if fast and p.version == VERSION_SEGMENTS:
            from locomm.kernels import lossless as kl

            return kl.decode(p, dev)
        if fast:
            _check_crc(p.mv)
        out = self._decode_cpu(p)
        return out if dev.type == "cpu" else out.to(dev)

    def parse(self, data: bytes | bytearray | memoryview, check_crc: bool = True) -> Parsed:
        """Check a payload's frame and header and split it into chunks (nothing decoded yet).

        With ``check_crc=False`` the caller checks the CRC itself (before it
        returns anything); every read here is bounds-checked either way.
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
        if check_crc:
            _check_crc(mv)
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

    def chunk(self, p: Parsed, c: int) -> Chunk:
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
            return Chunk(mode, first, n, _IDENTITY, 0, np.array([s0, raw0], dtype=np.int64), raw0)
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
            sizes = np.array([r.u32() for _ in range(kn.LANES)], dtype=np.int64)
        else:
            sizes = r.array(max(1, -(-n // p.lane_syms)), np.dtype("<u2")).astype(np.int64)
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        offsets[0] = r.pos
        offsets[1:] = r.pos + np.cumsum(sizes)
        r.take(int(offsets[-1] - offsets[0]))
        raw0 = r.pos
        r.take(n * layout.nraw)
        r.expect_end()
        return Chunk(mode, first, n, table, 0, offsets, raw0)

    def _decode_cpu(self, p: Parsed) -> torch.Tensor:
        layout = p.layout
        out = torch.empty(p.numel, dtype=torch.int16 if layout.word.itemsize == 2 else torch.int32)
        out_words = out.numpy().view(layout.word)
        buf = np.frombuffer(p.mv, dtype=np.uint8)

        def one(c: int) -> None:
            ch = self.chunk(p, c)
            self._decode_chunk(p, ch, buf, out_words[ch.first : ch.first + ch.n])

        if self.threads > 1 and len(p.spans) > 1:
            list(_pool(self.threads).map(one, range(len(p.spans))))
        else:
            for c in range(len(p.spans)):
                one(c)
        return out.view(p.dtype).reshape(p.shape)

    @staticmethod
    def _decode_chunk(p: Parsed, ch: Chunk, buf: np.ndarray, out: np.ndarray) -> None:
        n, layout = ch.n, p.layout
        raw = buf[ch.raw0 : ch.raw0 + n * layout.nraw]
        if ch.mode == MODE_CONST:
            if layout.nraw == 1:
                rv = raw.astype(np.uint32)
            else:
                b = raw.reshape(n, 3).astype(np.uint32)
                rv = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
            s = layout.s
            out[:] = (((rv >> s) << (s + 8)) | (ch.sym << s) | (rv & layout.lowmask)).astype(layout.word)
            return
        assert ch.table is not None
        o = ch.offsets
        stream = buf[o[0] : o[-1]]
        rel = o - o[0]
        if ch.mode == MODE_STORED or p.version == VERSION_LANES:
            if ch.mode == MODE_STORED:
                rel = np.zeros(kn.LANES + 1, dtype=np.int64)
                rel[1:] = np.cumsum([hi - lo for lo, hi in kn.lane_bounds(n)])
            rc = kn.decode_chunk(stream, rel, raw, layout.s, layout.nraw, ch.table.dec, out)
        else:
            rc = kn.seg_decode(stream, rel, raw, layout.s, layout.nraw, len(rel) - 1, ch.table.dec, out)
        if rc != 0:
            raise CodecError(DECODE_ERRORS.get(rc, f"decoder error {rc}"))


def _check_crc(mv: memoryview) -> None:
    (crc,) = struct.unpack("<I", mv[-4:])
    if zlib.crc32(mv[:-4]) != crc:
        raise CodecError("checksum mismatch: payload corrupted or truncated")


DECODE_ERRORS = {-1: "invalid code in stream", -2: "coded stream truncated", -3: "trailing bytes after coded stream"}


class Parsed(NamedTuple):
    """A checked payload, split into chunk spans (see :meth:`LosslessCodec.parse`)."""

    mv: memoryview
    version: int
    dtype: torch.dtype
    layout: _Layout
    shape: tuple[int, ...]
    numel: int
    chunk_elems: int
    lane_syms: int
    spans: list[tuple[int, int, int]]


class Chunk(NamedTuple):
    """One chunk's header (see :meth:`LosslessCodec.chunk`); byte positions are absolute."""

    mode: int
    first: int
    n: int
    table: hf.Table | None
    sym: int  # CONST: the symbol
    offsets: np.ndarray  # coded: lane stream bounds (L + 1); STORED: [symbols, raw]
    raw0: int


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
