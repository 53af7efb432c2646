"""The Triton kernels against their CPU references, run on CPU tensors by Triton's interpreter.

Lossless and topk2bit must write the CPU codec's bytes exactly; subspace and
the model kernels agree within float32 rounding (tolerances below). Tensors
are small: the interpreter runs every kernel op as a numpy call.
"""

from __future__ import annotations

import math
import os
import struct
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

# @triton.jit reads TRITON_INTERPRET when the kernel modules are imported, so it is
# set before; the fixture below keeps it set while these tests run, and restores it.
_PREV = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]' or '.[test]')")
    from locomm.kernels import load_all

    load_all()
finally:
    if _PREV is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREV

from locomm.compression import CodecError, get_codec  # noqa: E402
from locomm.compression.lossless import VERSION_SEGMENTS, LosslessCodec  # noqa: E402
from locomm.compression.subspace import SubspaceCodec, project_onto_subspace_  # noqa: E402
from locomm.compression.topk2bit import TopK2BitCodec  # noqa: E402
from locomm.kernels import model as km  # noqa: E402
from locomm.kernels import resolve_impl  # noqa: E402

pytestmark = pytest.mark.timeout(300)

INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT[t.dtype])


def _special(dtype: torch.dtype) -> torch.Tensor:
    f = torch.finfo(dtype)
    return torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, f.tiny / 4, -f.max, 1.0], dtype=torch.float32).to(
        dtype
    )


def _cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    gauss = (torch.randn(700, generator=g) * 0.02).to(dtype)
    gauss[::97] = _special(dtype)
    word = torch.randint(-(2**15), 2**15, (300,), generator=g, dtype=torch.int32)
    raw = word.to(torch.int16).view(dtype) if dtype != torch.float32 else (word * 65537).view(torch.float32)
    return {
        "empty": torch.zeros(0, dtype=dtype),
        "one": torch.tensor([0.5], dtype=dtype),
        "gauss+specials": gauss,
        "zeros": torch.zeros(77, dtype=dtype),
        "relu": torch.relu(torch.randn(500, generator=g)).to(dtype),
        "any bits": raw,
        "non-contiguous": (torch.randn(24, 20, generator=g) * 3).to(dtype).t(),
    }


@pytest.mark.parametrize("dtype", list(INT))
def test_lossless_bytes_match_cpu_and_roundtrip(dtype: torch.dtype) -> None:
    """Triton encode == numba encode, bit for bit; both decoders restore every bit."""
    cpu = LosslessCodec(chunk_elems=256, lane_syms=8, impl="cpu")
    tri = LosslessCodec(chunk_elems=256, lane_syms=8, impl="triton")
    for name, x in _cases(dtype).items():
        ref = cpu.encode(x)
        assert ref[4] == VERSION_SEGMENTS
        assert tri.encode(x) == ref, name
        y = tri.decode(ref)
        assert y.shape == x.shape and torch.equal(bits(y), bits(x)), name
        assert torch.equal(bits(cpu.decode(ref)), bits(x)), name


