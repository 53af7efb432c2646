"""Triton kernels of Protocol Models' subspace compression (docs/algorithms.md §7).

Notable:
- :func:`compress`: ``z = U^T (h - E_f[tok])`` in one pass: each program
  loads a block of rows of ``h`` in its own dtype (bf16 under autocast), casts
  in registers, subtracts the gathered rows of ``E_f`` and accumulates
  ``(h - E_f[tok]) @ U`` tile by tile; ``h - E_f[tok]`` is never
  materialized, and ``z`` is written in the dtype asked for (fp32 for the
  codec's payload, bf16 for a pipeline that sends bf16).
- :func:`decompress`: ``h = U z + E_f[tok]`` with the add and the cast to the
  output dtype fused into the matmul's epilogue.
- :func:`project_rows_`: ``X <- X U U^T`` in place for any strided 2-D
  ``X``; the weight projections after an optimizer step use it on
  ``W^T`` (so ``W <- U U^T W``) and on the embedding.
- Matmuls use ``tl.dot`` with ``input_precision="ieee"`` (full fp32, no TF32),
  so results match the CPU codec to float32 rounding (tolerances in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 32
BLOCK_D = 32


@triton.jit
def _compress_kernel(
    h_ptr,
    tok_ptr,
    ef_ptr,
    u_ptr,
    z_ptr,
    n_rows,
    d,
    k,
    stride_h,
    stride_z,
    HAS_EF: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rm = rows < n_rows
    ks = tl.arange(0, BK)
    km = ks < k
    if HAS_EF:
        tok = tl.load(tok_ptr + rows, mask=rm, other=0).to(tl.int64)
    acc = tl.zeros([BM, BK], dtype=tl.float32)
    for d0 in range(0, d, BD):
        ds = d0 + tl.arange(0, BD)
        dm = ds < d
        m2 = rm[:, None] & dm[None, :]
        a = tl.load(h_ptr + rows[:, None] * stride_h + ds[None, :], mask=m2, other=0.0).to(tl.float32)
        if HAS_EF:
            a -= tl.load(ef_ptr + tok[:, None] * d + ds[None, :], mask=m2, other=0.0)
        u = tl.load(u_ptr + ds[:, None] * k + ks[None, :], mask=dm[:, None] & km[None, :], other=0.0)
        acc += tl.dot(a, u, input_precision="ieee")
    tl.store(
        z_ptr + rows[:, None] * stride_z + ks[None, :], acc.to(z_ptr.dtype.element_ty), mask=rm[:, None] & km[None, :]
    )


@triton.jit
def _decompress_kernel(
    z_ptr,
    tok_ptr,
    ef_ptr,
    u_ptr,
    h_ptr,
    n_rows,
    d,
    k,
    stride_z,
    HAS_EF: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    BK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rm = rows < n_rows
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = ds < d
    ks = tl.arange(0, BK)
    km = ks < k
    z = tl.load(z_ptr + rows[:, None] * stride_z + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
    ut = tl.load(u_ptr + ds[None, :] * k + ks[:, None], mask=km[:, None] & dm[None, :], other=0.0)  # (BK, BD) = U^T
    acc = tl.dot(z.to(tl.float32), ut, input_precision="ieee")
    m2 = rm[:, None] & dm[None, :]
    if HAS_EF:
        tok = tl.load(tok_ptr + rows, mask=rm, other=0).to(tl.int64)
        acc += tl.load(ef_ptr + tok[:, None] * d + ds[None, :], mask=m2, other=0.0)
    tl.store(h_ptr + rows[:, None] * d + ds[None, :], acc.to(h_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _project_rows_kernel(
    x_ptr, u_ptr, n_rows, d, k, stride_r, stride_c, BM: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr
):
    """Rows of X (n_rows, d) <- X U U^T, in place: each program owns BM rows."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rm = rows < n_rows
    ks = tl.arange(0, BK)
    km = ks < k
    t = tl.zeros([BM, BK], dtype=tl.float32)
    for d0 in range(0, d, BD):
        ds = d0 + tl.arange(0, BD)
        dm = ds < d
        x = tl.load(
            x_ptr + rows[:, None] * stride_r + ds[None, :] * stride_c, mask=rm[:, None] & dm[None, :], other=0.0
        ).to(tl.float32)
        u = tl.load(u_ptr + ds[:, None] * k + ks[None, :], mask=dm[:, None] & km[None, :], other=0.0)
        t += tl.dot(x, u, input_precision="ieee")
    for d0 in range(0, d, BD):
        ds = d0 + tl.arange(0, BD)
        dm = ds < d
        ut = tl.load(u_ptr + ds[None, :] * k + ks[:, None], mask=km[:, None] & dm[None, :], other=0.0)
        y = tl.dot(t, ut, input_precision="ieee")
        tl.store(
            x_ptr + rows[:, None] * stride_r + ds[None, :] * stride_c,
            y.to(x_ptr.dtype.element_ty),
            mask=rm[:, None] & dm[None, :],
        )


def _bk(k: int) -> int:
    return max(16, triton.next_power_of_2(k))


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    x2 = x.reshape(-1, d)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def compress(
    h: torch.Tensor,
    U: torch.Tensor,
    E_f: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``z = (h - E_f[tok]) @ U`` (..., k) in ``out_dtype``; no E_f term when ``E_f`` is None."""
    d, k = U.shape
    h2 = _rows(h, d)
    n = h2.shape[0]
    z = torch.empty(n, k, dtype=out_dtype, device=h.device)
    if n:
        tok = tokens.reshape(-1).contiguous() if E_f is not None else h2  # type: ignore[union-attr]
        _compress_kernel[(triton.cdiv(n, BLOCK_M),)](
            h2,
            tok,
            E_f if E_f is not None else U,
            U,
            z,
            n,
            d,
            k,
            h2.stride(0),
            z.stride(0),
            HAS_EF=E_f is not None,
            BM=BLOCK_M,
            BD=BLOCK_D,
            BK=_bk(k),
        )
    return z.reshape(*h.shape[:-1], k)


def decompress(
    z: torch.Tensor,
    U: torch.Tensor,
    E_f: torch.Tensor | None = None,
    tokens: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``h = z @ U^T + E_f[tok]`` (..., d) in ``out_dtype``."""
    d, k = U.shape
    z2 = _rows(z, k)
    n = z2.shape[0]
    h = torch.empty(n, d, dtype=out_dtype, device=z.device)
    if n:
        tok = tokens.reshape(-1).contiguous() if E_f is not None else z2  # type: ignore[union-attr]
        _decompress_kernel[(triton.cdiv(n, BLOCK_M), triton.cdiv(d, BLOCK_D))](
            z2,
            tok,
            E_f if E_f is not None else U,
            U,
            h,
            n,
            d,
            k,
            z2.stride(0),
            HAS_EF=E_f is not None,
            BM=BLOCK_M,
            BD=BLOCK_D,
            BK=_bk(k),
        )
    return h.reshape(*z.shape[:-1], d)


def project_rows_(x: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    """``x <- x U U^T`` in place for a 2-D ``x`` (n, d) of any strides; returns ``x``."""
    d, k = U.shape
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"expected (n, {d}), got {tuple(x.shape)}")
    n = x.shape[0]
    if n:
        _project_rows_kernel[(triton.cdiv(n, BLOCK_M),)](
            x, U, n, d, k, x.stride(0), x.stride(1), BM=BLOCK_M, BD=BLOCK_D, BK=_bk(k)
        )
    return x


__all__ = ["compress", "decompress", "project_rows_"]
