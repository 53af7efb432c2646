"""CRC-32 (zlib's) of a device buffer, in parallel: the payload checksum without a trip to the host.

zlib's CRC-32 is linear over GF(2): with R0(B) the register after feeding
bytes B to a zero register and Z_k the operator "feed k zero bytes",

    R0(A || B) = Z_|B|(R0(A)) ^ R0(B)
    crc32(D)   = Z_|D|(0xFFFFFFFF) ^ R0(D) ^ 0xFFFFFFFF

so each program lane feeds one block of ``block`` bytes (the data is
virtually left-padded with zeros, which leave a zero register unchanged),
and the block registers are folded pairwise, one kernel per level, applying
the 32 x 32 bit matrix Z_{block * 2^level} to the left one. The matrices are
built on the host (a few dozen 32 x 32 compositions). The result equals
``zlib.crc32`` for any length and block size; the host's zlib runs at about
2 GB/s a core, which would otherwise bound the GPU codec.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from locomm.kernels import interpreting

POLY = 0xEDB88320
FOLD_BLOCK = 32


@functools.lru_cache(maxsize=1)
def _table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint64)
    for _ in range(8):
        t = np.where(t & 1, (t >> np.uint64(1)) ^ np.uint64(POLY), t >> np.uint64(1))
    return t.astype(np.int64)


def _apply(m: np.ndarray, v: int) -> int:
    """The 32 x 32 GF(2) matrix ``m`` (column j = image of bit j) applied to ``v``."""
    out = 0
    j = 0
    while v:
        if v & 1:
            out ^= int(m[j])
        v >>= 1
        j += 1
    return out


def _compose(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.array([_apply(a, int(c)) for c in b], dtype=np.int64)


@functools.lru_cache(maxsize=256)
def _zeros_op_pow2(log2_bytes: int) -> np.ndarray:
    """Z_{2^log2_bytes}: feeding that many zero bytes, as a matrix."""
    if log2_bytes == 0:
        t = _table()
        return np.array([int(t[(1 << j) & 0xFF]) ^ ((1 << j) >> 8) for j in range(32)], dtype=np.int64)
    z = _zeros_op_pow2(log2_bytes - 1)
    return _compose(z, z)


def zeros_apply(n_bytes: int, v: int) -> int:
    """Z_n(v): the register ``v`` after ``n_bytes`` zero bytes (binary powers, applied in turn)."""
    k = 0
    while n_bytes:
        if n_bytes & 1:
            v = _apply(_zeros_op_pow2(k), v)
        n_bytes >>= 1
        k += 1
    return v


@functools.lru_cache(maxsize=64)
def zeros_op(n_bytes: int) -> np.ndarray:
    """Z_n for any n (binary powers composed)."""
    m = np.array([1 << j for j in range(32)], dtype=np.int64)
    k = 0
    while n_bytes:
        if n_bytes & 1:
            m = _compose(_zeros_op_pow2(k), m)
        n_bytes >>= 1
        k += 1
    return m


@triton.jit
def _block_kernel(data_ptr, table_ptr, reg_ptr, n, pad, n_blocks, BLOCK_BYTES: tl.constexpr, LANES: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * LANES + tl.arange(0, LANES)
    bm = b < n_blocks
    start = b * BLOCK_BYTES - pad
    reg = tl.zeros([LANES], dtype=tl.int64)
    for t in range(0, BLOCK_BYTES):
        i = start + t
        byte = tl.load(data_ptr + i, mask=bm & (i >= 0) & (i < n), other=0).to(tl.int64)
        reg = tl.load(table_ptr + ((reg ^ byte) & 0xFF)) ^ (reg >> 8)
    tl.store(reg_ptr + b, reg, mask=bm)


@triton.jit
def _fold_kernel(reg_ptr, mat_ptr, out_ptr, n_pairs, BLOCK: tl.constexpr):
    """out[j] = Z(reg[2j]) ^ reg[2j+1], Z the matrix ``mat`` (column i = image of bit i)."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = j < n_pairs
    left = tl.load(reg_ptr + 2 * j, mask=m, other=0)
    right = tl.load(reg_ptr + 2 * j + 1, mask=m, other=0)
    bits = tl.arange(0, 32)
    cols = tl.load(mat_ptr + bits)  # (32,)
    lb = (left[:, None] >> bits[None, :]) & 1  # (B, 32 i): bit i of the left register
    mb = (cols[:, None] >> bits[None, :]) & 1  # (32 i, 32 k): bit k of column i
    parity = tl.sum(lb[:, :, None] * mb[None, :, :], axis=1) & 1  # (B, 32 k): GF(2) product
    tl.store(out_ptr + j, tl.sum(parity << bits[None, :], axis=1) ^ right, mask=m)


def crc32(data: torch.Tensor, block_bytes: int | None = None) -> int:
    """``zlib.crc32`` of a flat uint8 tensor (any device the kernels run on).

    ``block_bytes`` (default 1024; 64 in the interpreter, where each step of
    a lane's loop is a numpy call) sets the work per lane; the result does
    not depend on it.
    """
    if block_bytes is None:
        block_bytes = 64 if interpreting() else 1024
    n = data.numel()
    if n == 0:
        return 0
    dev = data.device
    n_blocks = -(-n // block_bytes)
    pad = n_blocks * block_bytes - n
    table = torch.as_tensor(_table()).to(dev)
    reg = torch.empty(n_blocks, dtype=torch.int64, device=dev)
    lanes = 128
    _block_kernel[(triton.cdiv(n_blocks, lanes),)](
        data, table, reg, n, pad, n_blocks, BLOCK_BYTES=block_bytes, LANES=lanes
    )
    span = block_bytes  # bytes each register covers at this level
    while reg.numel() > 1:
        if reg.numel() % 2:  # a zero register in front: more leading zero bytes, which change nothing
            reg = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), reg])
        pairs = reg.numel() // 2
        mat = torch.as_tensor(zeros_op(span)).to(dev)
        out = torch.empty(pairs, dtype=torch.int64, device=dev)
        _fold_kernel[(triton.cdiv(pairs, FOLD_BLOCK),)](reg, mat, out, pairs, BLOCK=FOLD_BLOCK)
        reg = out
        span *= 2
    r0 = int(reg[0]) & 0xFFFFFFFF
    return (zeros_apply(n, 0xFFFFFFFF) ^ r0 ^ 0xFFFFFFFF) & 0xFFFFFFFF


__all__ = ["crc32", "zeros_apply", "zeros_op"]
