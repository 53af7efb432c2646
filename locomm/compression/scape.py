"""``scape``: SCAPE's first-moment masks with a sparse exchange format (docs/algorithms.md §5).

Usage per training step ``t``::

    payload = codec.encode(g_t)        # sends g_t * M, M = the mask set last step
    ... optimizer step computes the AdamS first moment m_t ...
    codec.update_mask(m_t)             # mask for step t + 1 ("one step late")

``update_mask`` keeps the top ``(1 - sparsity)`` fraction of ``|m|`` (the
paper does this per shard and all-gathers the masks; with one codec per shard
that is the same). Until the first ``update_mask`` the codec sends everything.

Off-mask coordinates are NOT dropped: with ``error_feedback=True`` (default)
they stay in a local fp32 residual ``r`` that is added to the next gradient
(``u = g + r; send u*M; r = u*(1-M)``). The paper's abstract does not say what
happens off-mask; this is the obvious choice and is configurable.

Wire: dtype, shape, nnz, the index set as a bitmap or as LEB128-coded gaps
(whichever is smaller: gaps win below ~1/8 density), then the values as one
float part (``value_dtype``, default the input dtype), which a stack can pass
to ``lossless``. The index set is sent every step even though peers could
derive it from all-gathered masks, so a payload decodes on its own.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np
import torch

from locomm.compression.base import (
    MAX_SPARSE_NUMEL,
    CodecError,
    PartsCodec,
    Reader,
    Writer,
    check_part,
    code_dtype,
    dtype_code,
    numel_of,
)

IDX_ALL, IDX_BITMAP, IDX_GAPS = 0, 1, 2
_MAX_VARINT_BYTES = 6  # gaps < 2**42 > MAX_NUMEL


class ScapeCodec(PartsCodec):
    """Sparse exchange of ``g * mask`` with masks from the AdamS first moment.

    Args:
        sparsity: fraction of coordinates NOT sent (0.9 or 0.99 in the paper).
        value_dtype: dtype of the sent values; None keeps the input dtype.
        error_feedback: keep off-mask values locally and add them next step.
        max_numel: largest dense size ``decode`` accepts (bounds allocation).
    """

    name: ClassVar[str] = "scape"
    magic: ClassVar[bytes] = b"LCSC"

    def __init__(
        self,
        sparsity: float = 0.9,
        value_dtype: torch.dtype | None = None,
        error_feedback: bool = True,
        max_numel: int = MAX_SPARSE_NUMEL,
    ) -> None:
        if not 0 <= sparsity < 1:
            raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
        if value_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"value_dtype must be float32, float16 or bfloat16, got {value_dtype}")
        self.sparsity = float(sparsity)
        self.value_dtype = value_dtype
        self.error_feedback = error_feedback
        self.max_numel = int(max_numel)
        self.mask_indices: torch.Tensor | None = None
        """Sorted flat indices (int64) of the mask used by the next ``encode``."""
        self.residual: torch.Tensor | None = None
        """fp32 off-mask residual (flat), when error feedback is on."""

    def __repr__(self) -> str:
        return f"ScapeCodec(sparsity={self.sparsity}, value_dtype={self.value_dtype})"

    def update_mask(self, first_moment: torch.Tensor) -> torch.Tensor:
        """Set the mask for the NEXT ``encode``: top (1 - sparsity) of |first_moment|.

        Returns:
            The sorted flat indices of the new mask.
        """
        m = first_moment.detach().to("cpu", torch.float32).reshape(-1).abs()
        keep = max(1, math.ceil((1.0 - self.sparsity) * m.numel())) if m.numel() else 0
        idx = m.topk(keep, sorted=False).indices if keep else torch.zeros(0, dtype=torch.long)
        self.mask_indices = idx.sort().values
        return self.mask_indices

    def encode_parts(self, x: torch.Tensor, **context: Any) -> tuple[bytes, list[torch.Tensor]]:
        if not x.is_floating_point():
            raise TypeError(f"scape needs a float tensor, got {x.dtype}")
        flat = x.detach().to("cpu").reshape(-1)
        n = flat.numel()
        vdtype = self.value_dtype or x.dtype
        if self.error_feedback:
            if self.residual is None or self.residual.numel() != n:
                self.residual = torch.zeros(n, dtype=torch.float32)
            u = self.residual.add_(flat.float())  # u = g + r, in place
        else:
            u = flat
        w = Writer()
        w.u8(dtype_code(x.dtype))
        w.shape(x.shape)
        idx = self.mask_indices
        if idx is not None and idx.numel() and int(idx[-1]) >= n:
            raise ValueError(f"mask covers {int(idx[-1]) + 1}+ elements, tensor has {n}")
        if idx is None:
            values = u.to(vdtype).clone()
            w.u8(IDX_ALL)
            w.u64(n)
            if self.error_feedback:
                u.sub_(values.float())  # leaves only the rounding error of value_dtype
        else:
            values = u[idx].to(vdtype)
            w.u8(IDX_BITMAP if _bitmap_bytes(n) <= _gap_bytes(idx.numpy()) else IDX_GAPS)
            w.u64(idx.numel())
            w.raw(
                _encode_bitmap(idx.numpy(), n)
                if _bitmap_bytes(n) <= _gap_bytes(idx.numpy())
                else _encode_gaps(idx.numpy())
            )
            if self.error_feedback:
                # sent; u keeps the off-mask residual (and the on-mask rounding error)
                u[idx] = u[idx] - values.float()
        return w.getvalue(), [values.contiguous()]

    def _parse(
        self, meta: memoryview, max_numel: int | None = None
    ) -> tuple[torch.dtype, tuple[int, ...], torch.Tensor | None, int]:
        r = Reader(meta)
        dtype = code_dtype(r.u8())
        if not dtype.is_floating_point:
            raise CodecError(f"scape payload claims non-float dtype {dtype}")
        shape = r.shape(self.max_numel if max_numel is None else min(self.max_numel, max_numel))
        n = numel_of(shape)
        fmt = r.u8()
        nnz = r.u64()
        if nnz > n:
            raise CodecError(f"{nnz} values for {n} elements")
        if fmt == IDX_ALL:
            if nnz != n:
                raise CodecError("dense scape payload with nnz != numel")
            idx = None
        elif fmt == IDX_BITMAP:
            bits = r.array(_bitmap_bytes(n), np.uint8)
            idx_np = np.flatnonzero(np.unpackbits(bits, count=n))
            if idx_np.size != nnz:
                raise CodecError(f"bitmap has {idx_np.size} set bits, header says {nnz}")
            idx = torch.from_numpy(idx_np.astype(np.int64))
        elif fmt == IDX_GAPS:
            idx = torch.from_numpy(_decode_gaps(r.array(r.remaining, np.uint8), nnz, n))
        else:
            raise CodecError(f"unknown index format {fmt}")
        r.expect_end()
        return dtype, shape, idx, nnz

    def decode_parts(
        self, meta: memoryview, parts: list[torch.Tensor], max_numel: int | None = None, **context: Any
    ) -> torch.Tensor:
        dtype, shape, idx, nnz = self._parse(meta, max_numel)
        if len(parts) != 1:
            raise CodecError("scape payload must hold exactly one float part")
        values = check_part(parts, 0, (nnz,), (torch.float32, torch.float16, torch.bfloat16))
        if idx is None:
            return values.to(dtype).reshape(shape)
        out = torch.zeros(numel_of(shape), dtype=dtype)
        out[idx] = values.to(dtype)
        return out.reshape(shape)


def _bitmap_bytes(n: int) -> int:
    return (n + 7) // 8


def _encode_bitmap(idx: np.ndarray, n: int) -> bytes:
    bits = np.zeros(n, dtype=np.uint8)
    bits[idx] = 1
    return np.packbits(bits).tobytes()


def _gaps(idx: np.ndarray) -> np.ndarray:
    """Gap before each index: idx[0], then idx[i] - idx[i-1] - 1 (all >= 0)."""
    g = np.empty(idx.size, dtype=np.int64)
    if idx.size:
        g[0] = idx[0]
        g[1:] = np.diff(idx) - 1
    return g


def _varint_sizes(g: np.ndarray) -> np.ndarray:
    sizes = np.ones(g.size, dtype=np.int64)
    for t in range(1, _MAX_VARINT_BYTES):
        sizes += g >= (1 << (7 * t))
    return sizes


def _gap_bytes(idx: np.ndarray) -> int:
    return int(_varint_sizes(_gaps(idx)).sum())


def _encode_gaps(idx: np.ndarray) -> bytes:
    """LEB128 varints of the gaps, vectorized (7 bits per byte, high bit = more)."""
    g = _gaps(idx)
    sizes = _varint_sizes(g)
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    starts = np.cumsum(sizes) - sizes
    for t in range(int(sizes.max(initial=0))):
        sel = sizes > t
        more = (sizes[sel] - 1 > t).astype(np.uint8) << 7
        out[starts[sel] + t] = ((g[sel] >> (7 * t)) & 0x7F).astype(np.uint8) | more
    return out.tobytes()


def _decode_gaps(b: np.ndarray, nnz: int, n: int) -> np.ndarray:
    """Indices from LEB128 gaps; every malformed input raises CodecError."""
    ends = np.flatnonzero(b < 0x80)
    if ends.size != nnz or (nnz and ends[-1] != b.size - 1) or (nnz == 0 and b.size):
        raise CodecError("malformed gap list")
    if nnz == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.empty(nnz, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    sizes = ends - starts + 1
    if sizes.max() > _MAX_VARINT_BYTES:
        raise CodecError("gap varint too long")
    g = np.zeros(nnz, dtype=np.int64)
    for t in range(int(sizes.max())):
        sel = sizes > t
        g[sel] |= (b[starts[sel] + t].astype(np.int64) & 0x7F) << (7 * t)
    # The indices must stay below n; check in float first so the exact cumsum cannot overflow.
    if float(g.astype(np.float64).sum()) + nnz > n + 1.0:
        raise CodecError("gap list runs past the tensor")
    idx = np.cumsum(g + 1) - 1
    if idx[-1] >= n:
        raise CodecError("gap list runs past the tensor")
    return idx
