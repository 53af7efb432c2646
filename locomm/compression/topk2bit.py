"""``topk2bit``: SparseLoCo's chunked top-k with 2-bit values and error feedback (§4).

Per call (one outer round), with ``e`` the fp32 error-feedback buffer kept in
the codec object::

    e    = beta * e + x                 # x: this round's pseudo-gradient
    Dhat = Q2(TopK_per_chunk(e))        # k largest |e| in each chunk of 64
    e    = e - Dhat                     # what was not sent is kept for later

Choices (documented deviations from the paper's 64x64 tiles):

- Chunks are flattened runs of 64 elements (row-major; the last chunk is
  zero-padded). A 6-bit in-chunk index plus the 2-bit value fill exactly one
  byte per selected element, so packing is a plain byte array.
- Q2 is sign + one magnitude bit choosing between two levels ``lo``/``hi``,
  fitted per tensor by two Lloyd (1-D k-means) iterations on the selected
  magnitudes and sent as two float32s. Per-chunk scales would cost more than
  the values at k = 1..2 per 64.
- Wire size: 8 bits per selected element + a small header, so k = 1
  (1.56% density) is ~256x smaller than fp32 and k = 2 ~128x.

- Selection is canonical, so every implementation writes the same bytes: the
  k largest |e| of a chunk, ties to the lower index (NaN above infinity), sent
  in ascending index order; the levels are computed in float64 and rounded to
  float32 once. The Triton kernels (locomm/kernels/topk2bit.py) take this path
  for CUDA tensors (or ``impl="triton"``); decoding is order-insensitive, so
  payloads of earlier builds decode the same.

The float payload is just the two levels, so ``topk2bit+lossless`` gains
nothing over ``topk2bit``: the index/value bytes are close to uniform.
:meth:`TopK2BitCodec.decode_sparse` returns (indices, values) for outer rules
that average "over the workers that sent each index".
"""

from __future__ import annotations

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
    numel_of,
)

CHUNK = 64
"""Elements per top-k chunk (fixed: the index is 6 bits)."""
_FRAME_BYTES = 5 + 8 + 1 + 1 + 1 + 8 + 1 + 4
"""A standalone payload's bytes besides the packed indices and the shape's dims: magic and version, the
meta blob's length, dtype, ndim, k, the two levels, the part count, the CRC."""


