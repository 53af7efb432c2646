"""Every decoder refuses a declaration above the receiver's own bound before it allocates (issue 17 item 7).

A receiver knows how many elements it expects (its payload layout, its micro-batch): ``decode(data,
max_numel=N)``. Each test hands a decoder a payload that declares more than N and checks two things: the
error is :class:`OversizeError` (a shape error), and nothing of the declared size was allocated on the way.
"Allocated" is watched twice: ``tracemalloc`` sees numpy's and Python's buffers, and a wrapper around
torch's factories (``torch.zeros``/``empty``/``full``/``arange``, which tracemalloc cannot see) refuses any
request above the bound before torch makes it. The wrapper is shown to catch the unbounded decode.
"""

from __future__ import annotations

import contextlib
import math
import tracemalloc
from collections.abc import Iterator

import pytest
import torch

from locomm.compression import get_codec
from locomm.compression.base import OversizeError, Reader, Writer, dtype_code, seal
from locomm.compression.boundary import BoundaryCoder
from locomm.compression.payload import MIN_PART_ELEMS, PayloadCodec, PayloadError
from locomm.compression.topk2bit import CHUNK, TopK2BitCodec
from locomm.config import CompressionConfig, RunSpec
from locomm.model.stages import Geometry

N = 1 << 16
"""Elements of the tensors encoded here; decoders are told to expect fewer."""


class BigAllocation(AssertionError):
    pass


@contextlib.contextmanager
def watched(limit_bytes: int) -> Iterator[None]:
    """Fail if anything allocates more than ``limit_bytes`` at once (torch factories) or in total (traced)."""
    originals = {name: getattr(torch, name) for name in ("zeros", "empty", "full", "arange", "ones")}

    def guard(name):
        fn = originals[name]

        def wrapped(*args, **kwargs):
            dims = args[0] if args and isinstance(args[0], (tuple, list, torch.Size)) else args
            if name == "full":
                dims = args[0]
            ints = [int(d) for d in dims if isinstance(d, int)] if name != "arange" else [int(args[-1])]
            dtype = kwargs.get("dtype") or torch.float32
            nbytes = math.prod(ints or [1]) * torch.tensor([], dtype=dtype).element_size()
            if nbytes > limit_bytes:
                raise BigAllocation(f"torch.{name} of {nbytes} bytes")
            return fn(*args, **kwargs)

        return wrapped

    for name in originals:
        setattr(torch, name, guard(name))
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
        assert peak < limit_bytes, f"{peak} bytes traced"
    finally:
        tracemalloc.stop()
        for name, fn in originals.items():
            setattr(torch, name, fn)


def refused(decode, limit_bytes: int) -> str:
    """``decode()`` raises OversizeError and allocates no more than ``limit_bytes``; its message."""
    with watched(limit_bytes), pytest.raises(OversizeError) as e:
        decode()
    return str(e.value)


