"""Triton kernels of the lossless exponent coder (segmented layout, wire version 2).

Notable:
- The device does the per-element work: the symbol histogram of every chunk
  (``tl.histogram``), the bit count of every lane, the bit packing, the split
  of the raw plane, and the decode. The host only sees what is tiny: the
  chunks' 256-bin histograms (to pick each chunk's table with the very code
  the CPU path uses, :meth:`LosslessCodec.pick`), the lanes' byte sizes
  (u16 each, 2 bytes per ``lane_syms`` elements) and the finished payload.
  The tensor itself is never copied to host memory before it is coded.
- A lane is one program lane: lane l of a chunk codes elements l, l + L, ...
  of that chunk, so at every step neighbouring lanes touch neighbouring
  elements (coalesced loads and stores). Packing keeps a < 28-bit accumulator
  per lane and flushes whole bytes; decoding reads 4 bytes at the lane's bit
  position and looks the top 12 bits up in the chunk's decode table.
- The bytes are those of ``LosslessCodec(layout="segments")`` on the CPU
  (numba, locomm/compression/_kernels.py): the tests check them bit for bit
  under ``TRITON_INTERPRET=1``.
- The payload's CRC-32 is computed on the device too (locomm/kernels/crc32.py):
  zlib on the host runs at about 2 GB/s a core and would bound the codec.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from typing import TYPE_CHECKING

import numpy as np
import torch
import triton
import triton.language as tl

from locomm.compression.base import CodecError
from locomm.kernels.crc32 import crc32

if TYPE_CHECKING:
    from locomm.compression.lossless import LosslessCodec, Parsed

HIST_BLOCK = 2048  # chunk_elems <= 2**26: at most 32768 blocks on the grid's second axis
LANE_BLOCK = 128
ELEM_BLOCK = 1024


@triton.jit
def _hist_kernel(
    words_ptr, hist_ptr, numel, chunk_elems, S: tl.constexpr, WORD_MASK: tl.constexpr, BLOCK: tl.constexpr
):
    """hist[c, sym] += count, for the symbols of block (c, b) of chunk c."""
    c = tl.program_id(0)
    local = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    idx = c.to(tl.int64) * chunk_elems + local
    m = (local < chunk_elems) & (idx < numel)
    w = tl.load(words_ptr + idx, mask=m, other=0).to(tl.int64) & WORD_MASK
    sym = tl.where(m, (w >> S) & 0xFF, 256).to(tl.int32)
    h = tl.histogram(sym, 512)
    bins = tl.arange(0, 512)
    tl.atomic_add(hist_ptr + c * 256 + bins, h, mask=bins < 256)


@triton.jit
def _lane_bits_kernel(
    words_ptr,
    len_ptr,
    bits_ptr,
    c_first_ptr,
    c_n_ptr,
    c_lanes_ptr,
    c_lane0_ptr,
    blocks,
    S: tl.constexpr,
    WORD_MASK: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """bits[lane] = coded bits of each lane of coded chunk c (table row c of ``len_ptr``)."""
    c = tl.program_id(0) // blocks
    first = tl.load(c_first_ptr + c)
    n = tl.load(c_n_ptr + c)
    n_lanes = tl.load(c_lanes_ptr + c)
    lane0 = tl.load(c_lane0_ptr + c)
    lanes = (tl.program_id(0) % blocks) * BLOCK_L + tl.arange(0, BLOCK_L)
    lm = lanes < n_lanes
    acc = tl.zeros([BLOCK_L], dtype=tl.int64)
    steps = (n + n_lanes - 1) // n_lanes
    for t in range(0, steps):
        i = t * n_lanes + lanes
        m = lm & (i < n)
        w = tl.load(words_ptr + first + i, mask=m, other=0).to(tl.int64) & WORD_MASK
        sym = (w >> S) & 0xFF
        acc += tl.load(len_ptr + c * 256 + sym, mask=m, other=0).to(tl.int64)
    tl.store(bits_ptr + lane0 + lanes, acc, mask=lm)


@triton.jit
def _pack_kernel(
    words_ptr,
    code_ptr,
    len_ptr,
    out_ptr,
    lane_pos_ptr,
    c_first_ptr,
    c_n_ptr,
    c_lanes_ptr,
    c_lane0_ptr,
    blocks,
    S: tl.constexpr,
    WORD_MASK: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Write each lane's MSB-first bit stream at its byte position in ``out``."""
    c = tl.program_id(0) // blocks
    first = tl.load(c_first_ptr + c)
    n = tl.load(c_n_ptr + c)
    n_lanes = tl.load(c_lanes_ptr + c)
    lane0 = tl.load(c_lane0_ptr + c)
    lanes = (tl.program_id(0) % blocks) * BLOCK_L + tl.arange(0, BLOCK_L)
    lm = lanes < n_lanes
    pos = tl.load(lane_pos_ptr + lane0 + lanes, mask=lm, other=0)
    acc = tl.zeros([BLOCK_L], dtype=tl.int64)  # < 8 pending bits between steps, < 28 within one
    nb = tl.zeros([BLOCK_L], dtype=tl.int64)
    steps = (n + n_lanes - 1) // n_lanes
    for t in range(0, steps):
        i = t * n_lanes + lanes
        m = lm & (i < n)
        w = tl.load(words_ptr + first + i, mask=m, other=0).to(tl.int64) & WORD_MASK
        sym = (w >> S) & 0xFF
        code = tl.load(code_ptr + c * 256 + sym, mask=m, other=0).to(tl.int64)
        ln = tl.load(len_ptr + c * 256 + sym, mask=m, other=0).to(tl.int64)
        acc = (acc << ln) | code
        nb += ln
        for _ in tl.static_range(3):  # at most 27 bits pending: up to 3 whole bytes
            full = nb >= 8
            sh = tl.where(full, nb - 8, 0)
            tl.store(out_ptr + pos, ((acc >> sh) & 0xFF).to(tl.uint8), mask=full)
            pos += full.to(tl.int64)
            nb = tl.where(full, nb - 8, nb)
        acc = acc & ((1 << nb) - 1)
    tail = lm & (nb > 0)
    tl.store(out_ptr + pos, ((acc << (8 - nb)) & 0xFF).to(tl.uint8), mask=tail)


