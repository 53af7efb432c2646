"""locomm's lossless coder (layouts v1 and v2) against zipnn, one thread, in one run.

    python benchmarks/codecs.py                # 64 MB of bf16 Gaussian weights + real weights, 5 repeats
    python benchmarks/codecs.py --quick        # 4 MB, 3 repeats (a smoke run)
    python benchmarks/codecs.py --all-codecs   # the older table: every codec against zstd-3 and lz4

Tensors: ``gaussian``, N(0, 0.02^2) in bf16; ``small-init``, the ``small`` preset's
initialised weights (seed 0, every parameter in order) in bf16, cut to the same size;
``tiny-trained``, the ``tiny`` preset's weights after 20 AdamW steps (all of them,
about 13 MB) in bf16. zipnn is pip's ``zipnn`` (the ``bench`` extra), with
``threads=1``; its compress reorders its input in place, so every repeat gets a
fresh copy (not timed). Every figure is the median of the repeats, wall clock (the
machine may be shared: the process CPU time, every thread, is recorded too), MB = 10^6 bytes of
the raw tensor. Every decode is checked bit for bit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from locomm.compression.lossless import LosslessCodec

import _harness


def _time(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> tuple[float, float, Any]:
    """(median wall s, median process CPU s, last result) of ``fn`` (given ``setup()``'s value, if any)."""
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        arg = setup() if setup is not None else None
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn() if setup is None else fn(arg)  # type: ignore[call-arg]
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), out


def tensors(mb: float, quick: bool) -> list[tuple[str, torch.Tensor]]:
    n = int(mb * 1e6) // 2
    g = torch.Generator().manual_seed(0)
    out = [("gaussian", (torch.randn(n, generator=g) * 0.02).bfloat16())]
    from locomm.compression.bench import model_tensors
    from locomm.config import ModelConfig
    from locomm.model import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("nano" if quick else "small"), seed=0)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])[:n].bfloat16()
    out.append(("nano-init" if quick else "small-init", flat))
    del model
    trained = dict(model_tensors("nano" if quick else "tiny", steps=20, outer_steps=1))["weights"]
    out.append(("nano-trained" if quick else "tiny-trained", trained.bfloat16()))
    return out


def bench_locomm(layout: str, x: torch.Tensor, repeats: int) -> dict[str, Any]:
    codec = LosslessCodec(layout=layout, threads=1, impl="cpu")
    codec.decode(codec.encode(x[:4096]))  # compile (or load) the kernels first
    te, ce, data = _time(lambda: codec.encode(x), repeats)
    td, cd, y = _time(lambda: codec.decode(data), repeats)
    assert torch.equal(y.view(torch.int16), x.view(torch.int16)), f"lossless {layout} is not bit-exact"
    return dict(bytes=len(data), enc_s=te, dec_s=td, enc_cpu_s=ce, dec_cpu_s=cd)


def bench_zipnn(x: torch.Tensor, repeats: int) -> dict[str, Any]:
    from zipnn import ZipNN

    raw = x.view(torch.uint8).numpy().tobytes()
    z = ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
    te, ce, data = _time(lambda buf: z.compress(buf), repeats, setup=lambda: bytearray(raw))
    td, cd, y = _time(lambda: z.decompress(data), repeats)
    assert bytes(y) == raw, "zipnn round trip is not bit-exact"
    return dict(bytes=len(data), enc_s=te, dec_s=td, enc_cpu_s=ce, dec_cpu_s=cd)


def main() -> None:
    ap = _harness.parser(__doc__, out="codecs_zipnn.json", quick=True)
    ap.add_argument("--mb", type=float, default=None, help="Size of the Gaussian tensor (default 64, --quick 4)")
    ap.add_argument("--repeats", type=int, default=None, help="Timed repeats per figure (default 5, --quick 3)")
    ap.add_argument("--no-zipnn", action="store_true", help="Only locomm's layouts (zipnn not installed)")
    ap.add_argument("--all-codecs", action="store_true", help="The older table of every codec vs zstd and lz4")
    args = ap.parse_args()
    if args.all_codecs:
        from locomm.compression.bench import DEFAULT_CODECS, run

        run(json_lines=False, quick=args.quick, codecs=list(DEFAULT_CODECS), real=True, repeats=args.repeats)
        return
    torch.set_num_threads(1)
    mb = args.mb or (4.0 if args.quick else 64.0)
    repeats = args.repeats or (3 if args.quick else 5)
    rows: list[dict[str, Any]] = []
    head = f"{'tensor':14s} {'MB':>6s} {'coder':10s} {'ratio':>7s} {'enc MB/s':>9s} {'dec MB/s':>9s}"
    print(head + f" {'enc cpu':>8s} {'dec cpu':>8s}\n" + "-" * (len(head) + 18), flush=True)
    for name, x in tensors(mb, args.quick):
        size = x.numel() * 2
        coders: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("locomm-v1", lambda: bench_locomm("lanes", x, repeats)),
            ("locomm-v2", lambda: bench_locomm("segments", x, repeats)),
        ]
        if not args.no_zipnn:
            coders.append(("zipnn", lambda: bench_zipnn(x, repeats)))
        for coder, fn in coders:
            r = fn()
            row = dict(
                tensor=name,
                mb=size / 1e6,
                coder=coder,
                ratio=size / r["bytes"],
                encode_mbps=size / 1e6 / r["enc_s"],
                decode_mbps=size / 1e6 / r["dec_s"],
                encode_cpu_mbps=size / 1e6 / r["enc_cpu_s"],
                decode_cpu_mbps=size / 1e6 / r["dec_cpu_s"],
                repeats=repeats,
            )
            rows.append(row)
            print(
                f"{name:14s} {row['mb']:6.1f} {coder:10s} {row['ratio']:7.4f} {row['encode_mbps']:9.0f} "
                f"{row['decode_mbps']:9.0f} {row['encode_cpu_mbps']:8.0f} {row['decode_cpu_mbps']:8.0f}",
                flush=True,
            )
    if args.out is not None:
        meta = dict(threads=1, statistic="median", mb_unit=1e6)
        try:
            import zipnn

            meta["zipnn"] = getattr(zipnn, "__version__", None) or _harness._version("zipnn")
        except ImportError:
            pass
        path = _harness.write_json(args.out, dict(meta=meta, rows=rows, load_avg=list(np.round(_loadavg(), 2))))
        print(f"wrote {path}")


def _loadavg() -> tuple[float, float, float]:
    import os

    return os.getloadavg()


if __name__ == "__main__":
    main()
