"""Triton kernels of SparseLoCo's codec: error feedback, chunked top-k, 2-bit packing (§4).

Notable:
- One program takes ``CHUNKS`` chunks of 64 as a (CHUNKS, 64) tile: it
  updates the error buffer (e = beta e + x) in place, and picks each chunk's
  k largest |e| by rank: element j is chosen when fewer than k elements beat
  it (a larger |e|, or an equal one at a lower index; |e| compared as its
  float bits, NaN above infinity), which is the CPU codec's canonical order.
  A 64 x 64 comparison per chunk costs nothing next to the memory traffic.
- Between the two launches the caller (the codec) fits the two levels over
  the selected magnitudes, with torch's float64 reductions where the tensor
  lies (no copy of the tensor), and hands them to the second kernel.
- The second kernel packs each selected element into one byte and
  subtracts what the receiver will rebuild from the error buffer.
- ``e * beta + x`` is rounded twice, as on the CPU: on a GPU the product is
  written with ``mul.rn`` (never fused into an FMA); the interpreter has no FMA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from locomm.kernels import interpreting

CHUNK = 64
CHUNKS = 4
PACK_BLOCK = 1024


@triton.jit
def _mul_rn(a, b, NO_FMA: tl.constexpr):
    if NO_FMA:
        bb = tl.zeros_like(a) + b  # a tensor operand, as inline asm wants
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, bb], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def _select_kernel(
    x_ptr,
    e_ptr,
    idx_ptr,
    sel_ptr,
    n,
    n_chunks,
    beta,
    K: tl.constexpr,
    EF: tl.constexpr,
    NO_FMA: tl.constexpr,
    CHUNKS_: tl.constexpr,
):
    rows = tl.program_id(0) * CHUNKS_ + tl.arange(0, CHUNKS_)  # (R,)
    cols = tl.arange(0, 64)
    offs = rows.to(tl.int64)[:, None] * 64 + cols[None, :]  # (R, 64)
    m = offs < n
    e = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if EF:
        old = tl.load(e_ptr + offs, mask=m, other=0.0)
        e = _mul_rn(old, beta, NO_FMA) + e
        tl.store(e_ptr + offs, e, mask=m)
    key = tl.abs(e).to(tl.int32, bitcast=True)
    key = tl.where(e != e, 0x7FC00000, key)  # every NaN ties, above infinity
    ki = key[:, :, None]  # (R, 64 i, 1)
    kj = key[:, None, :]  # (R, 1, 64 j)
    ii = cols[None, :, None]
    jj = cols[None, None, :]
    beats = (ki > kj) | ((ki == kj) & (ii < jj))
    rank = tl.sum(beats.to(tl.int32), axis=1)  # (R, 64): elements that beat j
    chosen = rank < K
    slot = tl.cumsum(chosen.to(tl.int32), axis=1) - chosen.to(tl.int32)  # ascending index order
    out = rows.to(tl.int64)[:, None] * K + slot
    keep = chosen & (rows[:, None] < n_chunks)
    tl.store(idx_ptr + out, (cols[None, :] + tl.zeros_like(slot)).to(tl.int32), mask=keep)
    tl.store(sel_ptr + out, e, mask=keep)


@triton.jit
def _pack_kernel(
    idx_ptr,
    sel_ptr,
    e_ptr,
    out_ptr,
    total,
    n,
    lo,
    hi,
    thr,
    USE_HI: tl.constexpr,
    K: tl.constexpr,
    EF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < total
    j = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
    v = tl.load(sel_ptr + offs, mask=m, other=0.0)
    neg = v < 0
    if USE_HI:
        big = tl.abs(v) >= thr
    else:
        big = tl.zeros_like(neg)
    packed = (j << 2) | (neg.to(tl.int64) << 1) | big.to(tl.int64)
    tl.store(out_ptr + offs, packed.to(tl.uint8), mask=m)
    if EF:
        mag = tl.where(big, hi, lo)
        dhat = tl.where(neg, -mag, mag)
        pos = (offs // K) * 64 + j
        pm = m & (pos < n)
        e = tl.load(e_ptr + pos, mask=pm, other=0.0)
        tl.store(e_ptr + pos, e - dhat, mask=pm)


def select(x: torch.Tensor, error: torch.Tensor | None, beta: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx int32 (C * k,), values fp32 (C * k,)): each chunk of 64's k largest |e|, ascending index order.

    With ``error`` (fp32, flat, on x's device) it is updated in place first
    (e = beta e + x) and the selection is made on it; without, on ``x``.
    """
    dev = x.device
    flat = x.detach().reshape(-1).contiguous()
    n = flat.numel()
    n_chunks = -(-n // CHUNK)
    idx = torch.empty(n_chunks * k, dtype=torch.int32, device=dev)
    sel = torch.empty(n_chunks * k, dtype=torch.float32, device=dev)
    if n_chunks == 0:
        return idx, sel
    ef = error is not None
    no_fma = dev.type == "cuda" and not interpreting()
    _select_kernel[(triton.cdiv(n_chunks, CHUNKS),)](
        flat, error if ef else sel, idx, sel, n, n_chunks, float(beta), K=k, EF=ef, NO_FMA=no_fma, CHUNKS_=CHUNKS
    )
    return idx, sel


def pack(
    idx: torch.Tensor, sel: torch.Tensor, error: torch.Tensor | None, n: int, k: int, lo: float, hi: float
) -> torch.Tensor:
    """uint8 (C * k,): index << 2 | sign << 1 | (|v| >= the levels' midpoint), from :func:`select`'s output.

    ``lo``/``hi`` are the two magnitude levels; with ``error`` (``n``
    elements) what the receiver rebuilds is subtracted from it in place.
    """
    total = idx.numel()
    packed = torch.empty(total, dtype=torch.uint8, device=idx.device)
    if total == 0:
        return packed
    ef = error is not None
    thr = float(torch.tensor((lo + hi) / 2, dtype=torch.float32))
    _pack_kernel[(triton.cdiv(total, PACK_BLOCK),)](
        idx, sel, error if ef else sel, packed, total, n, lo, hi, thr, USE_HI=hi > lo, K=k, EF=ef, BLOCK=PACK_BLOCK
    )
    return packed


__all__ = ["pack", "select"]
