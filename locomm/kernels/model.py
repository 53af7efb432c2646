"""Fused Triton kernels for the model's step, with autograd, and an opt-in switch.

Profiling an eager step (benchmarks/kernels.py, ``--profile``) shows that past
the matmuls (cuBLAS already) and attention (SDPA's flash kernels) the time goes
to memory-bound chains of small ops, each a kernel launch and a round trip
through memory:

- RMSNorm (in fp32) and the residual add before it: :func:`add_rmsnorm`
  reads x and the branch output once and writes the new residual stream and
  the normalized activations (fwd), and one kernel does the backward;
- SwiGLU's ``silu(gate) * up``: :func:`swiglu`, one elementwise pass each way;
- cross-entropy over the byte vocabulary (V = 256 fits one block): :func:`cross_entropy`
  computes the loss and the logits' gradient in one pass (the backward only
  scales it), so the (N, V) softmax is never materialized twice.

:func:`fuse_` switches a :class:`~locomm.model.llama.LlamaModel` instance to
these kernels (instance attributes only: the eager path stays the default and
the CPU path is untouched). Every kernel is tested against its eager reference
under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ELEM_BLOCK = 1024


@triton.jit
def _rms_fwd_kernel(x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, rstd_ptr, d, eps, HAS_R: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    m = cols < d
    x = tl.load(x_ptr + row * d + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_R:
        x += tl.load(r_ptr + row * d + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(s_ptr + row * d + cols, x.to(s_ptr.dtype.element_ty), mask=m)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32) * w  # as eager: normalize, cast, scale
    tl.store(y_ptr + row * d + cols, y.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_bwd_kernel(dy_ptr, s_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, d, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    m = cols < d
    dy = tl.load(dy_ptr + row * d + cols, mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + row * d + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    sh = s * rstd
    g = dy * w
    dx = rstd * (g - sh * (tl.sum(g * sh, axis=0) / d))
    tl.store(dx_ptr + row * d + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
    tl.store(dw_ptr + row * d + cols, dy * sh, mask=m)  # summed over rows by the caller


def _rms_fwd(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float):
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    n = x2.shape[0]
    s = torch.empty_like(x2) if r is not None else x2
    r2 = r.reshape(-1, d).contiguous() if r is not None else x2
    y = torch.empty_like(x2)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        _rms_fwd_kernel[(n,)](x2, r2, w, s, y, rstd, d, eps, HAS_R=r is not None, BD=triton.next_power_of_2(d))
    return s, y, rstd


def _rms_bwd(dy: torch.Tensor, s: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor):
    n, d = s.shape
    dy2 = dy.reshape(-1, d).contiguous()
    dx = torch.empty_like(s)
    dw_rows = torch.empty(n, d, dtype=torch.float32, device=s.device)
    if n:
        _rms_bwd_kernel[(n,)](dy2, s, w, rstd, dx, dw_rows, d, BD=triton.next_power_of_2(d))
    return dx, dw_rows.sum(0).to(w.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):  # type: ignore[override]
        s, y, rstd = _rms_fwd(x, None, w, eps)
        ctx.save_for_backward(s, w, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        s, w, rstd = ctx.saved_tensors
        dx, dw = _rms_bwd(dy, s, w, rstd)
        return dx.view(dy.shape), dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, r, w, eps):  # type: ignore[override]
        s, y, rstd = _rms_fwd(x, r, w, eps)
        ctx.save_for_backward(s, w, rstd)
        return s.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx, ds, dy):  # type: ignore[override]
        s, w, rstd = ctx.saved_tensors
        dx, dw = _rms_bwd(dy if dy is not None else torch.zeros_like(s), s, w, rstd)
        if ds is not None:
            dx = dx + ds.reshape(dx.shape)
        dx = dx.view(ds.shape if ds is not None else dy.shape)
        return dx, dx, dw, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The eager model's RMSNorm (fp32 statistics, cast, scale), one kernel each way."""
    return _RMSNorm.apply(x, weight, eps)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rmsnorm(s) * weight) with s = x + residual: the residual add fused into the norm."""
    return _AddRMSNorm.apply(x, residual, weight, eps)


@triton.jit
def _swiglu_fwd_kernel(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    silu = (a * tl.sigmoid(a)).to(y_ptr.dtype.element_ty).to(tl.float32)  # eager rounds silu to the dtype
    tl.store(y_ptr + offs, (silu * b).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(a_ptr, b_ptr, dy_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sg = tl.sigmoid(a)
    tl.store(da_ptr + offs, (dy * b * sg * (1.0 + a * (1.0 - sg))).to(da_ptr.dtype.element_ty), mask=m)
    tl.store(db_ptr + offs, (dy * a * sg).to(db_ptr.dtype.element_ty), mask=m)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):  # type: ignore[override]
        a2, b2 = a.contiguous(), b.contiguous()
        y = torch.empty_like(a2)
        n = a2.numel()
        if n:
            _swiglu_fwd_kernel[(triton.cdiv(n, ELEM_BLOCK),)](a2, b2, y, n, BLOCK=ELEM_BLOCK)
        ctx.save_for_backward(a2, b2)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        a, b = ctx.saved_tensors
        da, db = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()
        if n:
            _swiglu_bwd_kernel[(triton.cdiv(n, ELEM_BLOCK),)](a, b, dy.contiguous(), da, db, n, BLOCK=ELEM_BLOCK)
        return da, db


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass each way."""
    return _SwiGLU.apply(gate, up)


