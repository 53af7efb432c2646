"""The ``lossless`` codec's device path: version-2 payloads planned here, coded by the Triton kernels.

The wire format comes from :mod:`locomm.compression.lossless_format`; the
kernels (locomm/kernels/lossless.py) only take tensors and integers. Encoding
runs: the chunks' histograms on the device, each chunk's table picked on the
host with :meth:`LosslessCodec.pick` (the CPU path's own choice), the lanes'
bit counts on the device, the payload laid out on the host (positions only),
then the raw planes and lane streams written on the device and the CRC-32
taken there. The bytes are those of the CPU path; the tests check them under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from typing import Protocol

import numpy as np
import torch

from locomm.compression import _huffman as hf
from locomm.compression.base import CodecError
from locomm.compression.lossless_format import (
    FLOAT_LAYOUTS,
    MODE_CONST,
    MODE_STORED,
    FloatLayout,
    Parsed,
    full_codes,
    parse_chunk,
)
from locomm.kernels import StreamError
from locomm.kernels import lossless as kl
from locomm.kernels.crc32 import crc32


class LosslessCodec(Protocol):
    """What the device path asks of ``compression.lossless.LosslessCodec``: its chunking and its choices (one rule
    for the CPU and device coders, so both write the same bytes)."""

    chunk_elems: int

    def header(self, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> bytes: ...

    def n_lanes(self, n: int) -> int: ...

    def lanes_bits(self, n: int) -> int: ...

    def pick(
        self, layout: FloatLayout, sym_hist: np.ndarray, n: int, lanes_bits: int
    ) -> tuple[int, hf.Table | None, bytes]: ...


def _dev_i64(values: list[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device)


def encode(codec: LosslessCodec, x: torch.Tensor) -> bytes:
    """The version-2 payload of ``x`` (on its device), byte for byte what the CPU path writes."""
    out = encode_device(codec, x)
    return out.cpu().numpy().tobytes()  # the compressed payload: the one large device-to-host copy


def encode_device(codec: LosslessCodec, x: torch.Tensor) -> torch.Tensor:
    """The payload as a uint8 tensor on ``x``'s device, CRC included."""
    layout = FLOAT_LAYOUTS[x.dtype]
    dev = x.device
    words = kl.word_view(x.detach().contiguous())
    numel = words.numel()
    ce = codec.chunk_elems
    n_chunks = -(-numel // ce)
    head = codec.header(x.dtype, x.shape)
    if n_chunks == 0:
        empty = head + struct.pack("<I", zlib.crc32(head))
        return torch.frombuffer(bytearray(empty), dtype=torch.uint8).to(dev)
    S, NRAW = layout.s, layout.nraw
    hist_h = kl.chunk_histograms(words, ce, S).cpu().numpy().astype(np.int64)  # 1 KiB per chunk
    picks = []
    for c in range(n_chunks):
        n = min(ce, numel - c * ce)
        picks.append((n, *codec.pick(layout, hist_h[c], n, codec.lanes_bits(n))))
    coded = [c for c, (_, mode, _, _) in enumerate(picks) if mode not in (MODE_CONST, MODE_STORED)]
    lane_counts = [codec.n_lanes(picks[c][0]) for c in coded]
    lane0 = np.zeros(len(coded) + 1, dtype=np.int64)
    lane0[1:] = np.cumsum(lane_counts)
    sizes_h = np.zeros(0, dtype=np.int64)
    plan = None
    if coded:
        tabs = [full_codes(picks[c][2]) for c in coded]
        codes = torch.as_tensor(np.stack([t[0].astype(np.int32) for t in tabs])).to(dev)
        lens = torch.as_tensor(np.stack([t[1].astype(np.int32) for t in tabs])).to(dev)
        plan = kl.lane_plan([c * ce for c in coded], [picks[c][0] for c in coded], lane_counts, dev)
        sizes_h = ((kl.lane_bits(words, lens, plan, S) + 7) // 8).cpu().numpy()  # 8 bytes per lane
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
    kl.split(words, out, _dev_i64(raw_pos, dev), _dev_i64(sym_pos, dev), ce, S, NRAW)
    if plan is not None:
        kl.pack(words, codes, lens, out, _dev_i64(lane_pos, dev), plan, S)
    crc = struct.pack("<I", crc32(out[:-4]))
    out[-4:] = torch.frombuffer(bytearray(crc), dtype=torch.uint8).to(dev)
    return out


def decode(p: Parsed, device: torch.device, buf: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a parsed version-2 payload onto ``device`` with the Triton kernels.

    ``buf`` is the payload already on ``device`` (uploaded here otherwise). The
    payload's CRC is checked here, on the device, before anything is returned.
    """
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
    chunks = [parse_chunk(p, c) for c in range(len(p.spans))]
    S, NRAW = layout.s, layout.nraw
    coded = [ch for ch in chunks if ch.mode not in (MODE_CONST, MODE_STORED)]
    if coded:
        plan = kl.lane_plan(
            [ch.first for ch in coded], [ch.n for ch in coded], [len(ch.offsets) - 1 for ch in coded], device
        )
        starts = _dev_i64(np.concatenate([ch.offsets[:-1] for ch in coded]), device)
        ends = _dev_i64(np.concatenate([ch.offsets[1:] for ch in coded]), device)
        dec = torch.as_tensor(np.stack([ch.table.dec.astype(np.int32) for ch in coded])).to(device)  # type: ignore[union-attr]
        try:
            kl.unpack(buf, dec, out, starts, ends, _dev_i64([ch.raw0 for ch in coded], device), plan, S, NRAW)
        except StreamError as e:
            raise CodecError(str(e)) from e
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
