"""Fuzz every codec's decode: random, truncated, bit-flipped and header-edited payloads.

The only acceptable outcomes are a tensor or CodecError: no other exception,
no hang (per-test timeout), no crash. Mutations are tried both with the CRC
left stale (caught by the checksum) and re-sealed with a fresh CRC, which
drives the mutated bytes into the parsers and the numba decoder.
"""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from locomm.compression import Codec, CodecError, get_codec
from locomm.compression.scape import ScapeCodec
from locomm.compression.subspace import SubspaceCodec

pytestmark = pytest.mark.timeout(180)


def _payloads() -> list[tuple[str, Codec, bytes]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 300, generator=g) * 0.02
    out: list[tuple[str, Codec, bytes]] = []
    specs = ("lossless", "topk2bit", "topktiles", "blockwise8", "fp16", "bf16", "bf16+lossless", "blockwise8+lossless")
    for spec in specs:
        c = get_codec(spec)
        out.append((spec, c, c.encode(x)))
    lossless = get_codec("lossless", chunk_elems=128)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out.append((f"lossless-{dtype}", lossless, lossless.encode(x.to(dtype))))
    relu = torch.relu(x).bfloat16()  # empirical-table chunks
    out.append(("lossless-relu", lossless, lossless.encode(relu)))
    out.append(("lossless-const", lossless, lossless.encode(torch.zeros(50))))
    for sparsity in (0.5, 0.99):
        sc = ScapeCodec(sparsity=sparsity)
        sc.update_mask(x)
        out.append((f"scape-{sparsity}", sc, sc.encode(x)))
    stack = get_codec("scape+lossless")
    out.append(("scape+lossless", stack, stack.encode(x)))
    sub = SubspaceCodec(d=32, vocab_size=50, k=4)
    tok = torch.randint(0, 50, (6,), generator=g)
    out.append(("subspace", sub, sub.encode(torch.randn(6, 32, generator=g), tokens=tok)))
    return out


PAYLOADS = _payloads()
IDS = [p[0] for p in PAYLOADS]


def _reseal(data: bytes) -> bytes:
    if len(data) < 4:
        return data
    return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4]))


def _decode_ok_or_codec_error(codec: Codec, data: bytes) -> None:
    try:
        y = codec.decode(data)
    except CodecError:
        return
    assert isinstance(y, torch.Tensor)


@pytest.mark.parametrize("i", range(len(PAYLOADS)), ids=IDS)
def test_valid_payloads_decode(i: int) -> None:
    _, codec, data = PAYLOADS[i]
    assert isinstance(codec.decode(data), torch.Tensor)


@pytest.mark.parametrize("i", range(len(PAYLOADS)), ids=IDS)
def test_every_truncation_and_single_bit_flip(i: int) -> None:
    """Deterministic sweep: each prefix, and a flip of each header/trailer bit."""
    _, codec, data = PAYLOADS[i]
    for n in range(0, len(data), max(1, len(data) // 200)):
        with pytest.raises(CodecError):
            codec.decode(data[:n])
        _decode_ok_or_codec_error(codec, _reseal(data[:n]))
    for pos in [*range(min(len(data), 64)), *range(max(0, len(data) - 8), len(data))]:
        for bit in range(8):
            bad = bytearray(data)
            bad[pos] ^= 1 << bit
            with pytest.raises(CodecError):
                codec.decode(bytes(bad))
            _decode_ok_or_codec_error(codec, _reseal(bytes(bad)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    i=st.integers(0, len(PAYLOADS) - 1),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
    extra=st.binary(max_size=16),
    reseal=st.booleans(),
)
def test_mutated_payloads(i: int, edits: list[tuple[int, int]], cut: int | None, extra: bytes, reseal: bool) -> None:
    _, codec, data = PAYLOADS[i]
    bad = bytearray(data)
    for pos, val in edits:
        bad[pos % len(bad)] = val
    if cut is not None:
        bad = bad[: cut % (len(bad) + 1)]
    bad += extra
    out = _reseal(bytes(bad)) if reseal else bytes(bad)
    _decode_ok_or_codec_error(codec, out)


@settings(max_examples=200, deadline=None)
@given(
    i=st.integers(0, len(PAYLOADS) - 1),
    junk=st.binary(max_size=300),
    reseal=st.booleans(),
    keep_head=st.integers(0, 24),
)
def test_random_bytes(i: int, junk: bytes, reseal: bool, keep_head: int) -> None:
    """Random bytes, optionally behind a valid magic/header prefix."""
    _, codec, data = PAYLOADS[i]
    out = data[:keep_head] + junk
    _decode_ok_or_codec_error(codec, _reseal(out) if reseal else out)


def test_header_field_edits_lossless() -> None:
    """Targeted edits of every lossless header field, re-sealed: dtype, ndim, shape, chunk size."""
    codec = get_codec("lossless", chunk_elems=100)
    data = codec.encode(torch.randn(2, 150).bfloat16())
    # magic 0-3, version 4, dtype 5, ndim 6, shape 7..22, chunk_elems 23..26, first chunk len 27..30, mode 31
    for pos, values in {5: range(0, 9), 6: (0, 1, 3, 9, 255), 31: range(0, 6)}.items():
        for v in values:
            bad = bytearray(data)
            bad[pos] = v
            _decode_ok_or_codec_error(codec, _reseal(bytes(bad)))
    for pos, fmt in ((7, "<Q"), (15, "<Q"), (23, "<I"), (27, "<I")):
        for v in (0, 1, 99, 100, 101, 2**31, 2**32 - 1) + ((2**40, 2**63, 2**64 - 1) if fmt == "<Q" else ()):
            bad = bytearray(data)
            bad[pos : pos + struct.calcsize(fmt)] = struct.pack(fmt, v)
            _decode_ok_or_codec_error(codec, _reseal(bytes(bad)))
