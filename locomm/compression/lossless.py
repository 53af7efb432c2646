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

The wire format (header, chunk modes, the two stream layouts, parsing) is
its own module, :mod:`locomm.compression.lossless_format`; in short:

- version 1 (``layout="lanes"``): 4 lane streams per coded chunk (its
  contiguous quarters). Fast on one CPU core, but a GPU cannot decode it in
  parallel.
- version 2 (``layout="segments"``, the default): L = ceil(n / lane_syms)
  interleaved lanes (element i in lane i % L). The CPU (numba,
  locomm/kernels/lossless_cpu.py) and GPU (Triton, locomm/kernels/lossless.py,
  planned by compression/lossless_device.py) coders write the same bytes,
  and thousands of lanes decode independently.

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
from typing import Any, ClassVar

import numpy as np
import torch

from locomm.compression import _huffman as hf
from locomm.compression.base import Codec, CodecError
from locomm.compression.lossless_format import (
    FLOAT_LAYOUTS,
    IDENTITY,
    LANES,
    LAYOUTS,
    MAGIC,
    MAX_CHUNK_ELEMS,
    MAX_CODE_BITS,
    MAX_LANE_SYMS,
    MODE_CONST,
    MODE_EMPIRICAL,
    MODE_MODEL,
    MODE_STORED,
    VERSION_LANES,
    VERSION_SEGMENTS,
    Chunk,
    FloatLayout,
    Parsed,
    check_crc,
    full_codes,
    lane_plan,
)
from locomm.compression.lossless_format import header as _header
from locomm.compression.lossless_format import n_lanes as _n_lanes
from locomm.compression.lossless_format import parse as _parse
from locomm.compression.lossless_format import parse_chunk as _parse_chunk
from locomm.kernels import StreamError
from locomm.kernels import lossless_cpu as kc

