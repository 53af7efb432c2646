"""Codec benchmark: ratio, entropy bound, one-core speed, error; zstd-3 and lz4 beside.

``run(json_lines=True)`` prints one JSON object per line::

    {"codec": "lossless", "tensor": "gaussian(0,0.02)", "dtype": "bfloat16",
     "ratio": 1.51, "bound_ratio": 1.517, "encode_MBps": ..., "decode_MBps": ..., ...}

``ratio`` = input bytes / payload bytes; ``bound_ratio`` = the Shannon bound of
an exponent coder on the same bytes (word bits / (raw bits + H(symbol
plane))), so ``ratio / bound_ratio`` is the coder's efficiency. Speeds are
input megabytes (10^6 bytes) per second on one core (``torch.set_num_threads(1)``,
codec threads = 1), best of ``repeats`` runs after a warm-up call.
``rel_error`` = ||x - decode(encode(x))|| / ||x|| (0 for lossless codecs).

Real tensors come from :func:`model_tensors`: the project's model trained
for a few steps (weights, last inner gradient, an outer pseudo-gradient,
activations at the middle layer boundary). Pass ``tensors=`` to benchmark
your own (for example from a checkpoint).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

import numpy as np
import torch

from locomm.compression import get_codec
from locomm.compression.base import Codec

DEFAULT_CODECS: tuple[str, ...] = ("lossless", "bf16+lossless", "fp16", "blockwise8", "topk2bit", "scape+lossless")
"""Codec specs benchmarked by default (zstd-3 and lz4 rows are always added)."""

_WORD = {torch.bfloat16: (np.uint16, 7, 16), torch.float16: (np.uint16, 8, 16), torch.float32: (np.uint32, 23, 32)}


def exponent_bound_ratio(x: torch.Tensor) -> float | None:
    """word bits / (raw bits + H(8-bit symbol plane)) for bf16/fp16/fp32, else None."""
    if x.dtype not in _WORD or x.numel() == 0:
        return None
    word, s, wbits = _WORD[x.dtype]
    w = x.contiguous().view(torch.int16 if wbits == 16 else torch.int32).numpy().reshape(-1).view(word)
    counts = np.bincount(((w >> s) & 0xFF).astype(np.int64), minlength=256)
    p = counts[counts > 0] / w.size
    h = float(-(p * np.log2(p)).sum())
    return wbits / (wbits - 8 + h)


def model_tensors(
    preset: str = "nano", steps: int = 20, outer_steps: int = 2, seed: int = 0, seq_len: int = 64, batch: int = 8
) -> list[tuple[str, torch.Tensor]]:
    """Real fp32 training tensors from the project's model (``locomm.model``).

    Trains ``outer_steps`` rounds of ``steps`` AdamW steps on byte tokens of
    this package's source and returns ``[(name, flat tensor)]`` for
    ``weights``, ``gradients`` (last inner step), ``pseudo_gradients`` (start
    of the last round minus its end, DiLoCo's Delta) and ``activations`` (the
    residual stream after the middle block).
    """
    from locomm.config import ModelConfig
    from locomm.model import build_model

    torch.manual_seed(seed)
    cfg = ModelConfig.from_preset(preset)
    model = build_model(cfg, seed=seed)
    import pathlib

    text = b"".join(f.read_bytes() for f in sorted(pathlib.Path(__file__).parent.glob("*.py")))
    tokens = torch.tensor(list(text), dtype=torch.long) % cfg.vocab_size
    seq_len = min(seq_len, cfg.max_seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    acts: list[torch.Tensor] = []
    mid = model.layers[len(model.layers) // 2 - 1] if len(model.layers) > 1 else model.layers[0]
    hook = mid.register_forward_hook(lambda _m, _i, out: acts.append(out.detach().reshape(-1).clone()))
    g = torch.Generator().manual_seed(seed)
    start: list[torch.Tensor] = []
    for _ in range(outer_steps):
        start = [p.detach().clone() for p in model.parameters()]
        for _ in range(steps):
            idx = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=g)
            x = torch.stack([tokens[i : i + seq_len] for i in idx])
            y = torch.stack([tokens[i + 1 : i + seq_len + 1] for i in idx])
            acts.clear()
            loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    hook.remove()
    params = list(model.parameters())
    flat = lambda ts: torch.cat([t.detach().reshape(-1).float() for t in ts])  # noqa: E731
    return [
        ("weights", flat(params)),
        ("gradients", flat(p.grad for p in params if p.grad is not None)),
        ("pseudo_gradients", flat(s - p.detach() for s, p in zip(start, params))),
        ("activations", acts[-1].float()),
    ]


def _time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _raw_bytes(x: torch.Tensor) -> bytes:
    t = x.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def bench_one(spec: str, name: str, x: torch.Tensor, repeats: int = 3) -> dict[str, Any]:
    """One row: ``spec`` (a codec spec, ``zstd-3`` or ``lz4``) on tensor ``x``."""
    nbytes = x.numel() * x.element_size()
    row: dict[str, Any] = {
        "codec": spec,
        "tensor": name,
        "dtype": str(x.dtype).replace("torch.", ""),
        "numel": x.numel(),
        "bytes_in": nbytes,
        "bound_ratio": exponent_bound_ratio(x),
    }
    if spec in ("zstd-3", "lz4"):
        raw = _raw_bytes(x)
        if spec == "zstd-3":
            import zstandard

            cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
            enc: Callable[[], bytes] = lambda: cctx.compress(raw)  # noqa: E731
            dec: Callable[[bytes], Any] = dctx.decompress
        else:
            import lz4.frame

            enc, dec = (lambda: lz4.frame.compress(raw)), lz4.frame.decompress
        enc()
        te, data = _time(enc, repeats)
        td, _ = _time(lambda: dec(data), repeats)
        err = 0.0
    else:
        codec: Codec = get_codec(spec)
        if "topk2bit" in spec or "scape" in spec:
            _prepare_stateful(codec, x)
        codec.encode(x)  # warm-up: JIT, caches, error-feedback buffers
        if "scape" in spec:
            _prepare_stateful(codec, x)
        te, data = _time(lambda: codec.encode(x), repeats)
        td, y = _time(lambda: codec.decode(data), repeats)
        xf = x.float()
        err = float((xf - y.float()).norm() / xf.norm().clamp_min(1e-30)) if x.numel() else 0.0
    row.update(
        bytes_out=len(data),
        ratio=nbytes / max(len(data), 1),
        encode_MBps=nbytes / te / 1e6,
        decode_MBps=nbytes / td / 1e6,
        rel_error=err,
    )
    return row


def _prepare_stateful(codec: Codec, x: torch.Tensor) -> None:
    """SCAPE needs a mask: use |x| as a stand-in first moment."""
    for c in getattr(codec, "codecs", [codec]):
        if hasattr(c, "update_mask"):
            c.update_mask(x)


def synthetic_tensors(quick: bool) -> list[tuple[str, torch.Tensor]]:
    """Gaussian N(0, 0.02) tensors: 64 MB each (4 MB with ``quick``), bf16 and fp32."""
    mb = 4 if quick else 64
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        n = mb * (1 << 20) // torch.empty((), dtype=dtype).element_size()
        out.append(("gaussian(0,0.02)", (torch.randn(n, generator=g) * 0.02).to(dtype)))
    return out


def run(
    json_lines: bool = False,
    quick: bool = False,
    codecs: Sequence[str] | None = None,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    real: bool = True,
    repeats: int | None = None,
    file: IO[str] | None = None,
) -> list[dict[str, Any]]:
    """Benchmark codecs and print a rich table (or JSON lines); returns the rows.

    Args:
        json_lines: print one JSON object per row instead of a table.
        quick: 4 MB synthetic tensors, fewer repeats, the nano model's tensors.
        codecs: codec specs; default :data:`DEFAULT_CODECS`.
        tensors: extra ``(name, tensor)`` pairs to benchmark (the hook for
            real tensors from elsewhere, e.g. a checkpoint).
        real: also train the project's model briefly and benchmark its tensors.
        repeats: timing repeats (best is kept); default 3, 2 with ``quick``.
        file: where to print (default stdout).
    """
    torch.set_num_threads(1)
    out = file or sys.stdout
    repeats = repeats or (2 if quick else 3)
    specs = list(codecs or DEFAULT_CODECS)
    cases = synthetic_tensors(quick)
    if real:
        try:
            model_cases = model_tensors("nano" if quick else "tiny", steps=10 if quick else 20)
        except ImportError as exc:  # model package not available
            print(f"# real tensors skipped: {exc}", file=sys.stderr)
        else:
            cases += [(n, t) for n, t in model_cases] + [(n, t.bfloat16()) for n, t in model_cases]
    cases += list(tensors or [])
    rows: list[dict[str, Any]] = []
    for name, x in cases:
        for spec in [*specs, "zstd-3", "lz4"]:
            if spec.startswith(("fp16", "bf16")) and x.dtype == torch.bfloat16 and "lossless" not in spec:
                continue  # a cast to the same or a sibling 16-bit type says nothing
            row = bench_one(spec, name, x, repeats)
            rows.append(row)
            if json_lines:
                print(json.dumps(row), file=out, flush=True)
    if not json_lines:
        _print_table(rows, out)
    return rows


def _print_table(rows: list[dict[str, Any]], out: IO[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="locomm codecs (one core; MB = 10^6 bytes of input)")
    for col in ("tensor", "dtype", "MB", "codec", "ratio", "bound", "enc MB/s", "dec MB/s", "rel err"):
        table.add_column(col, justify="left" if col in ("tensor", "codec", "dtype") else "right")
    for r in rows:
        table.add_row(
            r["tensor"],
            r["dtype"],
            f"{r['bytes_in'] / 1e6:.1f}",
            r["codec"],
            f"{r['ratio']:.3f}",
            "-" if r["bound_ratio"] is None else f"{r['bound_ratio']:.3f}",
            f"{r['encode_MBps']:.0f}",
            f"{r['decode_MBps']:.0f}",
            f"{r['rel_error']:.2e}",
        )
    Console(file=out, width=140).print(table)
