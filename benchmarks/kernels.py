"""GB/s of every Triton kernel against the CPU/eager code it replaces, and the step time.

    python benchmarks/kernels.py                 # a GPU if there is one, else the CPU
    python benchmarks/kernels.py --size-mb 256   # the lossless figure the issue asks for (GPU)

On a GPU: lossless encode/decode of bf16 N(0, 0.02) (Triton vs the numba
codec), topk2bit encode, subspace compress/decompress (fused kernels vs eager
torch), the fused model ops, the training step on the ``small`` preset with
fused kernels vs eager, and the device-to-host copies made while coding a CUDA
tensor (only the finished payload should cross). Without a GPU the Triton
kernels run under TRITON_INTERPRET=1 for correctness only (the interpreter's
speed means nothing), and the CPU codecs and the eager step are timed.
Results go to benchmarks/results/kernels_<device>.json.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import _harness

GPU = torch.cuda.is_available()
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

from locomm.compression.lossless import LosslessCodec  # noqa: E402
from locomm.compression.subspace import SubspaceCodec  # noqa: E402
from locomm.compression.topk2bit import TopK2BitCodec  # noqa: E402


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


# On a GPU, wall-clock time. On the CPU, this process's CPU time: the development machine is
# shared, and wall-clock there measures the neighbours as much as the code.
CLOCK = time.perf_counter if GPU else time.process_time


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    out = fn()  # warm-up (compiles)
    sync()
    t = CLOCK()
    for _ in range(repeats):
        out = fn()
    sync()
    return (CLOCK() - t) / repeats, out


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_lossless(n: int, dev: str, repeats: int, rows: list[dict]) -> None:
    x = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    cpu = LosslessCodec(impl="cpu")
    t_enc, data = timed(lambda: cpu.encode(x), repeats)
    t_dec, y = timed(lambda: cpu.decode(data), repeats)
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))
    rows.append(
        dict(
            kernel="lossless",
            impl="cpu (numba)",
            mb=x.numel() * 2 / 1e6,
            ratio=x.numel() * 2 / len(data),
            encode_gbps=gbps(x.numel() * 2, t_enc),
            decode_gbps=gbps(x.numel() * 2, t_dec),
        )
    )
    v1 = LosslessCodec(layout="lanes")
    t1e, d1 = timed(lambda: v1.encode(x), repeats)
    t1d, _ = timed(lambda: v1.decode(d1), repeats)
    rows.append(
        dict(
            kernel="lossless v1 (4 lanes)",
            impl="cpu (numba)",
            mb=x.numel() * 2 / 1e6,
            ratio=x.numel() * 2 / len(d1),
            encode_gbps=gbps(x.numel() * 2, t1e),
            decode_gbps=gbps(x.numel() * 2, t1d),
        )
    )
    if GPU:
        xg = x.to(dev)
        tri = LosslessCodec(impl="triton")
        te, dg = timed(lambda: tri.encode(xg), repeats)
        td, yg = timed(lambda: tri.decode(dg, device=dev), repeats)
        assert dg == data and torch.equal(yg.view(torch.int16).cpu(), x.view(torch.int16))
        from locomm.compression import lossless_device as kl

        # on the device alone: no upload or download of the payload (the network would hand it over)
        tde, _ = timed(lambda: kl.encode_device(tri, xg), repeats)
        parsed = tri.parse(dg, check_crc=False)
        buf = torch.frombuffer(bytearray(dg), dtype=torch.uint8).to(dev)
        tdd, _ = timed(lambda: kl.decode(parsed, torch.device(dev), buf=buf), repeats)
        rows.append(
            dict(
                kernel="lossless",
                impl="triton",
                mb=x.numel() * 2 / 1e6,
                ratio=x.numel() * 2 / len(dg),
                encode_gbps=gbps(x.numel() * 2, te),
                decode_gbps=gbps(x.numel() * 2, td),
                encode_on_device_gbps=gbps(x.numel() * 2, tde),
                decode_on_device_gbps=gbps(x.numel() * 2, tdd),
                same_bytes_as_cpu=True,
                d2h_copies=d2h_copies(lambda: tri.encode(xg)),
            )
        )


def d2h_copies(fn: Callable[[], Any]) -> dict[str, Any]:
    """The device-to-host copies ``fn`` makes: should be the histograms, the lane sizes and the payload."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
        sync()
    events = prof.events()
    return dict(
        memcpy_dtoh=sum("Memcpy DtoH" in e.name for e in events),
        to_cpu_shapes=[e.input_shapes[0] if e.input_shapes else None for e in events if e.name == "aten::_to_copy"][
            :16
        ],
    )


def bench_topk(n: int, dev: str, repeats: int, rows: list[dict]) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    cpu = TopK2BitCodec(k=2, error_feedback=False, impl="cpu")
    t, ref = timed(lambda: cpu.encode(x), repeats)
    rows.append(dict(kernel="topk2bit encode", impl="cpu (torch)", mb=n * 4 / 1e6, encode_gbps=gbps(n * 4, t)))
    if GPU:
        tri = TopK2BitCodec(k=2, error_feedback=False, impl="triton")
        xg = x.to(dev)
        t, out = timed(lambda: tri.encode(xg), repeats)
        rows.append(
            dict(
                kernel="topk2bit encode",
                impl="triton",
                mb=n * 4 / 1e6,
                encode_gbps=gbps(n * 4, t),
                same_bytes_as_cpu=out == ref,
            )
        )


