"""``topktiles``: SparseLoCo's top-k as the public production code runs it: 64x64 tiles, values in sigma bins.

The ``topk2bit`` codec keeps 1-D chunks of 64 and two fitted magnitude levels (one byte per selected element).
SparseLoCo's paper and Templar's code (``src/tplr/compress.py``: ``ChunkingTransformer``, ``TopKCompressor``)
tile a 2-D weight instead, and quantize the selected values in bins of standard deviations. This codec does
what that code does, with error feedback as ``topk2bit`` keeps it::

    e    = beta * e + x                        # x: this round's pseudo-gradient
    Dhat = Q(TopK_per_tile(e))                 # k largest |e| in each h x w tile
    e    = e - Dhat                            # exactly what the receiver rebuilds

- **Tiles**: a tensor of rank >= 2 is viewed as (rows, prod(rest)), rank 1 as (1, n), rank 0 as (1, 1). The
  tile is h x w with h the largest divisor of rows up to 64 and w the largest divisor of the columns up to
  64 (Templar's ``_get_smaller_split``), so tiles cover the tensor exactly: 64 x 64 = 4096 elements for
  the usual widths, fewer where a dimension has no such divisor. The receiver derives h and w from the shape
  alone; a payload that names others is refused.
- **k per tile**: ``round(density * h * w)``, at least 2 and even (Templar's ``_clamp_topk``), at most the
  tile; a tile of one element sends it. Ties go to the lower index (the canonical selection of ``topk2bit``).
- **Indices**: 12 bits each (a position in a tile of at most 4096), two to three bytes, as Templar packs them.
- **Values** (Templar's ``_quantize_values``): shifted by their mean, in ``bins`` bins of width
  ``range * std / bins`` around it (``range`` 6: the bins span 6 standard deviations of the selected values),
  each decoded to the mean of the values that fell in it (a table of ``bins`` floats sent with the payload),
  plus the shift. ``bins`` is 4 here (2-bit values, the paper's setting); Templar's default is 256 (8 bits).
  Values are packed ``8 / log2(bins)`` to a byte.

Wire size at density d and 4 bins: 14 bits per selected element (12 + 2) + a header and the bin table, about
``2.3 / d`` x smaller than fp32 (d = 0.02: ~114x). Measured as a SparseLoCo variant in benchmarks/tune.py
(``sparseloco_tiles``); the run spec still selects ``topk2bit``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch

from locomm.compression.base import (
    MAX_NDIM,
    MAX_SPARSE_NUMEL,
    CodecError,
    Reader,
    SparsePartsCodec,
    Writer,
    code_dtype,
    dtype_code,
)
from locomm.compression.topk2bit import canonical_topk

TILE = 64
"""Largest tile side: a tile holds at most 64 x 64 = 4096 elements (a 12-bit index)."""
BINS = (2, 4, 16, 256)
"""Bin counts with a whole number of values per byte (1, 2, 4 or 8 bits)."""
RANGE_SIGMAS = 6.0
"""Templar's ``quantization_range``: the bins span this many standard deviations."""


def largest_divisor(n: int, limit: int = TILE) -> int:
    """The largest divisor of ``n`` that is at most ``limit`` (1 for n <= 1)."""
    for d in range(min(n, limit), 1, -1):
        if n % d == 0:
            return d
    return 1