_LAYOUTS = FLOAT_LAYOUTS  # the name the tests and older callers use
_NO_SYMS = np.zeros(0, dtype=np.uint8)


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
        if x.dtype not in FLOAT_LAYOUTS:
            raise TypeError(f"lossless codes bfloat16, float16 and float32 tensors, got {x.dtype}")
        from locomm.kernels import resolve_impl

        if self.version == VERSION_SEGMENTS and resolve_impl(self.impl, x.device) == "triton":
            from locomm.compression import lossless_device

            yield lossless_device.encode(self, x)
            return
        layout = FLOAT_LAYOUTS[x.dtype]
        x = x.detach().to("cpu").contiguous()
        words = layout.words_of(x)
        head = self.header(x.dtype, x.shape)
        crc = zlib.crc32(head)
        yield head
        starts = range(0, words.size, self.chunk_elems)
        chunks = (words[i : i + self.chunk_elems] for i in starts)
        enc = functools.partial(self._encode_chunk, layout)
        if self.threads > 1 and len(starts) > 1:
            results: Iterator[list[bytes | memoryview]] = _pool(self.threads).map(enc, chunks)
        else:
            results = (enc(c) for c in chunks)
        for pieces in results:
            for p in pieces:
                crc = zlib.crc32(p, crc)
                yield p
        yield struct.pack("<I", crc)

    def header(self, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> bytes:
        """The payload's fixed header (magic, version, dtype, shape, chunk size[, lane size])."""
        return _header(self.version, dtype, shape, self.chunk_elems, self.lane_syms)

    def n_lanes(self, n: int) -> int:
        """Lanes of an ``n``-element chunk in the segmented layout."""
        return _n_lanes(n, self.lane_syms)

    def lanes_bits(self, n: int) -> int:
        """What a coded ``n``-element chunk's lane sizes (and their padding) cost on top of its codes."""
        return 32 * LANES if self.version == VERSION_LANES else 24 * self.n_lanes(n)

    def pick(
        self, layout: FloatLayout, sym_hist: np.ndarray, n: int, lanes_bits: int
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
        best: tuple[int, hf.Table | None, bytes] = (MODE_STORED, IDENTITY, b"")
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
    def _fit_sigma(layout: FloatLayout, sym_hist: np.ndarray) -> tuple[int, hf.Table, int] | None:
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

    def _gap_too_big(self, sym_hist: np.ndarray, model: hf.Table | None, n: int) -> bool:
        """The ZipCCL fallback test: model cross-entropy minus histogram entropy, per symbol."""
        if model is None:
            return True
        h = sym_hist[sym_hist > 0].astype(np.float64)
        entropy_bits = float(-(h * np.log2(h / n)).sum())
        return model.cross_entropy_bits(sym_hist) - entropy_bits > self.gap_bits * n

    def _choose(self, layout: FloatLayout, words: np.ndarray) -> tuple[int, hf.Table | None, bytes]:
        """A chunk's (mode, table, mode header bytes) from its words."""
        n = words.size
        return self.pick(layout, kc.sym_hist(words, layout.s), n, self.lanes_bits(n))

    def _encode_chunk(self, layout: FloatLayout, words: np.ndarray) -> list[bytes | memoryview]:
        """One chunk: ``chunk_len u32 | mode u8 | mode header [| lane sizes] | stream | raw plane``."""
        n = words.size
        mode, table, mode_head = self._choose(layout, words)
        raw = np.empty(n * layout.nraw, dtype=np.uint8)
        if mode == MODE_CONST:
            kc.split(words, layout.s, layout.nraw, raw, _NO_SYMS)
            body = [bytes([mode]) + mode_head, memoryview(raw)]
        elif mode == MODE_STORED:  # the symbols raw: the same bytes in both versions
            syms = np.empty(n, dtype=np.uint8)
            kc.split(words, layout.s, layout.nraw, raw, syms)
            body = [bytes([mode]), memoryview(syms), memoryview(raw)]
        else:
            assert table is not None
            kc.split(words, layout.s, layout.nraw, raw, _NO_SYMS)
            code_full, len_full = full_codes(table)
            first, count, stride = lane_plan(self.version, n, self.lane_syms)
            sizes = np.zeros(first.size, dtype=np.int64)
            stream = np.empty(-(-MAX_CODE_BITS * n // 8) + first.size, dtype=np.uint8)
            used = kc.encode_lanes(words, layout.s, code_full, len_full, first, count, stride, sizes, stream)
            size_type = "<u4" if self.version == VERSION_LANES else "<u2"
            lanes_head = sizes.astype(size_type).tobytes()
            body = [bytes([mode]) + mode_head + lanes_head, memoryview(stream)[:used], memoryview(raw)]
        total = sum(len(b) for b in body)
        return [struct.pack("<I", total), *body]

    # ------------------------------------------------------------------ decode

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        device: str | torch.device | None = None,
        max_numel: int | None = None,
        **context: Any,
    ) -> torch.Tensor:
        """Decode a payload of either version, of at most ``max_numel`` elements, onto ``device`` (default CPU).

        A version-2 payload decoded onto a CUDA device (or with
        ``impl="triton"``) runs the Triton kernels there; version 1 decodes on
        the CPU and is then moved.
        """
        from locomm.kernels import resolve_impl

        dev = torch.device("cpu") if device is None else torch.device(device)
        fast = resolve_impl(self.impl, dev) == "triton"
        p = self.parse(data, check_crc=not fast, max_numel=max_numel)  # the Triton path checks the CRC on the device
        if fast and p.version == VERSION_SEGMENTS:
            from locomm.compression import lossless_device

            return lossless_device.decode(p, dev)
        if fast:
            check_crc(p.mv)
        out = self._decode_cpu(p)
        return out if dev.type == "cpu" else out.to(dev)

    def parse(
        self, data: bytes | bytearray | memoryview, check_crc: bool = True, max_numel: int | None = None
    ) -> Parsed:
        """Check a payload's frame and header and split it into chunks (see :func:`lossless_format.parse`)."""
        return _parse(data, check_crc, max_numel)

    def chunk(self, p: Parsed, c: int) -> Chunk:
        """Parse chunk ``c``'s header (see :func:`lossless_format.parse_chunk`)."""
        return _parse_chunk(p, c)

    def _decode_cpu(self, p: Parsed) -> torch.Tensor:
        layout = p.layout
        # numpy's allocator asks the OS for huge pages on a large buffer (torch.empty does not): the first
        # writes into a 64 MB output then cost about a tenth of the page faults.
        out_words = np.empty(p.numel, dtype=layout.word)
        out = torch.from_numpy(out_words.view(np.int16 if layout.word.itemsize == 2 else np.int32))
        if not p.numel:  # numpy gives an empty array stride 0, which torch cannot view as another dtype
            out = torch.empty(0, dtype=out.dtype)
        buf = np.frombuffer(p.mv, dtype=np.uint8)

        def one(c: int) -> None:
            ch = _parse_chunk(p, c)
            _decode_chunk(p, ch, buf, out_words[ch.first : ch.first + ch.n])

        if self.threads > 1 and len(p.spans) > 1:
            list(_pool(self.threads).map(one, range(len(p.spans))))
        else:
            for c in range(len(p.spans)):
                one(c)
        return out.view(p.dtype).reshape(p.shape)


def _decode_chunk(p: Parsed, ch: Chunk, buf: np.ndarray, out: np.ndarray) -> None:
    """Decode one parsed chunk of the payload ``buf`` into ``out`` (its ``ch.n`` words)."""
    n, layout = ch.n, p.layout
    raw = buf[ch.raw0 : ch.raw0 + n * layout.nraw]
    if ch.mode == MODE_CONST:
        kc.merge(np.array([ch.sym], dtype=np.uint8), 0, raw, layout.s, layout.nraw, out)
        return
    if ch.mode == MODE_STORED:
        s0 = int(ch.offsets[0])
        kc.merge(buf[s0 : s0 + n], 1, raw, layout.s, layout.nraw, out)
        return
    assert ch.table is not None
    first, count, stride = lane_plan(p.version, n, p.lane_syms)
    try:
        kc.decode_lanes(
            buf, ch.offsets[:-1], ch.offsets[1:], first, count, stride, raw, layout.s, layout.nraw, ch.table.dec, out
        )
    except StreamError as e:
        raise CodecError(str(e)) from e


__all__ = [
    "LAYOUTS",
    "MAGIC",
    "MAX_CHUNK_ELEMS",
    "MAX_LANE_SYMS",
    "MODE_CONST",
    "MODE_EMPIRICAL",
    "MODE_MODEL",
    "MODE_STORED",
    "VERSION_LANES",
    "VERSION_SEGMENTS",
    "Chunk",
    "LosslessCodec",
    "Parsed",
    "full_codes",
]
