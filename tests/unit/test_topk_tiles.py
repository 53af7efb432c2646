"""``topktiles``: SparseLoCo's top-k per 64x64 tile with sigma-bin values (Templar's compress.py), checked
against the rules its docstring states, and against payloads that lie."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from locomm.compression.base import CodecError, Reader, Writer, seal, unseal
from locomm.compression.topk_tiles import (
    BINS,
    TopKTilesCodec,
    largest_divisor,
    pack12,
    per_tile,
    quantize,
    tiling,
    unpack12,
)


def test_tiles_cover_the_tensor_with_the_largest_divisors_up_to_64():
    assert tiling((256, 704)) == (256, 704, 64, 64)
    assert tiling((50257, 64)) == (50257, 64, 29, 64)  # 50257 = 29 * 1733
    assert tiling((128,)) == (1, 128, 1, 64) and tiling(()) == (1, 1, 1, 1)
    assert tiling((3, 5, 7)) == (3, 35, 3, 35)
    assert largest_divisor(67) == 1 and largest_divisor(4096) == 64
    assert per_tile(0.02, 4096) == 82 and per_tile(0.0001, 4096) == 2 and per_tile(0.5, 1) == 1
    assert all(per_tile(d, 4096) % 2 == 0 for d in (0.01, 0.02, 0.03, 0.1))


@pytest.mark.parametrize("shape", [(256, 704), (64, 192), (192,), (50, 64), ()])
@pytest.mark.parametrize("beta", [0.0, 0.9])
def test_error_feedback_keeps_exactly_what_was_not_sent(shape, beta):
    g = torch.Generator().manual_seed(1)
    c = TopKTilesCodec(density=0.03, beta=beta)
    e_before = torch.zeros(math.prod(shape))
    for _ in range(3):
        x = torch.randn(shape, generator=g)
        sent = TopKTilesCodec().decode(c.encode(x))
        assert sent.shape == x.shape
        torch.testing.assert_close(c.error + sent.reshape(-1), beta * e_before + x.reshape(-1), atol=1e-5, rtol=0)
        e_before = c.error.clone()


def test_each_tile_sends_its_k_largest():
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(2))
    c = TopKTilesCodec(density=0.02, error_feedback=False)
    idx, vals, shape = c.decode_sparse(c.encode(x))
    k = per_tile(0.02, 64 * 64)
    assert shape == (128, 128) and idx.numel() == 4 * k
    for ty in range(2):
        for tx in range(2):
            tile = x[ty * 64 : (ty + 1) * 64, tx * 64 : (tx + 1) * 64].abs().reshape(-1)
            top = tile.topk(k).indices
            want = set((top // 64 * 128 + top % 64 + ty * 64 * 128 + tx * 64).tolist())
            got = {i for i in idx.tolist() if (i // 128) // 64 == ty and (i % 128) // 64 == tx}
            assert got == want


def test_values_are_bin_means_around_the_mean_as_templar_quantizes():
    v = torch.randn(1000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    q, shift, table = quantize(v.float(), 4)
    c = v - v.mean()
    scale = 6 * c.norm() / math.sqrt(v.numel() - 1) / 4
    want = (c / scale + 2).round().clamp(0, 3).long()
    assert torch.equal(q, want) and shift == pytest.approx(float(v.mean()), abs=1e-6)
    for b in range(4):
        if (want == b).any():
            assert float(table[b]) == pytest.approx(float(c[want == b].mean()), rel=1e-5)


def test_12_bit_packing_round_trips():
    for n in (0, 1, 2, 7, 1000):
        idx = np.random.default_rng(n).integers(0, 4096, size=n)
        packed = np.frombuffer(pack12(idx), dtype=np.uint8)
        assert packed.size == 3 * -(-n // 2) and (unpack12(packed, n) == idx).all()


def test_wire_size_and_bound():
    x = torch.randn(256, 704, generator=torch.Generator().manual_seed(6))
    for bins in BINS:
        data = TopKTilesCodec(density=0.02, bins=bins).encode(x)
        assert len(data) <= TopKTilesCodec.max_encoded_bytes(x.numel(), 2)
    assert x.numel() * 4 / len(TopKTilesCodec(density=0.02).encode(x)) > 100  # 14 bits per selected element


def _rewrite(data: bytes, **change) -> bytes:
    """The payload with one header field changed (k, bits, shift or an index byte), resealed."""
    r = Reader(unseal(TopKTilesCodec.magic, data))
    meta = Reader(r.blob())
    dtype, shape, k, bits = meta.u8(), meta.shape(), meta.u32(), meta.u8()
    shift = meta.f32()
    table = [meta.f32() for _ in range(1 << bits)]
    rest = bytearray(meta.take(meta.remaining))
    if change.get("first_index_max"):  # the first index 4095: the second cannot be above it
        rest[0], rest[1] = 0xFF, rest[1] | 0x0F
    if change.get("second_index_zero"):  # the second index 0: it cannot be above the first
        rest[1], rest[2] = rest[1] & 0x0F, 0
    w = Writer()
    w.u8(dtype)
    w.shape(change.get("shape", shape))
    w.u32(change.get("k", k))
    w.u8(change.get("bits", bits))
    w.f32(change.get("shift", shift))
    for t in table:
        w.f32(t)
    w.raw(bytes(rest))
    out = Writer()
    out.blob(w.getvalue())
    out.u8(0)
    return seal(TopKTilesCodec.magic, out.getvalue())


@pytest.mark.parametrize(
    "change",
    [
        {"k": 0},
        {"k": 4097},
        {"bits": 3},
        {"shift": math.nan},
        {"shape": (64, 64, 64)},  # more elements than the bytes carry
        {"first_index_max": True},  # indices in a tile not strictly ascending (a position twice would add up)
        {"second_index_zero": True},
    ],
    ids=["k0", "k-too-big", "bins-8", "nan-shift", "bigger-shape", "first-index-max", "second-index-zero"],
)
def test_a_lying_payload_is_refused(change):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    data = TopKTilesCodec(density=0.02, error_feedback=False).encode(x)
    assert TopKTilesCodec().decode(_rewrite(data)).shape == (64, 64)  # the rewrite itself is faithful
    with pytest.raises(CodecError):
        TopKTilesCodec().decode(_rewrite(data, **change))


def test_a_claim_past_max_numel_is_refused_before_allocating():
    data = TopKTilesCodec().encode(torch.randn(128, 128, generator=torch.Generator().manual_seed(5)))
    with pytest.raises(CodecError):
        TopKTilesCodec().decode(data, max_numel=128 * 127)