@triton.jit
def _split_kernel(
    words_ptr,
    out_ptr,
    raw_pos_ptr,
    sym_pos_ptr,
    numel,
    chunk_elems,
    S: tl.constexpr,
    WORD_MASK: tl.constexpr,
    NRAW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The raw plane of every chunk (and the symbol bytes of STORED chunks) into ``out``."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < numel
    c = idx // chunk_elems
    local = idx - c * chunk_elems
    w = tl.load(words_ptr + idx, mask=m, other=0).to(tl.int64) & WORD_MASK
    r = ((w >> (S + 8)) << S) | (w & ((1 << S) - 1))
    rp = tl.load(raw_pos_ptr + c, mask=m, other=0) + local * NRAW
    for j in tl.static_range(NRAW):
        tl.store(out_ptr + rp + j, ((r >> (8 * j)) & 0xFF).to(tl.uint8), mask=m)
    sp = tl.load(sym_pos_ptr + c, mask=m, other=-1)
    tl.store(out_ptr + sp + local, ((w >> S) & 0xFF).to(tl.uint8), mask=m & (sp >= 0))


@triton.jit
def _unpack_kernel(
    buf_ptr,
    dec_ptr,
    out_ptr,
    lane_start_ptr,
    lane_end_ptr,
    err_ptr,
    c_first_ptr,
    c_n_ptr,
    c_lanes_ptr,
    c_lane0_ptr,
    c_raw_ptr,
    blocks,
    S: tl.constexpr,
    NRAW: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """Decode the lanes of coded chunk c and merge symbols with the raw plane into ``out``.

    err[lane] = 0, 1 (invalid code), 2 (ran past the lane's end), 3 (unread bytes).
    Every load is masked to the payload, so any input bytes are safe.
    """
    c = tl.program_id(0) // blocks
    first = tl.load(c_first_ptr + c)
    n = tl.load(c_n_ptr + c)
    n_lanes = tl.load(c_lanes_ptr + c)
    lane0 = tl.load(c_lane0_ptr + c)
    raw0 = tl.load(c_raw_ptr + c)
    lanes = (tl.program_id(0) % blocks) * BLOCK_L + tl.arange(0, BLOCK_L)
    lm = lanes < n_lanes
    base = tl.load(lane_start_ptr + lane0 + lanes, mask=lm, other=0)
    size = tl.load(lane_end_ptr + lane0 + lanes, mask=lm, other=0) - base
    p = tl.zeros([BLOCK_L], dtype=tl.int64)  # bits consumed
    bad = tl.zeros([BLOCK_L], dtype=tl.int32)
    steps = (n + n_lanes - 1) // n_lanes
    for t in range(0, steps):
        i = t * n_lanes + lanes
        m = lm & (i < n)
        b = p >> 3
        v = tl.zeros([BLOCK_L], dtype=tl.int64)
        for j in tl.static_range(4):
            byte = tl.load(buf_ptr + base + b + j, mask=m & (b + j < size), other=0).to(tl.int64)
            v = (v << 8) | byte
        win = (v << (p & 7)) & 0xFFFFFFFF
        e = tl.load(dec_ptr + c * 4096 + (win >> 20), mask=m, other=0).to(tl.int64)
        ln = e & 15
        sym = e >> 4
        bad = tl.where(m & (ln == 0), 1, bad)
        esc = sym == 256
        sym = tl.where(esc, (win >> (24 - ln)) & 0xFF, sym)
        ln = tl.where(esc, ln + 8, ln)
        p += tl.where(m, ln, 0)
        r = tl.zeros([BLOCK_L], dtype=tl.int64)
        for j in tl.static_range(NRAW):
            r = r | (tl.load(buf_ptr + raw0 + i * NRAW + j, mask=m, other=0).to(tl.int64) << (8 * j))
        w = ((r >> S) << (S + 8)) | (sym << S) | (r & ((1 << S) - 1))
        tl.store(out_ptr + first + i, w.to(out_ptr.dtype.element_ty), mask=m)
    code = tl.where(bad != 0, 1, tl.where(p > 8 * size, 2, tl.where((p + 7) // 8 != size, 3, 0)))
    tl.store(err_ptr + lane0 + lanes, code.to(tl.int32), mask=lm)


def _word_view(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.int16 if x.element_size() == 2 else torch.int32)


def _dev_i64(values: list[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device)


def encode(codec: LosslessCodec, x: torch.Tensor) -> bytes:
    """The version-2 payload of ``x`` (on its device), byte for byte what the CPU path writes."""
    out = encode_device(codec, x)
    return out.cpu().numpy().tobytes()  # the compressed payload: the one large device-to-host copy


def encode_device(codec: LosslessCodec, x: torch.Tensor) -> torch.Tensor:
    """The payload as a uint8 tensor on ``x``'s device, CRC included."""
    from locomm.compression.lossless import _LAYOUTS, MODE_CONST, MODE_STORED, full_codes

    layout = _LAYOUTS[x.dtype]
    dev = x.device
    words = _word_view(x.detach().contiguous())
    numel = words.numel()
    ce = codec.chunk_elems
    n_chunks = -(-numel // ce)
    head = codec.header(x.dtype, x.shape)
    if n_chunks == 0:
        empty = head + struct.pack("<I", zlib.crc32(head))
        return torch.frombuffer(bytearray(empty), dtype=torch.uint8).to(dev)
    S, WM, NRAW = layout.s, (1 << (8 * layout.word.itemsize)) - 1, layout.nraw
    hist = torch.zeros(n_chunks, 256, dtype=torch.int32, device=dev)
    _hist_kernel[(n_chunks, triton.cdiv(min(ce, numel), HIST_BLOCK))](
        words, hist, numel, ce, S=S, WORD_MASK=WM, BLOCK=HIST_BLOCK
    )
    hist_h = hist.cpu().numpy().astype(np.int64)  # 1 KiB per chunk: the only look before coding
    picks = []
    for c in range(n_chunks):
        n = min(ce, numel - c * ce)
        picks.append((n, *codec.pick(layout, hist_h[c], n, 24 * codec.n_lanes(n))))
    coded = [c for c, (_, mode, _, _) in enumerate(picks) if mode not in (MODE_CONST, MODE_STORED)]
    lane_counts = [codec.n_lanes(picks[c][0]) for c in coded]
    lane0 = np.zeros(len(coded) + 1, dtype=np.int64)
    lane0[1:] = np.cumsum(lane_counts)
    sizes_h = np.zeros(0, dtype=np.int64)
    if coded:
        tabs = [full_codes(picks[c][2]) for c in coded]
        codes = torch.as_tensor(np.stack([t[0].astype(np.int32) for t in tabs])).to(dev)
        lens = torch.as_tensor(np.stack([t[1].astype(np.int32) for t in tabs])).to(dev)
        c_first = _dev_i64([c * ce for c in coded], dev)
        c_n = _dev_i64([picks[c][0] for c in coded], dev)
        c_lanes = _dev_i64(lane_counts, dev)
        c_lane0 = _dev_i64(lane0[:-1], dev)
        bits = torch.empty(int(lane0[-1]), dtype=torch.int64, device=dev)
        blocks = triton.cdiv(max(lane_counts), LANE_BLOCK)  # lane blocks per chunk, on one grid axis
        grid = (len(coded) * blocks,)
        _lane_bits_kernel[grid](
            words, lens, bits, c_first, c_n, c_lanes, c_lane0, blocks, S=S, WORD_MASK=WM, BLOCK_L=LANE_BLOCK
        )
        sizes_h = ((bits + 7) // 8).cpu().numpy()  # 8 bytes per lane
    # Lay the payload out on the host (positions only), then fill it on the device.
    pieces: list[tuple[int, bytes]] = [(0, head)]
    pos = len(head)
    raw_pos = np.zeros(n_chunks, dtype=np.int64)
    sym_pos = np.full(n_chunks, -1, dtype=np.int64)
    lane_pos = np.zeros(int(lane0[-1]), dtype=np.int64)
    k = 0
    for c, (n, mode, _table, mode_head) in enumerate(picks):
        if mode == MODE_CONST:
            hdr = bytes([mode]) + mode_head
            body = len(hdr) + n * NRAW
        elif mode == MODE_STORED:
            hdr = bytes([mode])
            body = len(hdr) + n + n * NRAW
        else:
            sz = sizes_h[lane0[k] : lane0[k + 1]]
            hdr = bytes([mode]) + mode_head + sz.astype("<u2").tobytes()
            body = len(hdr) + int(sz.sum()) + n * NRAW
        pieces.append((pos, struct.pack("<I", body) + hdr))
        p0 = pos + 4 + len(hdr)
        if mode == MODE_STORED:
            sym_pos[c] = p0
            raw_pos[c] = p0 + n
        elif mode == MODE_CONST:
            raw_pos[c] = p0
        else:
            lane_pos[lane0[k] : lane0[k + 1]] = p0 + np.concatenate(([0], np.cumsum(sz)[:-1]))
            raw_pos[c] = p0 + int(sz.sum())
            k += 1
        pos += 4 + body
    total = pos + 4
    out = torch.empty(total, dtype=torch.uint8, device=dev)
    hdr_bytes = np.frombuffer(b"".join(p for _, p in pieces), dtype=np.uint8)
    hdr_idx = np.concatenate([np.arange(o, o + len(p), dtype=np.int64) for o, p in pieces])
    out[torch.as_tensor(hdr_idx).to(dev)] = torch.as_tensor(hdr_bytes.copy()).to(dev)
    _split_kernel[(triton.cdiv(numel, ELEM_BLOCK),)](
        words,
        out,
        _dev_i64(raw_pos, dev),
        _dev_i64(sym_pos, dev),
        numel,
        ce,
        S=S,
        WORD_MASK=WM,
        NRAW=NRAW,
        BLOCK=ELEM_BLOCK,
    )
    if coded:
        _pack_kernel[grid](
            words,
            codes,
            lens,
            out,
            _dev_i64(lane_pos, dev),
            c_first,
            c_n,
            c_lanes,
            c_lane0,
            blocks,
            S=S,
            WORD_MASK=WM,
            BLOCK_L=LANE_BLOCK,
        )
    crc = struct.pack("<I", crc32(out[:-4]))
    out[-4:] = torch.frombuffer(bytearray(crc), dtype=torch.uint8).to(dev)
    return out


def decode(p: Parsed, device: torch.device, buf: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a parsed version-2 payload onto ``device`` with the Triton kernels.

    ``buf`` is the payload already on ``device`` (uploaded here otherwise). The
    payload's CRC is checked here, on the device, before anything is returned.
    """
    from locomm.compression.lossless import DECODE_ERRORS, MODE_CONST, MODE_STORED, LosslessCodec

    if buf is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only view: the kernels only read it
            host = torch.frombuffer(p.mv, dtype=torch.uint8)
        buf = host.to(device, non_blocking=True) if device.type != "cpu" else host
    if crc32(buf[:-4]) != struct.unpack("<I", p.mv[-4:])[0]:
        raise CodecError("checksum mismatch: payload corrupted or truncated")
    layout = p.layout
    word_dtype = torch.int16 if layout.word.itemsize == 2 else torch.int32
    out = torch.empty(p.numel, dtype=word_dtype, device=device)
    if p.numel == 0:
        return out.view(p.dtype).reshape(p.shape)
    parser = LosslessCodec()
    chunks = [parser.chunk(p, c) for c in range(len(p.spans))]
    S, NRAW = layout.s, layout.nraw
    coded = [ch for ch in chunks if ch.mode not in (MODE_CONST, MODE_STORED)]
    if coded:
        lane_counts = [len(ch.offsets) - 1 for ch in coded]
        lane0 = np.zeros(len(coded) + 1, dtype=np.int64)
        lane0[1:] = np.cumsum(lane_counts)
        starts = np.concatenate([ch.offsets[:-1] for ch in coded])
        ends = np.concatenate([ch.offsets[1:] for ch in coded])
        dec = torch.as_tensor(np.stack([ch.table.dec.astype(np.int32) for ch in coded])).to(device)  # type: ignore[union-attr]
        err = torch.zeros(int(lane0[-1]), dtype=torch.int32, device=device)
        blocks = triton.cdiv(max(lane_counts), LANE_BLOCK)
        _unpack_kernel[(len(coded) * blocks,)](
            buf,
            dec,
            out,
            _dev_i64(starts, device),
            _dev_i64(ends, device),
            err,
            _dev_i64([ch.first for ch in coded], device),
            _dev_i64([ch.n for ch in coded], device),
            _dev_i64(lane_counts, device),
            _dev_i64(lane0[:-1], device),
            _dev_i64([ch.raw0 for ch in coded], device),
            blocks,
            S=S,
            NRAW=NRAW,
            BLOCK_L=LANE_BLOCK,
        )
        worst = int(err.max())
        if worst:
            raise CodecError(DECODE_ERRORS[-worst])
    for ch in chunks:  # CONST and STORED chunks: a few elementwise ops where the output lies
        if ch.mode not in (MODE_CONST, MODE_STORED):
            continue
        n = ch.n
        rb = buf[ch.raw0 : ch.raw0 + n * NRAW].to(torch.int64).view(n, NRAW)
        r = rb[:, 0]
        for j in range(1, NRAW):
            r = r | (rb[:, j] << (8 * j))
        if ch.mode == MODE_CONST:
            sym: torch.Tensor | int = ch.sym
        else:
            sym = buf[ch.offsets[0] : ch.offsets[0] + n].to(torch.int64)
        w = ((r >> S) << (S + 8)) | (sym << S) | (r & ((1 << S) - 1))
        if word_dtype == torch.int16:
            w = torch.where(w >= 1 << 15, w - (1 << 16), w)
        else:
            w = torch.where(w >= 1 << 31, w - (1 << 32), w)
        out[ch.first : ch.first + n] = w.to(word_dtype)
    return out.view(p.dtype).reshape(p.shape)


__all__ = ["decode", "encode", "encode_device"]