@triton.jit
def _ce_kernel(logits_ptr, tgt_ptr, loss_ptr, grad_ptr, v, stride, inv_n, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BV)
    m = cols < v
    x = tl.load(logits_ptr + row * stride + cols, mask=m, other=-float("inf")).to(tl.float32)
    t = tl.load(tgt_ptr + row).to(tl.int32)
    mx = tl.max(x, axis=0)
    ex = tl.where(m, tl.exp(x - mx), 0.0)
    se = tl.sum(ex, axis=0)
    lse = mx + tl.log(se)
    xt = tl.sum(tl.where(cols == t, x, 0.0), axis=0)
    tl.store(loss_ptr + row, lse - xt)
    g = (ex / se - (cols == t).to(tl.float32)) * inv_n
    tl.store(grad_ptr + row * v + cols, g, mask=m)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets):  # type: ignore[override]
        n, v = logits.shape
        x = logits if logits.stride(1) == 1 else logits.contiguous()
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        grad = torch.empty(n, v, dtype=torch.float32, device=logits.device)
        if n:
            _ce_kernel[(n,)](x, targets.contiguous(), loss, grad, v, x.stride(0), 1.0 / n, BV=triton.next_power_of_2(v))
        ctx.save_for_backward(grad)
        ctx.dtype = logits.dtype
        return loss.mean()

    @staticmethod
    def backward(ctx, dloss):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return (grad * dloss).to(ctx.dtype), None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (N, V) logits (computed in fp32) against (N,) targets, grad in one pass."""
    return _CrossEntropy.apply(logits, targets)


# ------------------------------------------------------------------ the opt-in switch


def _block_forward(self, x, cos, sin):  # type: ignore[no-untyped-def]
    n1 = rmsnorm(x, self.attn_norm.weight, self.attn_norm.eps)
    h, n2 = add_rmsnorm(x, self.attn(n1, cos, sin), self.mlp_norm.weight, self.mlp_norm.eps)
    return h + self.mlp(n2)


def _mlp_forward(self, x):  # type: ignore[no-untyped-def]
    return self.w2(swiglu(self.w1(x), self.w3(x)))


def _norm_forward(self, x):  # type: ignore[no-untyped-def]
    return rmsnorm(x, self.weight, self.eps)


def _model_forward(self, tokens, targets=None):  # type: ignore[no-untyped-def]
    logits = self.head(self.forward_hidden(tokens))
    if targets is None:
        return logits
    return cross_entropy(logits.flatten(0, 1), targets.flatten())


def fuse_(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a LlamaModel instance to the fused kernels, in place (its class is untouched).

    Only for models on CUDA (or under ``TRITON_INTERPRET=1``); the weights and
    their names do not change, so checkpoints and codecs see the same model.
    """
    for layer in model.layers:  # type: ignore[attr-defined]
        layer.forward = types.MethodType(_block_forward, layer)
        layer.mlp.forward = types.MethodType(_mlp_forward, layer.mlp)
    model.norm.forward = types.MethodType(_norm_forward, model.norm)  # type: ignore[attr-defined]
    model.forward = types.MethodType(_model_forward, model)
    return model


def reference_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The eager model's loss, for tests and benchmarks."""
    return F.cross_entropy(logits.float(), targets)


__all__ = ["add_rmsnorm", "cross_entropy", "fuse_", "reference_cross_entropy", "rmsnorm", "swiglu"]
