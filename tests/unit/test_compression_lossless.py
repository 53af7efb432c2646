"""The lossless exponent coder: bit-exactness, special values, size checks, ratio."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from locomm.compression import CodecError, get_codec
from locomm.compression.lossless import _LAYOUTS, MODE_CONST, MODE_EMPIRICAL, MODE_MODEL, LosslessCodec

pytestmark = pytest.mark.timeout(120)

DTYPES = {
    torch.bfloat16: (np.uint16, torch.int16),
    torch.float16: (np.uint16, torch.int16),
    torch.float32: (np.uint32, torch.int32),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor: compares NaN payloads and signed zeros exactly."""
    return t.contiguous().view(DTYPES[t.dtype][1])


def from_bits(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A float tensor with exactly these bit patterns."""
    signed = np.int16 if a.dtype == np.uint16 else np.int32
    return torch.from_numpy(np.ascontiguousarray(a).view(signed).copy()).view(dtype)


def assert_roundtrip(codec: LosslessCodec, x: torch.Tensor) -> bytes:
    data = codec.encode(x)
    y = codec.decode(data)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(bits(y), bits(x))
    return data


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    dtype=st.sampled_from(list(DTYPES)),
    data=st.data(),
    chunk=st.sampled_from([1, 3, 7, 64, 1 << 20]),
    table=st.sampled_from(["auto", "model", "empirical"]),
)
def test_arbitrary_bit_patterns_roundtrip(dtype: torch.dtype, data: st.DataObject, chunk: int, table: str) -> None:
    """Any bit pattern (NaN payloads, infinities, subnormals, -0) survives exactly."""
    word = DTYPES[dtype][0]
    arr = data.draw(hnp.arrays(word, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40)))
    x = from_bits(arr, dtype).reshape(arr.shape)
    assert_roundtrip(LosslessCodec(chunk_elems=chunk, table=table), x)


@SETTINGS
@given(
    dtype=st.sampled_from(list(DTYPES)),
    log_sigma=st.floats(-30, 10),
    mean=st.sampled_from([0.0, 1.0, -3.0]),
    zeros=st.sampled_from([0.0, 0.5]),
    n=st.integers(0, 5000),
    seed=st.integers(0, 2**31 - 1),
)
def test_gaussian_like_roundtrip(
    dtype: torch.dtype, log_sigma: float, mean: float, zeros: float, n: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 2.0**log_sigma + mean
    x[torch.rand(n, generator=g) < zeros] = 0.0
    assert_roundtrip(LosslessCodec(chunk_elems=997), x.to(dtype))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_special_values(dtype: torch.dtype) -> None:
    finfo = torch.finfo(dtype)
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            math.inf,
            -math.inf,
            math.nan,
            finfo.tiny,
            -finfo.tiny,
            finfo.max,
            -finfo.max,
            finfo.tiny / 4,
            -finfo.tiny / 8,
            finfo.smallest_normal,
            1.0,
            -1.0,
        ],
        dtype=torch.float32,
    ).to(dtype)
    # NaNs with different payloads and signs, built from raw bits
    nan_bits = {
        torch.bfloat16: [0x7FC1, 0xFF81, 0x7F81],
        torch.float16: [0x7E01, 0xFC01, 0x7C03],
        torch.float32: [0x7FC00001, 0xFF800001, 0x7F8ABCDE],
    }[dtype]
    word = DTYPES[dtype][0]
    nans = from_bits(np.array(nan_bits, dtype=word), dtype)
    x = torch.cat([specials, nans])
    codec = LosslessCodec()
    for t in (x, x.repeat(1000), x[:1], x[:0], x[4].reshape(()), torch.zeros(0, 3, dtype=dtype)):
        assert_roundtrip(codec, t)


def test_constant_model_and_empirical_modes_are_chosen() -> None:
    codec = LosslessCodec()

    def modes(x: torch.Tensor) -> set[int]:
        layout = _LAYOUTS[x.dtype]
        words = layout.words_of(x.contiguous())
        return {
            codec._choose(layout, words[i : i + codec.chunk_elems])[0] for i in range(0, words.size, codec.chunk_elems)
        }

    g = torch.Generator().manual_seed(0)
    assert modes(torch.zeros(10000, dtype=torch.bfloat16)) == {MODE_CONST}
    assert modes((torch.randn(100000, generator=g) * 0.02).bfloat16()) == {MODE_MODEL}
    relu = torch.relu(torch.randn(100000, generator=g)).bfloat16()  # half exact zeros: far from Gaussian
    assert modes(relu) == {MODE_EMPIRICAL}
    assert_roundtrip(codec, relu)


def test_ratio_near_entropy_bound_bf16() -> None:
    """bf16 N(0, 0.02): within 2% of 16 / (8 + H(exponent)) (docs/algorithms.md §6)."""
    x = (torch.randn(1 << 21, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    data = assert_roundtrip(LosslessCodec(), x)
    e = (x.view(torch.int16).numpy().view(np.uint16) >> 7) & 0xFF
    p = np.bincount(e, minlength=256) / e.size
    p = p[p > 0]
    bound = 16 / (8 - float((p * np.log2(p)).sum()))
    ratio = x.numel() * 2 / len(data)
    assert ratio >= 0.98 * bound, (ratio, bound)


def test_beats_zstd_on_model_tensors() -> None:
    zstd = pytest.importorskip("zstandard")
    from locomm.compression.bench import model_tensors

    tensors = model_tensors(steps=3, outer_steps=3)
    assert {"weights", "gradients", "pseudo_gradients", "activations"} <= {name.split(":")[0] for name, _ in tensors}
    codec = LosslessCodec()
    for name, t in tensors:
        for dtype in (torch.float32, torch.bfloat16):
            x = t.to(dtype)
            ours = len(assert_roundtrip(codec, x))
            z = len(zstd.ZstdCompressor(level=3).compress(bits(x).numpy().tobytes()))
            assert ours < z, (name, dtype, ours, z)


def test_parallel_and_streaming_match_serial() -> None:
    x = (torch.randn(300000) * 3).to(torch.float32)
    serial = LosslessCodec(chunk_elems=4096).encode(x)
    parallel = LosslessCodec(chunk_elems=4096, threads=2)
    assert parallel.encode(x) == serial
    assert b"".join(parallel.iter_encode(x)) == serial
    assert torch.equal(bits(parallel.decode(serial)), bits(x))


def _reseal(data: bytes) -> bytes:
    return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4]))


def test_huge_shape_claim_raises_without_allocating() -> None:
    data = bytearray(LosslessCodec().encode(torch.ones(4, dtype=torch.bfloat16)))
    # header: magic(4) version(1) dtype(1) ndim(1) shape(u64 * ndim)
    assert data[6] == 1
    data[7:15] = struct.pack("<Q", 10**12)
    with pytest.raises(CodecError, match="needs at least|claims"):
        LosslessCodec().decode(_reseal(bytes(data)))
    data[7:15] = struct.pack("<Q", 2**63)
    with pytest.raises(CodecError):
        LosslessCodec().decode(_reseal(bytes(data)))


def test_corruption_is_detected() -> None:
    data = LosslessCodec().encode(torch.randn(1000))
    with pytest.raises(CodecError, match="checksum"):
        LosslessCodec().decode(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(CodecError):
        LosslessCodec().decode(data[:-1])
    with pytest.raises(CodecError):
        LosslessCodec().decode(b"")


def test_registry_and_type_errors() -> None:
    assert isinstance(get_codec("lossless"), LosslessCodec)
    with pytest.raises(TypeError):
        LosslessCodec().encode(torch.arange(3))
    with pytest.raises(CodecError):
        LosslessCodec().decode("not bytes")  # type: ignore[arg-type]
