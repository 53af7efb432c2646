"""Compile every kernel for a CUDA target without a GPU: ``python -m locomm.kernels.compile_check [80 90]``.

The interpreter tests check what the kernels compute; this checks that the
real compiler takes them (types, shapes, inline assembly) down to a cubin, for
each compute capability given (default 80 and 90). It must run with
``TRITON_INTERPRET`` unset, since interpreted kernels cannot be compiled.
Exit status 1 when a kernel fails.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any


def kernels() -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    """(kernel, pointer/scalar types by name, constexprs by name); other arguments are i64."""
    from locomm.kernels import crc32 as kc
    from locomm.kernels import lossless as kl
    from locomm.kernels import model as km
    from locomm.kernels import subspace as ks
    from locomm.kernels import topk2bit as kt

    i64 = "*i64"
    chunk = dict(c_first_ptr=i64, c_n_ptr=i64, c_lanes_ptr=i64, c_lane0_ptr=i64)
    return [
        (kl._hist_kernel, dict(words_ptr="*i16", hist_ptr="*i32"), dict(S=7, WORD_MASK=0xFFFF, BLOCK=kl.HIST_BLOCK)),
        (
            kl._lane_bits_kernel,
            dict(words_ptr="*i16", len_ptr="*i32", bits_ptr=i64, **chunk),
            dict(S=7, WORD_MASK=0xFFFF, BLOCK_L=kl.LANE_BLOCK),
        ),
        (
            kl._pack_kernel,
            dict(words_ptr="*i16", code_ptr="*i32", len_ptr="*i32", out_ptr="*u8", lane_pos_ptr=i64, **chunk),
            dict(S=7, WORD_MASK=0xFFFF, BLOCK_L=kl.LANE_BLOCK),
        ),
        (
            kl._split_kernel,
            dict(words_ptr="*i32", out_ptr="*u8", raw_pos_ptr=i64, sym_pos_ptr=i64),
            dict(S=23, WORD_MASK=0xFFFFFFFF, NRAW=3, BLOCK=kl.ELEM_BLOCK),
        ),
        (
            kl._unpack_kernel,
            dict(
                buf_ptr="*u8",
                dec_ptr="*i32",
                out_ptr="*i16",
                lane_start_ptr=i64,
                lane_end_ptr=i64,
                err_ptr="*i32",
                c_raw_ptr=i64,
                **chunk,
            ),
            dict(S=7, NRAW=1, BLOCK_L=kl.LANE_BLOCK),
        ),
        (
            kt._select_kernel,
            dict(x_ptr="*fp32", e_ptr="*fp32", idx_ptr="*i32", sel_ptr="*fp32", beta="fp32"),
            dict(K=2, EF=True, NO_FMA=True, CHUNKS_=kt.CHUNKS),
        ),
        (
            kt._pack_kernel,
            dict(idx_ptr="*i32", sel_ptr="*fp32", e_ptr="*fp32", out_ptr="*u8", lo="fp32", hi="fp32", thr="fp32"),
            dict(USE_HI=True, K=2, EF=True, BLOCK=kt.PACK_BLOCK),
        ),
        (
            ks._compress_kernel,
            dict(h_ptr="*bf16", tok_ptr=i64, ef_ptr="*fp32", u_ptr="*fp32", z_ptr="*fp32"),
            dict(HAS_EF=True, BM=ks.BLOCK_M, BD=ks.BLOCK_D, BK=32),
        ),
        (
            ks._decompress_kernel,
            dict(z_ptr="*fp32", tok_ptr=i64, ef_ptr="*fp32", u_ptr="*fp32", h_ptr="*bf16"),
            dict(HAS_EF=True, BM=ks.BLOCK_M, BD=ks.BLOCK_D, BK=32),
        ),
        (ks._project_rows_kernel, dict(x_ptr="*fp32", u_ptr="*fp32"), dict(BM=ks.BLOCK_M, BD=ks.BLOCK_D, BK=32)),
        (
            km._rms_fwd_kernel,
            dict(
                x_ptr="*fp32", r_ptr="*fp32", w_ptr="*fp32", s_ptr="*fp32", y_ptr="*bf16", rstd_ptr="*fp32", eps="fp32"
            ),
            dict(HAS_R=True, BD=1024),
        ),
        (
            km._rms_bwd_kernel,
            dict(dy_ptr="*bf16", s_ptr="*fp32", w_ptr="*fp32", rstd_ptr="*fp32", dx_ptr="*fp32", dw_ptr="*fp32"),
            dict(BD=1024),
        ),
        (km._swiglu_fwd_kernel, dict(a_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16"), dict(BLOCK=km.ELEM_BLOCK)),
        (
            km._swiglu_bwd_kernel,
            dict(a_ptr="*bf16", b_ptr="*bf16", dy_ptr="*bf16", da_ptr="*bf16", db_ptr="*bf16"),
            dict(BLOCK=km.ELEM_BLOCK),
        ),
        (kc._block_kernel, dict(data_ptr="*u8", table_ptr=i64, reg_ptr=i64), dict(BLOCK_BYTES=1024, LANES=128)),
        (kc._fold_kernel, dict(reg_ptr=i64, mat_ptr=i64, out_ptr=i64), dict(BLOCK=kc.FOLD_BLOCK)),
        (
            km._ce_kernel,
            dict(logits_ptr="*bf16", tgt_ptr=i64, loss_ptr="*fp32", grad_ptr="*fp32", inv_n="fp32"),
            dict(BV=256),
        ),
    ]


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = 0
    for cc in [int(a) for a in argv] or [80, 90]:
        target = GPUTarget("cuda", cc, 32)
        for fn, types, consts in kernels():
            params = list(inspect.signature(fn.fn).parameters)
            sig = {p: "constexpr" if p in consts else types.get(p, "i64") for p in params}
            src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(p),): v for p, v in consts.items()})
            try:
                triton.compile(src, target=target)
                print(f"sm_{cc} {fn.__name__}: ok")
            except Exception as e:  # report every kernel, then fail
                failed += 1
                print(f"sm_{cc} {fn.__name__}: {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
