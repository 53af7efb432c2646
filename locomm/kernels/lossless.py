"""Triton kernels of the lossless exponent coder (segmented layout, wire version 2).

Notable:
- Launchers over tensors and integers; the caller (the codec's
  device path, compression/lossless_device.py) plans the payload with the wire format's module. The
  device does the per-element work: the symbol histogram of every chunk
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
  (numba, locomm/kernels/lossless_cpu.py): the tests check them bit for bit
  under ``TRITON_INTERPRET=1``.
- The caller computes the payload's CRC-32 on the device too
  (locomm/kernels/crc32.py): zlib on the host runs at about 2 GB/s a core.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from locomm.kernels import StreamError

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


def word_view(x: torch.Tensor) -> torch.Tensor:
    """A contiguous float tensor's bits as a flat int16/int32 tensor (no copy)."""
    return x.reshape(-1).view(torch.int16 if x.element_size() == 2 else torch.int32)


def _mask(words: torch.Tensor) -> int:
    return (1 << (8 * words.element_size())) - 1


def chunk_histograms(words: torch.Tensor, chunk_elems: int, s: int) -> torch.Tensor:
    """(chunks, 256) int32: the histogram of the symbols ``(w >> s) & 0xFF`` of every chunk of ``words``."""
    numel = words.numel()
    n_chunks = -(-numel // chunk_elems)
    hist = torch.zeros(n_chunks, 256, dtype=torch.int32, device=words.device)
    if n_chunks:
        grid = (n_chunks, triton.cdiv(min(chunk_elems, numel), HIST_BLOCK))
        _hist_kernel[grid](words, hist, numel, chunk_elems, S=s, WORD_MASK=_mask(words), BLOCK=HIST_BLOCK)
    return hist


class LanePlan(NamedTuple):
    """The interleaved lanes of the coded chunks of one launch (int64 tensors on the device).

    Chunk j starts at element ``first[j]``, has ``n[j]`` elements in ``lanes[j]``
    lanes (element i of the chunk in lane i % lanes[j]), and its lanes are
    rows ``lane0[j]:lane0[j] + lanes[j]`` of the per-lane arrays.
    """

    first: torch.Tensor
    n: torch.Tensor
    lanes: torch.Tensor
    lane0: torch.Tensor
    total_lanes: int
    max_lanes: int

    @property
    def grid(self) -> tuple[int]:
        return (self.first.numel() * self.blocks,)

    @property
    def blocks(self) -> int:
        return triton.cdiv(self.max_lanes, LANE_BLOCK)  # lane blocks per chunk, on one grid axis


def lane_plan(first: list[int], n: list[int], lanes: list[int], device: torch.device) -> LanePlan:
    """A :class:`LanePlan` from host lists (one entry per coded chunk)."""
    lane0 = np.zeros(len(lanes) + 1, dtype=np.int64)
    lane0[1:] = np.cumsum(lanes)
    dev = [_dev_i64(v, device) for v in (first, n, lanes, lane0[:-1])]
    return LanePlan(*dev, int(lane0[-1]), max(lanes))


def lane_bits(words: torch.Tensor, lens: torch.Tensor, plan: LanePlan, s: int) -> torch.Tensor:
    """int64 (total_lanes,): the coded bits of every lane; ``lens`` is (chunks, 256) code lengths."""
    bits = torch.empty(plan.total_lanes, dtype=torch.int64, device=words.device)
    _lane_bits_kernel[plan.grid](
        words, lens, bits, plan.first, plan.n, plan.lanes, plan.lane0, plan.blocks,
        S=s, WORD_MASK=_mask(words), BLOCK_L=LANE_BLOCK,
    )  # fmt: skip
    return bits


def split(
    words: torch.Tensor, out: torch.Tensor, raw_pos: torch.Tensor, sym_pos: torch.Tensor, chunk_elems: int, s: int,
    nraw: int,
) -> None:  # fmt: skip
    """Write every chunk's raw plane at ``out[raw_pos[c]:]`` (and its symbols at ``out[sym_pos[c]:]`` where >= 0)."""
    numel = words.numel()
    _split_kernel[(triton.cdiv(numel, ELEM_BLOCK),)](
        words, out, raw_pos, sym_pos, numel, chunk_elems, S=s, WORD_MASK=_mask(words), NRAW=nraw, BLOCK=ELEM_BLOCK
    )


def pack(
    words: torch.Tensor, codes: torch.Tensor, lens: torch.Tensor, out: torch.Tensor, lane_pos: torch.Tensor,
    plan: LanePlan, s: int,
) -> None:  # fmt: skip
    """Write each lane's MSB-first bit stream at ``out[lane_pos[lane]:]`` (codes/lens: (chunks, 256) full codes)."""
    _pack_kernel[plan.grid](
        words, codes, lens, out, lane_pos, plan.first, plan.n, plan.lanes, plan.lane0, plan.blocks,
        S=s, WORD_MASK=_mask(words), BLOCK_L=LANE_BLOCK,
    )  # fmt: skip


def unpack(
    buf: torch.Tensor, dec: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
    raw0: torch.Tensor, plan: LanePlan, s: int, nraw: int,
) -> None:  # fmt: skip
    """Decode the lanes ``buf[starts[l]:ends[l]]`` of every coded chunk into ``out`` (words), merging the raw
    plane at ``buf[raw0[j]:]``; ``dec`` is (chunks, 4096) decode tables.

    Raises:
        StreamError: some lane holds an invalid code, runs past its end or leaves bytes unread.
    """
    err = torch.zeros(plan.total_lanes, dtype=torch.int32, device=out.device)
    _unpack_kernel[plan.grid](
        buf, dec, out, starts, ends, err, plan.first, plan.n, plan.lanes, plan.lane0, raw0, plan.blocks,
        S=s, NRAW=nraw, BLOCK_L=LANE_BLOCK,
    )  # fmt: skip
    worst = int(err.max()) if plan.total_lanes else 0
    if worst:
        raise StreamError(worst)


def _dev_i64(values: list[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device)


__all__ = ["LanePlan", "chunk_histograms", "lane_bits", "lane_plan", "pack", "split", "unpack", "word_view"]
