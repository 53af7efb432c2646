"""The numba lossless kernels as launchers over arrays: their own errors, bounds checks, no compression imports."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
import torch

from locomm.compression import _huffman as hf
from locomm.compression.base import CodecError
from locomm.compression.lossless import LosslessCodec
from locomm.compression.lossless_format import VERSION_SEGMENTS, full_codes, lane_plan
from locomm.kernels import StreamError
from locomm.kernels import lossless_cpu as kc


def _coded(n: int = 5000, lane_syms: int = 64) -> tuple[np.ndarray, ...]:
    g = torch.Generator().manual_seed(3)
    words = (torch.randn(n, generator=g) * 0.02).bfloat16().view(torch.int16).numpy().view(np.uint16)
    table = hf.empirical_table(kc.sym_hist(words, 7))
    code, ln = full_codes(table)
    first, count, stride = lane_plan(VERSION_SEGMENTS, n, lane_syms)
    sizes = np.zeros(first.size, dtype=np.int64)
    stream = np.empty(3 * n + first.size, dtype=np.uint8)
    used = kc.encode_lanes(words, 7, code, ln, first, count, stride, sizes, stream)
    raw = np.empty(n, dtype=np.uint8)
    kc.split(words, 7, 1, raw, np.zeros(0, dtype=np.uint8))
    ends = np.cumsum(sizes)
    return words, stream[:used].copy(), ends - sizes, ends, first, count, np.int64(stride), raw, table.dec


def test_decode_lanes_roundtrip_and_its_own_errors() -> None:
    words, stream, starts, ends, first, count, stride, raw, dec = _coded()
    out = np.zeros_like(words)
    kc.decode_lanes(stream, starts, ends, first, count, int(stride), raw, 7, 1, dec, out)
    assert np.array_equal(out, words)
    with pytest.raises(StreamError) as e:  # a lane one byte short
        kc.decode_lanes(stream, starts, ends - np.eye(1, len(ends), 3, dtype=np.int64)[0], first, count,
                        int(stride), raw, 7, 1, dec, out)  # fmt: skip
    assert e.value.code in (1, 2, 3) and isinstance(e.value, ValueError)
    bad_plan = ends.copy()
    bad_plan[-1] = stream.size + 100  # past the stream: refused before anything is read
    with pytest.raises(StreamError) as e:
        kc.decode_lanes(stream, starts, bad_plan, first, count, int(stride), raw, 7, 1, dec, out)
    assert e.value.code == 4
    with pytest.raises(StreamError):  # elements past the output
        kc.decode_lanes(stream, starts, ends, first, count + 5, int(stride), raw, 7, 1, dec, out)


def test_codec_maps_stream_errors_to_codec_error() -> None:
    codec = LosslessCodec(chunk_elems=4096)
    x = (torch.randn(10000) * 0.02).bfloat16()
    data = bytearray(codec.encode(x))
    p = codec.parse(data)
    ch = codec.chunk(p, 0)
    data[int(ch.offsets[0])] ^= 0xFF  # corrupt the first lane, then re-seal so the CRC passes
    import struct
    import zlib

    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    try:
        y = codec.decode(bytes(data))
    except CodecError as e:
        assert not isinstance(e, StreamError)
    else:  # a flip can still decode to valid codes; then it is a different tensor
        assert not torch.equal(y.view(torch.int16), x.view(torch.int16))


def test_kernels_import_nothing_from_compression() -> None:
    root = pathlib.Path(__file__).resolve().parents[2] / "locomm" / "kernels"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.startswith("locomm.compression") for n in names), path.name