class TopK2BitCodec(SparsePartsCodec):
    """Chunked top-k + 2-bit quantization with error feedback (stateful sender).

    Args:
        k: selected elements per chunk of 64 (1..64); mutually exclusive with ``density``.
        density: fraction to keep; ``k = max(1, round(density * 64))``.
        beta: error-feedback decay (e = beta * e + x).
        error_feedback: keep the residual; False makes the codec stateless.
        max_numel: largest dense size ``decode`` accepts (bounds allocation).
        impl: ``"auto"`` (Triton for CUDA tensors), ``"cpu"`` or ``"triton"``;
            the error buffer lives on the encoded tensor's device.
    """

    name: ClassVar[str] = "topk2bit"
    magic: ClassVar[bytes] = b"LCTK"

    def __init__(
        self,
        k: int | None = None,
        density: float | None = None,
        beta: float = 0.95,
        error_feedback: bool = True,
        max_numel: int = MAX_SPARSE_NUMEL,
        impl: str = "auto",
    ) -> None:
        from locomm.kernels import check_impl

        self.impl = check_impl(impl)
        if k is not None and density is not None:
            raise ValueError("give k or density, not both")
        if density is not None:
            if not 0 < density <= 1:
                raise ValueError(f"density must be in (0, 1], got {density}")
            k = max(1, round(density * CHUNK))
        k = 1 if k is None else k
        if not 1 <= k <= CHUNK:
            raise ValueError(f"k must be in [1, {CHUNK}], got {k}")
        if not 0 <= beta <= 1:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        self.k = int(k)
        self.beta = float(beta)
        self.error_feedback = error_feedback
        self.max_numel = int(max_numel)
        self.error: torch.Tensor | None = None
        """The fp32 error-feedback buffer e (flat), created on the first encode."""

    def __repr__(self) -> str:
        return f"TopK2BitCodec(k={self.k}, beta={self.beta}, error_feedback={self.error_feedback})"

    def reset(self) -> None:
        """Forget the error-feedback state."""
        self.error = None

    def encode_parts(self, x: torch.Tensor, **context: Any) -> tuple[bytes, list[torch.Tensor]]:
        if not x.is_floating_point():
            raise TypeError(f"topk2bit needs a float tensor, got {x.dtype}")
        from locomm.kernels import resolve_impl

        n = x.numel()
        k = min(self.k, CHUNK)
        if self.error_feedback and self.error is not None and self.error.numel() != n:
            raise ValueError(f"tensor has {n} elements, error buffer {self.error.numel()}")
        fast = resolve_impl(self.impl, x.device) == "triton"
        if self.error is not None:  # the buffer follows the implementation that uses it
            self.error = self.error.to(x.device if fast else "cpu")
        if fast:
            from locomm.kernels import topk2bit as kt

            if self.error_feedback and self.error is None:
                self.error = torch.zeros(n, dtype=torch.float32, device=x.device)
            error = self.error if self.error_feedback else None
            idx, sel = kt.select(x, error, self.beta, k)
            lo, hi = _two_levels(sel.abs())
            packed_t = kt.pack(idx, sel, error, n, k, lo, hi)
            packed_bytes = packed_t.cpu().numpy().tobytes()  # the compressed bytes: 1 per selected element
        else:
            packed_bytes, lo, hi = self._encode_cpu(x, k)
        w = Writer()
        w.u8(dtype_code(x.dtype))
        w.shape(x.shape)
        w.u8(k)
        w.f32(lo)
        w.f32(hi)
        w.raw(packed_bytes)
        return w.getvalue(), []

    def _encode_cpu(self, x: torch.Tensor, k: int) -> tuple[bytes, float, float]:
        flat = x.detach().to("cpu", torch.float32).reshape(-1)
        n = flat.numel()
        if self.error_feedback:
            if self.error is None:
                self.error = torch.zeros(n, dtype=torch.float32)
            e = self.error.mul_(self.beta).add_(flat)
        else:
            e = flat.clone()
        n_chunks = -(-n // CHUNK)
        padded = torch.zeros(n_chunks * CHUNK, dtype=torch.float32)
        padded[:n] = e
        tiles = padded.view(n_chunks, CHUNK)  # (C, 64)
        idx = canonical_topk(tiles.abs(), k)  # (C, k)
        sel = tiles.gather(1, idx)
        vals = sel.abs()
        lo, hi = _two_levels(vals.reshape(-1))
        thr = torch.tensor((lo + hi) / 2, dtype=torch.float32)
        mag_hi = vals >= thr if hi > lo else torch.zeros_like(vals, dtype=torch.bool)
        neg = sel < 0
        packed = (idx.to(torch.uint8) << 2) | (neg.to(torch.uint8) << 1) | mag_hi.to(torch.uint8)
        # Subtract exactly what the receiver will rebuild.
        dhat = _levels(packed, lo, hi)
        if self.error_feedback:
            tiles.scatter_add_(1, idx, -dhat)
            e.copy_(padded[:n])
        return packed.numpy().tobytes(), lo, hi

    @classmethod
    def max_encoded_bytes(cls, numel: int, ndim: int = MAX_NDIM, k: int = CHUNK) -> int:
        """The most bytes a standalone payload of a ``numel``-element tensor of rank ``ndim`` takes at ``k``
        per chunk (default every element): a receiver's bound on a sender's declared size, from the layout
        alone (a stateless receiver does not know the run's density)."""
        return -(-numel // CHUNK) * k + _FRAME_BYTES + 8 * ndim

    def _parse(
        self, meta: memoryview, parts: list[torch.Tensor], max_numel: int | None = None
    ) -> tuple[torch.dtype, tuple[int, ...], torch.Tensor, torch.Tensor]:
        r = Reader(meta)
        dtype = code_dtype(r.u8())
        if not dtype.is_floating_point:
            raise CodecError(f"topk2bit payload claims non-float dtype {dtype}")
        limit = self.max_numel if max_numel is None else min(self.max_numel, max_numel)
        shape = r.shape(limit)  # refused here, before the (C, k) indices and the dense output exist
        k = r.u8()
        if not 1 <= k <= CHUNK:
            raise CodecError(f"bad k {k}")
        lo, hi = r.f32(), r.f32()
        n = numel_of(shape)
        n_chunks = -(-n // CHUNK)
        packed = torch.from_numpy(r.array(n_chunks * k, np.uint8).copy()).view(n_chunks, k)
        r.expect_end()
        if parts:
            raise CodecError("topk2bit payload has unexpected float parts")
        idx = (packed >> 2).long() + torch.arange(n_chunks).unsqueeze(1) * CHUNK  # (C, k) flat positions
        values = _levels(packed, lo, hi)
        keep = idx.reshape(-1) < n  # entries in the zero padding of the last chunk
        return dtype, shape, idx.reshape(-1)[keep], values.reshape(-1)[keep]


def canonical_topk(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (C, k), ascending, of the k largest of each row of ``a`` (>= 0 or NaN): ties to the
    lower index, every NaN above infinity. Rows without a tie at the k-th place take torch's
    float top-k; the others rank |e| by its float bits made unique by the index."""
    n_rows, width = a.shape
    if k >= width:
        return torch.arange(width).expand(n_rows, width).clone()
    vals, idx = a.topk(k + 1, dim=1)  # sorted, descending
    idx = idx[:, :k].clone()
    tie = (vals[:, k - 1] == vals[:, k]) | vals[:, k - 1].isnan() | vals[:, k].isnan()
    if bool(tie.any()):
        rows = tie.nonzero().squeeze(1)
        sub = a[rows]
        key = sub.view(torch.int32).where(~sub.isnan(), 0x7FC00000).long() * width + (width - 1 - torch.arange(width))
        idx[rows] = key.topk(k, dim=1).indices
    return idx.sort(dim=1).values


def _two_levels(mags: torch.Tensor) -> tuple[float, float]:
    """Two magnitude levels by Lloyd's algorithm (2 iterations), as float32 values.

    Sums run in float64 on the tensor's device and are rounded to float32 once,
    so the CPU and GPU paths agree on the levels (float64 rounding error stays
    far below a float32 ulp).
    """
    if mags.numel() == 0:
        return 0.0, 0.0
    m = mags.double()
    t = m.mean()
    lo = hi = t
    for _ in range(2):
        below = m < t
        n_lo = below.sum()
        n_hi = m.numel() - n_lo
        lo = torch.where(n_lo > 0, torch.where(below, m, 0.0).sum() / n_lo.clamp_min(1), t)
        hi = torch.where(n_hi > 0, torch.where(below, 0.0, m).sum() / n_hi.clamp_min(1), t)
        t = (lo + hi) / 2
    f = np.float32
    return float(f(lo.item())), float(f(hi.item()))


def _levels(packed: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """fp32 values of packed bytes: bit 1 = negative, bit 0 = high level."""
    mag = torch.where((packed & 1).bool(), torch.tensor(hi, dtype=torch.float32), torch.tensor(lo, dtype=torch.float32))
    return torch.where((packed & 2).bool(), -mag, mag)