def bench_subspace(tokens: int, d: int, dev: str, repeats: int, rows: list[dict]) -> None:
    codec = SubspaceCodec(d=d, vocab_size=256, rate=32)
    g = torch.Generator().manual_seed(2)
    tok = torch.randint(0, 256, (tokens,), generator=g)
    h = (torch.randn(tokens, d, generator=g) * 0.1 + codec.E_f[tok]).bfloat16()
    devs = ["cpu"] + ([dev] if GPU else [])
    for dv in devs:
        U, E = codec.U.to(dv), codec.E_f.to(dv)
        hd, td = h.to(dv), tok.to(dv)
        te, z = timed(lambda: (hd.float() - E[td]) @ U, repeats)
        tr, _ = timed(lambda: (z @ U.T + E[td]).bfloat16(), repeats)
        rows.append(
            dict(
                kernel="subspace",
                impl=f"eager torch ({dv})",
                mb=h.numel() * 2 / 1e6,
                compress_gbps=gbps(h.numel() * 2, te),
                decompress_gbps=gbps(h.numel() * 2, tr),
            )
        )
        if dv != "cpu":
            from locomm.kernels import subspace as ks

            tk, zk = timed(lambda: ks.compress(hd, U, E, td), repeats)
            tkr, hk = timed(lambda: ks.decompress(zk, U, E, td, out_dtype=torch.bfloat16), repeats)
            rows.append(
                dict(
                    kernel="subspace",
                    impl="triton",
                    mb=h.numel() * 2 / 1e6,
                    compress_gbps=gbps(h.numel() * 2, tk),
                    decompress_gbps=gbps(h.numel() * 2, tkr),
                    speedup_compress=te / tk,
                    speedup_decompress=tr / tkr,
                    max_abs_err_z=float((zk - z).abs().max()),
                )
            )


def bench_step(preset: str, dev: str, repeats: int, rows: list[dict]) -> None:
    from locomm.config import RunSpec
    from locomm.kernels import model as km
    from locomm.model import build_model

    spec = RunSpec.preset(preset)
    b, t = spec.data.batch_size, spec.data.seq_len
    if not GPU:
        b, t = min(b, 4), min(t, 128)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (b, t), generator=g).to(dev)
    y = torch.randint(0, 256, (b, t), generator=g).to(dev)
    variants = [("eager", build_model(spec.model, device=dev))]
    if GPU:
        variants.append(("fused triton", km.fuse_(build_model(spec.model, device=dev))))
    for name, model in variants:

        def step() -> float:
            ctx = torch.autocast("cuda", dtype=torch.bfloat16) if GPU else torch.autocast("cpu", enabled=False)
            with ctx:
                loss = model(x, y)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return float(loss.detach())

        sec, loss = timed(step, repeats)
        rows.append(dict(kernel=f"train step ({preset}, batch {b}x{t})", impl=name, step_ms=sec * 1e3, loss=loss))


def interpreter_checks(rows: list[dict]) -> None:
    """Correctness of every kernel on small CPU tensors (tests/unit/test_kernels.py runs the full set)."""
    from locomm.kernels import model as km

    x = (torch.randn(3000) * 0.02).bfloat16()
    kw = dict(chunk_elems=1024, lane_syms=32)
    same = LosslessCodec(impl="triton", **kw).encode(x) == LosslessCodec(impl="cpu", **kw).encode(x)
    xs = torch.randn(1000)
    same_tk = TopK2BitCodec(k=2, impl="triton").encode(xs) == TopK2BitCodec(k=2, impl="cpu").encode(xs)
    sc_c, sc_t = (
        SubspaceCodec(d=64, vocab_size=256, k=16, impl="cpu"),
        SubspaceCodec(d=64, vocab_size=256, k=16, impl="triton"),
    )
    tok = torch.randint(0, 256, (40,))
    h = torch.randn(40, 64)
    err = float((sc_c.encode_parts(h, tokens=tok)[1][0] - sc_t.encode_parts(h, tokens=tok)[1][0]).abs().max())
    lg, tg = torch.randn(64, 256), torch.randint(0, 256, (64,))
    ce = abs(float(km.cross_entropy(lg, tg)) - float(torch.nn.functional.cross_entropy(lg, tg)))
    rows.append(
        dict(
            kernel="interpreter correctness",
            lossless_same_bytes=same,
            topk2bit_same_bytes=same_tk,
            subspace_max_abs_err=err,
            cross_entropy_abs_err=ce,
        )
    )


def main() -> None:
    ap = _harness.parser(__doc__, out_help="JSON path (default benchmarks/results/kernels_<device>.json)")
    ap.add_argument("--size-mb", type=float, default=256.0 if GPU else 16.0, help="bf16 tensor size for the codecs")
    ap.add_argument("--repeats", type=int, default=5 if GPU else 2)
    ap.add_argument("--preset", default="small" if GPU else "tiny")
    args = ap.parse_args()
    dev = "cuda" if GPU else "cpu"
    n = int(args.size_mb * 1e6 / 2)
    rows: list[dict] = []
    if not GPU:
        interpreter_checks(rows)
    bench_lossless(n, dev, args.repeats, rows)
    bench_topk(n // 2, dev, args.repeats, rows)
    bench_subspace(8192 if GPU else 1024, 768 if GPU else 256, dev, args.repeats, rows)
    bench_step(args.preset, dev, args.repeats, rows)
    for r in rows:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    meta = dict(
        device=torch.cuda.get_device_name() if GPU else platform.processor() or "cpu",
        torch=torch.__version__,
        python=sys.version.split()[0],
        threads=torch.get_num_threads(),
        interpreter=not GPU,
        size_mb=args.size_mb,
        clock="wall" if GPU else "process CPU time",
    )
    out = _harness.write_json(args.out or _harness.results_path(f"kernels_{dev}.json"), dict(meta=meta, rows=rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
