"""The numba lane coder against few-line references: the multi-symbol table, both lane plans, escapes, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from locomm.compression import _huffman as hf
from locomm.compression.lossless_format import VERSION_LANES, VERSION_SEGMENTS, full_codes, lane_plan
from locomm.kernels import StreamError
from locomm.kernels import lossless_cpu as kc

TB = hf.TABLE_BITS


def _bits(stream: np.ndarray, start: int, end: int, pos: int, k: int) -> int:
    """``k`` bits of lane ``stream[start:end]`` from bit ``pos``, MSB first, zeros past its end."""
    v = 0
    for b in range(pos, pos + k):
        byte = start + b // 8
        v = (v << 1) | ((int(stream[byte]) >> (7 - b % 8)) & 1 if byte < end else 0)
    return v


def _reference(stream, starts, ends, first, count, stride, dec) -> tuple[np.ndarray | None, int]:
    """(symbols in element order, 0) or (None, error code): one code at a time, as the wire format says."""
    syms = np.zeros(int(first[-1] + count[-1] * stride) if len(first) else 0, dtype=np.uint8)
    for k in range(len(first)):
        start, end, pos = int(starts[k]), int(ends[k]), 0
        for t in range(int(count[k])):
            e = int(dec[_bits(stream, start, end, pos, TB)])
            ln, sym = e & 15, e >> 4
            if ln == 0:
                return None, 1
            pos += ln
            if sym == hf.ESC:
                sym = _bits(stream, start, end, pos, 8)
                pos += 8
            syms[first[k] + t * stride] = sym
        if pos > (end - start) * 8:
            return None, 2
        if (pos + 7) // 8 != end - start:
            return None, 3
    return syms, 0


def _case(kind: str, n: int, version: int, lane_syms: int, seed: int, model: bool):
    dtype, s, nraw = {"bf16": (torch.bfloat16, 7, 1), "fp16": (torch.float16, 8, 1), "fp32": (torch.float32, 23, 3)}[
        kind
    ]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.02
    x[torch.randint(0, n, (max(1, n // 50),), generator=g)] *= 1e4  # rare exponents: escapes under the model
    x = x.to(dtype)
    words = x.view(torch.int16 if nraw == 1 else torch.int32).numpy().view(np.uint16 if nraw == 1 else np.uint32)
    table = hf.model_table(kind, hf.sigma_to_q(0.02)) if model else hf.empirical_table(kc.sym_hist(words, s))
    code, ln = full_codes(table)
    first, count, stride = lane_plan(version, n, lane_syms)
    sizes = np.zeros(first.size, dtype=np.int64)
    stream = np.empty(3 * n + first.size, dtype=np.uint8)
    used = kc.encode_lanes(words, s, code, ln, first, count, stride, sizes, stream)
    raw = np.empty(n * nraw, dtype=np.uint8)
    kc.split(words, s, nraw, raw, np.zeros(0, dtype=np.uint8))
    ends = np.cumsum(sizes)
    return words, stream[:used].copy(), ends - sizes, ends, first, count, int(stride), raw, s, nraw, table.dec


def test_multi_table_agrees_with_one_code_at_a_time() -> None:
    rng = np.random.default_rng(0)
    tables = [hf.model_table("bf16", hf.sigma_to_q(0.02)), hf.model_table("fp16", hf.sigma_to_q(1.0))]
    tables += [hf.empirical_table(rng.integers(0, 1000, 256) * (rng.random(256) < p)) for p in (0.02, 0.3, 1.0)]
    for table in tables:
        dec, m = table.dec, kc.multi_table(table.dec)
        for idx in range(1 << TB):
            e, got = int(m[idx]), []
            if e & 0x80:  # an escape or no code: the one-symbol entry, as it is
                assert e & 15 == dec[idx] & 15 and (e >> 4) & 3 == 1
                assert (dec[idx] & 15) == 0 or dec[idx] >> 4 == hf.ESC
                continue
            pos = 0
            for _ in range((e >> 4) & 3):
                d = int(dec[(idx << pos) & ((1 << TB) - 1)])
                got.append(d >> 4)
                pos += d & 15
            assert pos == e & 15 <= TB and got == [(e >> (8 + 8 * j)) & 0xFF for j in range(len(got))]


@pytest.mark.parametrize("kind", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(
    "n,version,lane_syms",
    [(1, VERSION_SEGMENTS, 1024), (7, VERSION_LANES, 0), (3001, VERSION_LANES, 0), (2999, VERSION_SEGMENTS, 64),
     (4000, VERSION_SEGMENTS, 1), (3000, VERSION_SEGMENTS, 333), (5000, VERSION_SEGMENTS, 1024)],
)  # fmt: skip
@pytest.mark.parametrize("model", [True, False])
def test_decode_lanes_roundtrip(kind: str, n: int, version: int, lane_syms: int, model: bool) -> None:
    words, stream, starts, ends, first, count, stride, raw, s, nraw, dec = _case(kind, n, version, lane_syms, n, model)
    out = np.zeros_like(words)
    kc.decode_lanes(stream, starts, ends, first, count, stride, raw, s, nraw, dec, out)
    assert np.array_equal(out, words)


@pytest.mark.parametrize("version,lane_syms", [(VERSION_LANES, 0), (VERSION_SEGMENTS, 64), (VERSION_SEGMENTS, 700)])
def test_corrupt_lanes_fail_exactly_when_the_reference_fails(version: int, lane_syms: int) -> None:
    """Flipped bytes and moved lane bounds: an error iff the reference errs, the same symbols otherwise."""
    words, stream, starts, ends, first, count, stride, raw, s, nraw, dec = _case(
        "bf16", 2500, version, lane_syms, 1, True
    )
    rng = np.random.default_rng(5)
    outcomes = set()
    for trial in range(60):
        bad, b_starts, b_ends = stream.copy(), starts.copy(), ends.copy()
        if trial % 3 == 0:
            bad[rng.integers(0, bad.size, 2)] ^= rng.integers(1, 256, 2).astype(np.uint8)
        else:  # one lane boundary moved: a lane runs short and the next one long
            k = int(rng.integers(0, len(b_ends) - 1))
            b_ends[k] += int(rng.choice([-2, -1, 1, 2]))
            b_starts[k + 1] = b_ends[k] = min(max(b_ends[k], b_starts[k]), b_ends[k + 1])
        ref, code = _reference(bad, b_starts, b_ends, first, count, stride, dec)
        out = np.zeros_like(words)
        try:
            kc.decode_lanes(bad, b_starts, b_ends, first, count, stride, raw, s, nraw, dec, out)
        except StreamError as e:
            assert ref is None and e.code in (1, 2, 3), (trial, code, e.code)
            outcomes.add("error")
        else:
            assert ref is not None, (trial, code)
            assert np.array_equal((out >> 7) & 0xFF, ref[: out.size])
            outcomes.add("decoded")
    assert outcomes == {"error", "decoded"}


def test_streams_shorter_than_one_load() -> None:
    """Lanes in a buffer under 8 bytes: every load is the bounds-checked one."""
    words, stream, starts, ends, first, count, stride, raw, s, nraw, dec = _case(
        "bf16", 9, VERSION_SEGMENTS, 3, 2, False
    )
    assert stream.size < 8
    out = np.zeros_like(words)
    kc.decode_lanes(stream, starts, ends, first, count, stride, raw, s, nraw, dec, out)
    assert np.array_equal(out, words)


@pytest.mark.parametrize(
    "n,version,lane_syms", [(5, VERSION_LANES, 0), (4099, VERSION_LANES, 0), (3001, VERSION_SEGMENTS, 100)]
)
def test_encode_lanes_writes_the_codes_end_to_end(n: int, version: int, lane_syms: int) -> None:
    """Each lane is its elements' full codes, MSB first, padded to a byte; lanes follow each other."""
    words, stream, starts, ends, first, count, stride, raw, s, nraw, dec = _case("bf16", n, version, lane_syms, 4, True)
    code, ln = full_codes(hf.model_table("bf16", hf.sigma_to_q(0.02)))
    want = bytearray()
    for k in range(len(first)):
        lane = [(int(words[first[k] + t * stride]) >> s) & 0xFF for t in range(int(count[k]))]
        bits = "".join(format(int(code[y]), f"0{int(ln[y])}b") for y in lane)
        bits += "0" * (-len(bits) % 8)
        want += bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))
    assert bytes(stream) == bytes(want)
    with pytest.raises(ValueError):  # a buffer below the worst case is refused, not overrun
        kc.encode_lanes(
            words, s, code, ln, first, count, stride, np.zeros(len(first), np.int64), np.empty(n // 4, np.uint8)
        )
