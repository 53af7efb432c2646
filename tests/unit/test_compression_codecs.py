"""Lossy codecs, stacks and the registry: round trips with error bounds, state, sizes."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from locomm.compression import (
    CodecError,
    CodecStack,
    TensorRole,
    available_codecs,
    codec_choice,
    get_codec,
)
from locomm.compression.blockwise8 import Blockwise8Codec
from locomm.compression.scape import ScapeCodec
from locomm.compression.subspace import SubspaceCodec
from locomm.compression.topk2bit import TopK2BitCodec
from locomm.config import CompressionConfig

pytestmark = pytest.mark.timeout(120)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(0, 50), min_size=0, max_size=3).map(tuple)
float_dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def randn(shape: tuple[int, ...], seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@SETTINGS
@given(
    shape=shapes,
    seed=st.integers(0, 10**6),
    scale=st.sampled_from([1e-3, 1.0, 100.0]),
    dtype=float_dtypes,
    name=st.sampled_from(["fp16", "bf16"]),
)
def test_casts_equal_torch_cast(shape: tuple[int, ...], seed: int, scale: float, dtype: torch.dtype, name: str) -> None:
    x = randn(shape, seed, scale, dtype)
    for spec in (name, f"{name}+lossless"):
        c = get_codec(spec)
        y = c.decode(c.encode(x))
        target = torch.float16 if name == "fp16" else torch.bfloat16
        assert y.dtype == target and torch.equal(y.view(torch.int16), x.to(target).view(torch.int16))


@SETTINGS
@given(
    shape=shapes,
    seed=st.integers(0, 10**6),
    scale=st.sampled_from([1e-3, 1.0, 1e4]),
    blocksize=st.sampled_from([64, 256, 4096]),
)
def test_blockwise8_error_bound(shape: tuple[int, ...], seed: int, scale: float, blocksize: int) -> None:
    x = randn(shape, seed, scale)
    for c in (Blockwise8Codec(blocksize), get_codec("blockwise8+lossless", blocksize=blocksize)):
        y = c.decode(c.encode(x))
        assert y.shape == x.shape and y.dtype == x.dtype
        pad = -x.numel() % blocksize
        absmax = torch.nn.functional.pad(x.reshape(-1).abs(), (0, pad)).view(-1, blocksize).amax(1, keepdim=True)
        err = torch.nn.functional.pad((x - y).reshape(-1).abs(), (0, pad)).view(-1, blocksize)
        assert bool((err <= Blockwise8Codec.max_abs_error(1.0) * absmax * (1 + 1e-5)).all())


@SETTINGS
@given(
    n=st.integers(0, 3000),
    seed=st.integers(0, 10**6),
    k=st.integers(1, 4),
    beta=st.sampled_from([1.0, 0.9]),
    rounds=st.integers(1, 4),
)
def test_topk2bit_error_feedback_invariant(n: int, seed: int, k: int, beta: float, rounds: int) -> None:
    """e_new + Dhat == beta * e_old + x, at most k values per 64-chunk, Dhat has 2 magnitudes."""
    c = TopK2BitCodec(k=k, beta=beta)
    e_old = torch.zeros(n)
    for r in range(rounds):
        x = randn((n,), seed + r)
        data = c.encode(x)
        dhat = c.decode(data)
        assert c.error is not None
        torch.testing.assert_close(c.error + dhat, beta * e_old + x, rtol=1e-5, atol=1e-5)
        e_old = c.error.clone()
        nz = (dhat != 0).float()
        if n:
            assert int(torch.nn.functional.pad(nz, (0, -n % 64)).view(-1, 64).sum(1).max()) <= k
        assert len(torch.unique(dhat.abs()[dhat != 0])) <= 2
        idx, vals, shape = c.decode_sparse(data)
        dense = torch.zeros(n)
        dense[idx] = vals
        assert shape == (n,) and torch.equal(dense, dhat)


@pytest.mark.parametrize("k", [1, 2])  # 1.56% and 3.1% density
def test_topk2bit_compresses_over_30x(k: int) -> None:
    x = randn((1 << 20,), 0, 0.01)
    data = TopK2BitCodec(k=k).encode(x)
    ratio = x.numel() * 4 / len(data)
    assert ratio > 30, ratio
    bf16_ratio = x.numel() * 2 / len(data)
    assert bf16_ratio > 30, bf16_ratio  # even against a bf16 baseline


@SETTINGS
@given(
    n=st.integers(1, 4000),
    seed=st.integers(0, 10**6),
    sparsity=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    rounds=st.integers(1, 4),
)
def test_scape_masks_one_step_late_with_error_feedback(n: int, seed: int, sparsity: float, rounds: int) -> None:
    c = ScapeCodec(sparsity=sparsity)
    total_in = torch.zeros(n)
    total_sent = torch.zeros(n)
    mask_idx = None
    for r in range(rounds):
        g = randn((n,), seed + r)
        total_in += g
        sent = c.decode(c.encode(g))
        if mask_idx is None:
            assert torch.equal(sent, total_in - total_sent)  # before any mask: dense
        else:
            off = torch.ones(n, dtype=torch.bool)
            off[mask_idx] = False
            assert not sent[off].any()  # only the mask set LAST step is sent
        total_sent += sent
        assert c.residual is not None
        torch.testing.assert_close(total_sent + c.residual, total_in, rtol=1e-5, atol=1e-5)
        mask_idx = c.update_mask(randn((n,), seed + 100 + r))  # stand-in first moment
        assert mask_idx.numel() == max(1, int(np.ceil((1 - sparsity) * n)))


def test_scape_index_formats_and_value_dtype() -> None:
    from locomm.compression import scape

    x = randn((10000,), 1)
    for sparsity, fmt in ((0.5, scape.IDX_BITMAP), (0.99, scape.IDX_GAPS)):
        c = ScapeCodec(sparsity=sparsity, value_dtype=torch.bfloat16)
        c.update_mask(randn((10000,), 2))
        meta, parts = c.encode_parts(x)
        assert meta[1 + 1 + 8] == fmt  # dtype, ndim, shape, then the format byte
        assert parts[0].dtype == torch.bfloat16
    gaps = np.array([0, 5, 6, 1000, 2**20, 2**35], dtype=np.int64)
    assert np.array_equal(scape._decode_gaps(np.frombuffer(scape._encode_gaps(gaps), np.uint8), 6, 2**36), gaps)


def _subspace_h(c: SubspaceCodec, lead: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, c.vocab_size, lead, generator=g)
    h = c.E_f[tok] + torch.randn(*lead, c.k, generator=g) @ c.U.T
    return h, tok


@pytest.mark.parametrize("include_tokens", [True, False])
def test_subspace_roundtrip(include_tokens: bool) -> None:
    c = SubspaceCodec(d=128, vocab_size=300, rate=32, include_tokens=include_tokens)
    assert c.k == 4
    torch.testing.assert_close(c.U.T @ c.U, torch.eye(4), atol=1e-6, rtol=0)
    h, tok = _subspace_h(c, (3, 7), 0)
    data = c.encode(h, tokens=tok)
    y = c.decode(data) if include_tokens else c.decode(data, tokens=tok)
    torch.testing.assert_close(y, h, rtol=1e-5, atol=1e-5)
    assert c.residual_norm(h, tok) < 1e-6
    if not include_tokens:
        with pytest.raises(CodecError):
            c.decode(data)
    # stacked, with bf16 z: bounded error
    s = get_codec("subspace+bf16+lossless", subspace=dict(d=128, vocab_size=300, rate=32))
    y = s.decode(s.encode(h, tokens=tok))
    assert float((y - h).norm() / h.norm()) < 1e-2
    with pytest.raises(CodecError, match="different basis"):
        SubspaceCodec(d=128, vocab_size=300, rate=32, seed=1).decode(data, tokens=tok)


def test_subspace_gradient_kind_is_the_projection() -> None:
    c = SubspaceCodec(d=64, vocab_size=10, k=8, kind="gradient")
    g = randn((5, 64), 3)
    y = c.decode(c.encode(g))
    torch.testing.assert_close(y, (g @ c.U) @ c.U.T, rtol=1e-5, atol=1e-6)


def test_stack_registry_and_roles() -> None:
    assert set(available_codecs()) >= {"lossless", "topk2bit", "scape", "blockwise8", "fp16", "bf16", "subspace"}
    s = get_codec("topk2bit+lossless", k=2, beta=0.9)
    assert isinstance(s, CodecStack) and s.codecs[0].k == 2 and s.codecs[0].beta == 0.9  # type: ignore[attr-defined]
    x = randn((5000,), 0)
    assert torch.equal(
        s.decode(s.encode(x)), TopK2BitCodec(k=2, beta=0.9).decode(TopK2BitCodec(k=2, beta=0.9).encode(x))
    )
    with pytest.raises(ValueError):
        get_codec("nope")
    with pytest.raises(ValueError):
        get_codec("bf16+lossless", bogus=1)
    with pytest.raises(ValueError):
        CodecStack([get_codec("lossless"), get_codec("bf16")])
    assert codec_choice(TensorRole.PARAMETER, CompressionConfig()).build().name == "lossless"
    c = codec_choice("outer_gradient", {"outer_gradient": "topk2bit"}).build(k=2)
    assert isinstance(c, TopK2BitCodec) and c.k == 2
    assert codec_choice(TensorRole.ACTIVATION, {"activation": "fp16"}).build().name == "fp16"
    a, b = (
        codec_choice("outer_gradient", {"outer_gradient": "topk2bit"}).build(),
        codec_choice("outer_gradient", {"outer_gradient": "topk2bit"}).build(),
    )
    assert a is not b  # stateful codecs: one object per tensor stream


def test_no_asyncio_or_sockets_in_compression() -> None:
    root = pathlib.Path(__file__).resolve().parents[2] / "locomm" / "compression"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for n in names:
                assert n.split(".")[0] not in {"asyncio", "socket", "trio", "selectors"}, (path.name, n)


def test_a_codec_whose_package_is_not_installed_is_refused_before_the_run(monkeypatch):
    """bitsandbytes is the int8 extra's: without it a spec naming blockwise8 is refused when its payload layout
    is built (at start), naming the extra; the default stacks need nothing optional."""
    import importlib.util

    from locomm.compression.registry import missing_packages

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    assert missing_packages("blockwise8+lossless") == ["bitsandbytes"]
    assert missing_packages("bf16+lossless") == [] and missing_packages("lossless") == []
    with pytest.raises(ValueError, match=r"locomm\[int8\]"):
        get_codec("blockwise8")