def test_lossless_empirical_table_and_version1() -> None:
    x = (torch.randn(600, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    kw = dict(chunk_elems=300, lane_syms=16, table="empirical")
    assert LosslessCodec(impl="triton", **kw).encode(x) == LosslessCodec(impl="cpu", **kw).encode(x)
    old = LosslessCodec(layout="lanes").encode(x)  # version 1 still decodes, through the CPU
    assert old[4] == 1
    assert torch.equal(bits(LosslessCodec(impl="triton").decode(old)), bits(x))


def test_lossless_default_codec_ratio_unchanged_by_segments() -> None:
    """The segmented layout costs < 1% of size against the 4-lane one (bf16 N(0, 0.02))."""
    x = (torch.randn(1 << 18, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16()
    v2, v1 = LosslessCodec().encode(x), LosslessCodec(layout="lanes").encode(x)
    assert len(v2) < 1.01 * len(v1)
    assert torch.equal(bits(LosslessCodec().decode(v2)), bits(x))


def _reseal(data: bytes) -> bytes:
    return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4]))


def test_crc32_kernel_matches_zlib() -> None:
    from locomm.kernels.crc32 import crc32

    g = torch.Generator().manual_seed(8)
    for n in (0, 1, 7, 65, 1000):
        d = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        for block in (1, 16, 64):
            assert crc32(d, block) == zlib.crc32(d.numpy().tobytes()), (n, block)
    d = torch.arange(300, dtype=torch.uint8)[::3]  # a strided view is read as its values
    assert crc32(d.contiguous(), 8) == zlib.crc32(d.contiguous().numpy().tobytes())


def test_lossless_triton_decoder_rejects_bad_streams() -> None:
    x = (torch.randn(200, generator=torch.Generator().manual_seed(4)) * 0.02).bfloat16()
    codec = LosslessCodec(chunk_elems=256, lane_syms=16, impl="triton")
    data = bytearray(codec.encode(x))
    # header (4 + 1 + 1 + 1 + 8 + 4 + 4 = 23), chunk_len u32, mode, sigma f32: the lane sizes follow
    lane0 = 23 + 4 + 1 + 4
    assert data[27] == 2  # MODE_MODEL
    for delta in (1, -1):
        bad = bytearray(data)
        size = struct.unpack_from("<H", bad, lane0)[0]
        struct.pack_into("<H", bad, lane0, size + delta)
        struct.pack_into("<H", bad, lane0 + 2, struct.unpack_from("<H", bad, lane0 + 2)[0] - delta)
        with pytest.raises(CodecError):
            codec.decode(_reseal(bytes(bad)))
        with pytest.raises(CodecError):
            LosslessCodec(impl="cpu").decode(_reseal(bytes(bad)))
    junk = bytearray(data)
    junk[lane0 + 40 : lane0 + 60] = b"\xff" * 20
    with pytest.raises(CodecError):
        codec.decode(_reseal(bytes(junk)))
    with pytest.raises(CodecError, match="checksum"):  # the device-side CRC check
        codec.decode(bytes(junk))


@pytest.mark.parametrize("k", [1, 3])
def test_topk2bit_bytes_and_error_feedback_match_cpu(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    for n in (0, 1, 65, 200):
        x = torch.randn(n, generator=g)
        if n > 10:
            x[3], x[5], x[20:40] = math.nan, math.inf, 0.0
        cpu, tri = TopK2BitCodec(k=k, impl="cpu"), TopK2BitCodec(k=k, impl="triton")
        for r in range(3):
            xr = x * (r + 1)
            a, b = cpu.encode(xr), tri.encode(xr)
            assert a == b, (n, r)
            if n:
                ea, eb = cpu.error, tri.error
                assert ea is not None and eb is not None
                same = (ea.view(torch.int32) == eb.view(torch.int32)) | (ea.isnan() & eb.isnan())
                assert bool(same.all()), (n, r)
            assert torch.equal(tri.decode(b).nan_to_num(), cpu.decode(a).nan_to_num())
    ties = torch.randint(-3, 4, (300,), generator=g).float()  # ties at the k-th place everywhere
    assert TopK2BitCodec(k=k, impl="triton").encode(ties) == TopK2BitCodec(k=k, impl="cpu").encode(ties)
    x = torch.randn(10, 13, generator=g).t()  # non-contiguous
    assert TopK2BitCodec(k=k, impl="triton", error_feedback=False).encode(x) == TopK2BitCodec(
        k=k, impl="cpu", error_feedback=False
    ).encode(x)


def test_subspace_kernels_match_eager() -> None:
    """z within 1e-5 (fp32), h within one bf16 ulp of the CPU codec's."""
    g = torch.Generator().manual_seed(5)
    for d, k, V in ((48, 5, 37), (64, 16, 256)):
        cpu = SubspaceCodec(d=d, vocab_size=V, k=k, impl="cpu")
        tri = SubspaceCodec(d=d, vocab_size=V, k=k, impl="triton")
        for shape in ((3, 7), (0,), (1,)):
            tok = torch.randint(0, V, shape, generator=g)
            h = (torch.randn(*shape, d, generator=g) + cpu.E_f[tok]).bfloat16()
            za, zb = cpu.encode_parts(h, tokens=tok)[1][0], tri.encode_parts(h, tokens=tok)[1][0]
            torch.testing.assert_close(zb, za, rtol=1e-5, atol=1e-5)
            data = cpu.encode(h, tokens=tok)
            ya, yb = cpu.decode(data), tri.decode(data)
            assert yb.dtype == torch.bfloat16 and yb.shape == ya.shape
            torch.testing.assert_close(yb.float(), ya.float(), rtol=2**-7, atol=1e-6)
        grad = SubspaceCodec(d=d, vocab_size=V, k=k, kind="gradient", impl="triton")
        gr = torch.randn(4, d, generator=g)[:, None, :].expand(4, 2, d)  # non-contiguous
        ref = SubspaceCodec(d=d, vocab_size=V, k=k, kind="gradient", impl="cpu")
        torch.testing.assert_close(grad.decode(grad.encode(gr)), ref.decode(ref.encode(gr)), rtol=1e-5, atol=1e-5)


def test_weight_projection_kernel_matches_eager() -> None:
    from torch import nn

    d, V = 40, 30
    U = SubspaceCodec(d=d, vocab_size=V, k=6).U

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(V, d)
            self.blk = nn.Module()
            self.blk.attn = nn.Module()
            self.blk.attn.wo = nn.Linear(d, d, bias=False)
            self.blk.mlp = nn.Module()
            self.blk.mlp.w2 = nn.Linear(3 * d, d, bias=False)

    a = Tiny()
    b = Tiny()
    b.load_state_dict(a.state_dict())
    assert project_onto_subspace_(a, U, impl="cpu") == project_onto_subspace_(b, U, impl="triton")
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6)


def test_fused_model_kernels_match_eager() -> None:
    from locomm.model.llama import RMSNorm

    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 3, 48, generator=g, requires_grad=True)
    r = torch.randn(5, 3, 48, generator=g, requires_grad=True)
    ref = RMSNorm(48, 1e-5)
    ref.weight.data = torch.rand(48, generator=g) + 0.5
    w = ref.weight.detach().clone().requires_grad_()
    s, y = km.add_rmsnorm(x, r, w, 1e-5)
    (y.square().sum() + (3 * s).sum()).backward()
    got = (s, y, x.grad, r.grad, w.grad)
    x.grad = r.grad = None
    s2 = x + r
    y2 = ref(s2)
    (y2.square().sum() + (3 * s2).sum()).backward()
    for a, b in zip(got, (s2, y2, x.grad, r.grad, ref.weight.grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    a = torch.randn(7, 33, generator=g, requires_grad=True)
    b = torch.randn(7, 33, generator=g, requires_grad=True)
    km.swiglu(a, b).sin().sum().backward()
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    (F.silu(a) * b).sin().sum().backward()
    torch.testing.assert_close(ga, a.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gb, b.grad, rtol=1e-5, atol=1e-6)

    logits = torch.randn(10, 256, generator=g, requires_grad=True)
    t = torch.randint(0, 256, (10,), generator=g)
    (2 * km.cross_entropy(logits, t)).backward()
    gl = logits.grad
    logits.grad = None
    (2 * F.cross_entropy(logits, t)).backward()
    torch.testing.assert_close(gl, logits.grad, rtol=1e-5, atol=1e-7)


def test_fused_model_step_matches_eager() -> None:
    from locomm.config import ModelConfig
    from locomm.model import build_model

    cfg = ModelConfig.from_preset("nano")
    eager, fused = build_model(cfg), km.fuse_(build_model(cfg))
    g = torch.Generator().manual_seed(7)
    tok, tgt = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    le, lf = eager(tok, tgt), fused(tok, tgt)
    le.backward()
    lf.backward()
    torch.testing.assert_close(lf, le, rtol=1e-5, atol=1e-6)
    for pe, pf in zip(eager.parameters(), fused.parameters()):
        torch.testing.assert_close(pf.grad, pe.grad, rtol=1e-4, atol=1e-6)


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_impl("auto", "cpu") == "cpu"
    assert resolve_impl("cpu", "cpu") == "cpu"
    assert resolve_impl("triton", "cpu") == "triton"
    with pytest.raises(ValueError):
        get_codec("lossless", impl="gpu")
    stack = get_codec("bf16+lossless", impl="triton")
    assert stack.codecs[1].impl == "triton"  # type: ignore[attr-defined]
    x = torch.randn(50)
    assert stack.encode(x) == get_codec("bf16+lossless").encode(x)
    assert get_codec("topk2bit", impl="cpu", k=2).impl == "cpu"  # type: ignore[attr-defined]
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_impl("triton", "cpu")
    assert np.frombuffer(get_codec("lossless").encode(x), np.uint8)[4] == VERSION_SEGMENTS


def test_kernels_compile_for_a_gpu() -> None:
    """The real compiler takes every kernel down to a cubin for sm_90 (no GPU needed)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "locomm.kernels.compile_check", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": ok") == 17, run.stdout