def topk_claiming(numel: int, k: int = 1) -> bytes:
    """A well-formed, sealed top-k payload that claims ``numel`` elements: ceil(numel/64) * k bytes of values."""
    w = Writer()
    w.u8(dtype_code(torch.float32))
    w.shape((numel,))
    w.u8(k)
    w.f32(0.5)
    w.f32(1.0)
    w.raw(bytes(-(-numel // CHUNK) * k))
    body = Writer()
    body.blob(w.getvalue())
    body.u8(0)
    return seal(TopK2BitCodec.magic, body.getvalue())


def test_a_4mib_topk_part_claiming_2_28_elements_is_refused_before_allocating():
    data = topk_claiming(1 << 28)
    assert len(data) < (4 << 20) + 64  # 4 MiB of packed values: what the sender pays
    codec = TopK2BitCodec()
    msg = refused(lambda: codec.decode(data, max_numel=N), 1 << 20)
    assert str(1 << 28) in msg and str(N) in msg
    refused(lambda: codec.decode_sparse(data, max_numel=N), 1 << 20)
    # The detector is not blind: without the bound the same payload asks for its 1 GiB output.
    with watched(64 << 20), pytest.raises(BigAllocation):
        codec.decode(data)


def test_topk_bound_on_declared_bytes_is_exact():
    x = torch.randn(3, 1000)
    for k in (1, 5, CHUNK):
        enc = get_codec("topk2bit", k=k, error_feedback=False).encode(x)
        assert len(enc) == TopK2BitCodec.max_encoded_bytes(x.numel(), x.ndim, k)
    # A receiver's plan of an encoded value bounds the sender's declaration at one byte per element.
    plan = PayloadCodec({"w": (3, 1000)}, {"sparse": "outer_gradient"}, CompressionConfig(), {"sparse": "topk2bit"})
    (t,) = plan.tensors
    assert t.max_bytes() == TopK2BitCodec.max_encoded_bytes(3000, 2) < 3000 * 4
    with pytest.raises(PayloadError):
        plan.allocate({t.name: t.max_bytes() + 1})


def _lossless() -> bytes:
    return get_codec("lossless").encode(torch.randn(N))


CASES = {
    "lossless": lambda: (get_codec("lossless"), _lossless(), {}),
    "lossless-v1": lambda: (get_codec("lossless"), get_codec("lossless", layout="lanes").encode(torch.randn(N)), {}),
    "bf16": lambda: (get_codec("bf16"), get_codec("bf16").encode(torch.randn(N)), {}),
    "bf16+lossless": lambda: (get_codec("bf16+lossless"), get_codec("bf16+lossless").encode(torch.randn(N)), {}),
    "blockwise8": lambda: (get_codec("blockwise8"), get_codec("blockwise8").encode(torch.randn(N)), {}),
    "blockwise8+lossless": lambda: (
        get_codec("blockwise8+lossless"),
        get_codec("blockwise8+lossless").encode(torch.randn(N)),
        {},
    ),
    "scape": lambda: (get_codec("scape"), get_codec("scape").encode(torch.randn(N)), {}),
    "topk2bit": lambda: (get_codec("topk2bit"), get_codec("topk2bit").encode(torch.randn(N)), {}),
    "topktiles": lambda: (get_codec("topktiles"), get_codec("topktiles").encode(torch.randn(N)), {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_codec_refuses_more_than_expected(name):
    codec, data, ctx = CASES[name]()
    assert codec.decode(data, max_numel=N, **ctx).numel() == N  # exactly the bound is fine
    refused(lambda: codec.decode(data, max_numel=N // 64, **ctx), N * 4 // 8)


def test_subspace_and_boundary_coder_are_bounded_by_the_micro_batch():
    spec = RunSpec.preset("nano").replace("data", batch_size=4, seq_len=32).replace("pipeline", stages=2)
    geo = Geometry.of(spec)
    coder = BoundaryCoder(spec, geo)
    tok = torch.randint(0, 256, (4, 32))
    h = torch.randn(4, 32, geo.d)
    data = coder.encode_activation(h, tok)
    assert coder.decode_activation(data, tok).shape == h.shape
    # A payload for a batch of 4 sent where the receiver's micro-batch is 1 sequence: refused before the
    # (4, 32, d) output is built.
    with watched(h.numel() * 4 // 2), pytest.raises(OversizeError):
        coder.act.decode(data, tokens=tok, max_numel=32 * geo.d)
    sub = get_codec("subspace", d=geo.d, vocab_size=256, rate=8)
    enc = sub.encode(h, tokens=tok)
    refused(lambda: sub.decode(enc, max_numel=32 * geo.d), h.numel() * 4 // 2)


def test_payload_codec_passes_its_part_size():
    codec = PayloadCodec({"w": (N,)}, {"theta": "parameter"}, {"parameter": "lossless"}, part_elems=MIN_PART_ELEMS)
    part = codec.parts()[0]
    dest = codec.allocate()
    big = get_codec("lossless").encode(torch.randn(4 * part.count))  # a valid part of 4x the size
    with watched(part.count * 4), pytest.raises(PayloadError) as e:
        codec.decode_part(dest, part, big)
    assert e.value.kind == "shape"


def test_sparse_payload_finish_is_bounded_by_the_plan():
    shapes = {"w": (64, 64)}
    codec = PayloadCodec(shapes, {"sparse": "outer_gradient"}, CompressionConfig(), {"sparse": "topk2bit"})
    data = topk_claiming(1 << 18, k=1)  # 4 KiB declaring 2^18 elements, for a 4096-element tensor
    assert len(data) <= codec.tensors[0].max_bytes()  # within the declared-bytes bound: only the decoder can tell
    dest = {"sparse/w": bytearray(data)}
    with watched(1 << 20), pytest.raises(PayloadError) as e:
        codec.finish(dest)
    assert e.value.kind == "shape"


def test_reader_shape_bound_counts_every_dim():
    w = Writer()
    w.shape((1 << 20, 1 << 20))
    with pytest.raises(OversizeError):
        Reader(w.getvalue()).shape(1 << 30)
    assert Reader(w.getvalue()).shape() == (1 << 20, 1 << 20)