def tiling(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(rows, cols, h, w) of a tensor of ``shape``: its 2-D view and its tile."""
    if len(shape) == 0:
        rows, cols = 1, 1
    elif len(shape) == 1:
        rows, cols = 1, shape[0]
    else:
        rows, cols = shape[0], math.prod(shape[1:])
    return rows, cols, largest_divisor(rows), largest_divisor(cols)


def per_tile(density: float, tile: int) -> int:
    """Elements selected in a tile of ``tile`` elements at ``density``: at least 2 and even, at most the tile."""
    k = max(2, round(density * tile))
    k -= k % 2
    return max(1, min(k, tile))


def _tiles(flat: torch.Tensor, rows: int, cols: int, h: int, w: int) -> torch.Tensor:
    """(rows * cols,) -> (tiles, h * w): row-major tiles, each row-major inside."""
    return flat.view(rows // h, h, cols // w, w).permute(0, 2, 1, 3).reshape(-1, h * w)


def _flat_positions(idx: torch.Tensor, rows: int, cols: int, h: int, w: int) -> torch.Tensor:
    """In-tile positions (tiles, k) -> flat positions in the (rows, cols) view."""
    n_tiles = idx.shape[0]
    t = torch.arange(n_tiles).unsqueeze(1)
    ty, tx = t // (cols // w), t % (cols // w)
    r, c = idx // w, idx % w
    return (ty * h + r) * cols + tx * w + c


def pack12(idx: np.ndarray) -> bytes:
    """Indices < 4096, two to three bytes (an odd count is padded with a 0)."""
    v = idx.astype(np.uint16)
    if v.size % 2:
        v = np.append(v, np.uint16(0))
    a, b = v[0::2], v[1::2]
    out = np.empty(3 * a.size, dtype=np.uint8)
    out[0::3] = a & 0xFF
    out[1::3] = (a >> 8) | ((b & 0x0F) << 4)
    out[2::3] = b >> 4
    return out.tobytes()


def unpack12(data: np.ndarray, count: int) -> np.ndarray:
    """``count`` indices from :func:`pack12`'s bytes."""
    d = data.astype(np.uint16)
    a = d[0::3] | ((d[1::3] & 0x0F) << 8)
    b = (d[1::3] >> 4) | (d[2::3] << 4)
    return np.stack([a, b], axis=1).reshape(-1)[:count]


def _packed12_bytes(count: int) -> int:
    return 3 * (-(-count // 2))


def _value_bytes(count: int, bins: int) -> int:
    per = 8 // int(math.log2(bins))
    return -(-count // per)


def quantize(
    vals: torch.Tensor, bins: int, range_sigmas: float = RANGE_SIGMAS
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """(bin of each value, the shift, the table of bin means) by Templar's rule; see the module docstring."""
    v = vals.double()
    shift = v.mean() if v.numel() else torch.zeros((), dtype=torch.float64)
    centered = v - shift
    std = centered.norm() / math.sqrt(centered.numel() - 1) if centered.numel() > 1 else torch.zeros(())
    scale = float(range_sigmas * std / bins)
    if scale == 0 or not math.isfinite(scale):
        scale = 1.0
    q = (centered / scale + bins // 2).round().clamp(0, bins - 1).long()
    sums = torch.zeros(bins, dtype=torch.float64).scatter_add_(0, q, centered)
    counts = torch.zeros(bins, dtype=torch.float64).scatter_add_(0, q, torch.ones_like(centered))
    table = torch.where(counts > 0, sums / counts.clamp_min(1), torch.zeros_like(sums))
    return q, float(np.float32(float(shift))), table.float()


def _pack_values(q: torch.Tensor, bins: int) -> bytes:
    bits = int(math.log2(bins))
    per = 8 // bits
    v = q.to(torch.uint8).numpy()
    pad = (-v.size) % per
    v = np.concatenate([v, np.zeros(pad, dtype=np.uint8)]).reshape(-1, per)
    out = np.zeros(v.shape[0], dtype=np.uint8)
    for j in range(per):
        out |= v[:, j] << (j * bits)
    return out.tobytes()


def _unpack_values(data: np.ndarray, count: int, bins: int) -> np.ndarray:
    bits = int(math.log2(bins))
    per = 8 // bits
    mask = (1 << bits) - 1
    return np.stack([(data >> (j * bits)) & mask for j in range(per)], axis=1).reshape(-1)[:count]


class TopKTilesCodec(SparsePartsCodec):
    """Top-k per 64 x 64 tile with sigma-bin values and error feedback (stateful sender).

    Args:
        density: fraction of each tile to send (k per tile: :func:`per_tile`).
        beta: error-feedback decay (e = beta * e + x).
        bins: value bins, one of ``BINS`` (4: 2-bit values).
        error_feedback: keep the residual; False makes the codec stateless.
        max_numel: largest dense size ``decode`` accepts (bounds allocation).
    """

    name: ClassVar[str] = "topktiles"
    magic: ClassVar[bytes] = b"LCTT"

    def __init__(
        self,
        density: float = 0.02,
        beta: float = 0.95,
        bins: int = 4,
        error_feedback: bool = True,
        max_numel: int = MAX_SPARSE_NUMEL,
    ) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if not 0 <= beta <= 1:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if bins not in BINS:
            raise ValueError(f"bins must be one of {BINS}, got {bins}")
        self.density = float(density)
        self.beta = float(beta)
        self.bins = int(bins)
        self.error_feedback = error_feedback
        self.max_numel = int(max_numel)
        self.error: torch.Tensor | None = None
        """The fp32 error-feedback buffer e (flat), created on the first encode."""

    def __repr__(self) -> str:
        return f"TopKTilesCodec(density={self.density}, beta={self.beta}, bins={self.bins})"

    def reset(self) -> None:
        self.error = None

    def encode_parts(self, x: torch.Tensor, **context: Any) -> tuple[bytes, list[torch.Tensor]]:
        if not x.is_floating_point():
            raise TypeError(f"topktiles needs a float tensor, got {x.dtype}")
        shape = tuple(x.shape)
        flat = x.detach().to("cpu", torch.float32).reshape(-1)
        n = flat.numel()
        if self.error_feedback:
            if self.error is None:
                self.error = torch.zeros(n, dtype=torch.float32)
            elif self.error.numel() != n:
                raise ValueError(f"tensor has {n} elements, error buffer {self.error.numel()}")
            e = self.error.mul_(self.beta).add_(flat)
        else:
            e = flat.clone()
        rows, cols, h, w = tiling(shape)
        k = per_tile(self.density, h * w)
        tiles = _tiles(e, rows, cols, h, w)
        idx = canonical_topk(tiles.abs(), k)  # (tiles, k), ascending in each tile
        q, shift, table = quantize(tiles.gather(1, idx).reshape(-1), self.bins)
        if self.error_feedback:  # subtract exactly what the receiver rebuilds
            dhat = (table.double()[q] + shift).float()
            e.index_add_(0, _flat_positions(idx, rows, cols, h, w).reshape(-1), -dhat)
        wr = Writer()
        wr.u8(dtype_code(x.dtype))
        wr.shape(shape)
        wr.u32(k)
        wr.u8(self.bins.bit_length() - 1)
        wr.f32(shift)
        for t in table.tolist():
            wr.f32(t)
        wr.raw(pack12(idx.reshape(-1).numpy()))
        wr.raw(_pack_values(q, self.bins))
        return wr.getvalue(), []

    @classmethod
    def max_encoded_bytes(cls, numel: int, ndim: int = MAX_NDIM) -> int:
        """The most bytes a standalone payload of a ``numel``-element tensor of rank ``ndim`` takes (every
        element selected, 8-bit values): a receiver's bound on a sender's declared size from the layout alone."""
        return _packed12_bytes(numel) + numel + 4 * (max(BINS) + 1) + 64 + 8 * ndim

    def _parse(
        self, meta: memoryview, parts: list[torch.Tensor], max_numel: int | None = None
    ) -> tuple[torch.dtype, tuple[int, ...], torch.Tensor, torch.Tensor]:
        r = Reader(meta)
        dtype = code_dtype(r.u8())
        if not dtype.is_floating_point:
            raise CodecError(f"topktiles payload claims non-float dtype {dtype}")
        limit = self.max_numel if max_numel is None else min(self.max_numel, max_numel)
        shape = r.shape(limit)  # refused here, before any index or the dense output exists
        rows, cols, h, w = tiling(shape)
        k = r.u32()
        if not 1 <= k <= h * w:
            raise CodecError(f"bad k {k} for tiles of {h}x{w}")
        bits = r.u8()
        if bits > 8 or (1 << bits) not in BINS:
            raise CodecError(f"bad bin count 2^{bits}")
        bins = 1 << bits
        shift = r.f32()
        table = torch.from_numpy(r.array(bins, np.float32).copy())
        count = (rows // h) * (cols // w) * k
        idx = unpack12(r.array(_packed12_bytes(count), np.uint8), count)
        q = _unpack_values(r.array(_value_bytes(count, bins), np.uint8), count, bins)
        r.expect_end()
        if parts:
            raise CodecError("topktiles payload has unexpected float parts")
        if not (np.isfinite(shift) and bool(torch.isfinite(table).all())):
            raise CodecError("topktiles payload has non-finite levels")
        if count and int(idx.max()) >= h * w:
            raise CodecError("topktiles index outside its tile")
        tile_idx = torch.from_numpy(idx.astype(np.int64)).view(-1, k)
        if bool((tile_idx[:, 1:] <= tile_idx[:, :-1]).any()):  # a position twice would add up
            raise CodecError("topktiles indices not strictly ascending in a tile")
        flat = _flat_positions(tile_idx, rows, cols, h, w).reshape(-1)
        values = table[torch.from_numpy(q.astype(np.int64))] + shift
        return dtype, shape, flat, values
