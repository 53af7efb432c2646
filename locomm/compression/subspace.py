"""``subspace``: Protocol Models' projection of pipeline activations (docs/algorithms.md §7).

Every peer derives the same fixed objects from a seed, on CPU:

- ``U`` (d x k, orthonormal columns): QR of a seeded Gaussian, computed in
  float64 with the signs of R's diagonal made positive (so the result does not
  depend on the LAPACK's sign convention) and rounded to float32, which hides
  last-bit BLAS differences between machines.
- ``E_f`` (V x d): a fixed random token embedding, N(0, fixed_std^2).

Activations (``kind="activation"``)::

    send  z = U^T (h - E_f[tok])        # k numbers per token
    recv  h = U z + E_f[tok]            # exact while h - E_f[tok] lies in span(U)

Activation gradients (``kind="gradient"``): ``z = U^T g`` and ``g = U z``. For a
boundary tensor that lies in ``E_f[tok] + span(U)`` this is exactly the
gradient through the projection, so backward is compressed by d/k as well.

Token ids: ``encode(h, tokens=tok)`` needs them (shape ``h.shape[:-1]``). With
``include_tokens=True`` (default) they travel in the payload as int32 and
``decode(data)`` needs nothing else; with ``False`` the receiver passes
``decode(data, tokens=tok)`` (pipeline stages usually hold the batch's token
ids already). Payloads carry a fingerprint of (d, k, V, seed, fixed_std) and
decoding with a differently configured codec raises :class:`CodecError`.

:func:`project_onto_subspace_` keeps the invariant: after every optimizer
step, project every write into the residual stream (attention output
projections, MLP down projections, the learned embedding) onto span(U).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from locomm.compression.base import CodecError, PartsCodec, Reader, Writer, check_part, code_dtype, dtype_code, numel_of
from locomm.model.subspace import make_basis, make_fixed_embedding, project_onto_subspace_

__all__ = ["SubspaceCodec", "make_basis", "make_fixed_embedding", "project_onto_subspace_"]


class SubspaceCodec(PartsCodec):
    """Project activations (or their gradients) onto a fixed k-dim subspace.

    Args:
        d: model width.
        vocab_size: V, rows of the fixed embedding.
        k: subspace dimension; or give ``rate`` (k = d // rate). Default d // 32.
        rate: compression factor d / k.
        seed: seed of U and E_f; every peer must use the same one.
        fixed_std: standard deviation of E_f.
        kind: ``"activation"`` (subtract/add E_f[tok]) or ``"gradient"`` (no offset).
        include_tokens: put token ids in the payload.
        impl: ``"auto"`` (the fused Triton kernels for CUDA tensors), ``"cpu"``
            or ``"triton"``. ``decode(..., device=)`` says where h is rebuilt.
    """

    name: ClassVar[str] = "subspace"
    magic: ClassVar[bytes] = b"LCSS"

    def __init__(
        self,
        d: int,
        vocab_size: int,
        k: int | None = None,
        rate: int | None = None,
        seed: int = 0,
        fixed_std: float = 0.02,
        kind: str = "activation",
        include_tokens: bool = True,
        impl: str = "auto",
    ) -> None:
        from locomm.kernels import check_impl

        self.impl = check_impl(impl)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}
        if k is not None and rate is not None:
            raise ValueError("give k or rate, not both")
        if k is None:
            k = max(1, d // (rate or 32))
        if kind not in ("activation", "gradient"):
            raise ValueError(f"kind must be 'activation' or 'gradient', got {kind!r}")
        self.d, self.k, self.vocab_size, self.seed = int(d), int(k), int(vocab_size), int(seed)
        self.fixed_std = float(fixed_std)
        self.kind = kind
        self.include_tokens = include_tokens
        self.U = make_basis(self.d, self.k, self.seed)  # (d, k)
        self.E_f = (
            make_fixed_embedding(self.vocab_size, self.d, self.seed, self.fixed_std) if kind == "activation" else None
        )
        self.fingerprint = zlib.crc32(f"{self.d}/{self.k}/{self.vocab_size}/{self.seed}/{self.fixed_std!r}".encode())

    def __repr__(self) -> str:
        return (
            f"SubspaceCodec(d={self.d}, k={self.k}, vocab_size={self.vocab_size}, seed={self.seed}, kind={self.kind!r})"
        )

    def encode_parts(
        self, x: torch.Tensor, tokens: torch.Tensor | None = None, **context: Any
    ) -> tuple[bytes, list[torch.Tensor]]:
        if not x.is_floating_point() or x.ndim < 1 or x.shape[-1] != self.d:
            raise ValueError(f"expected a float tensor (..., {self.d}), got {x.dtype} {tuple(x.shape)}")
        from locomm.kernels import resolve_impl

        fast = resolve_impl(self.impl, x.device) == "triton"
        h = x.detach() if fast else x.detach().to("cpu", torch.float32)
        w = Writer()
        w.u32(self.fingerprint)
        w.u8(dtype_code(x.dtype))
        w.shape(x.shape)
        if self.kind == "activation":
            tok = self._check_tokens(tokens, x.shape[:-1], ValueError)
            w.u8(1 if self.include_tokens else 0)
            if self.include_tokens:
                w.raw(tok.to(torch.int32).contiguous().numpy().tobytes())
            if not fast:
                h = h - self.E_f[tok]
        else:
            tok = None
            w.u8(0)
        if fast:
            from locomm.kernels import subspace as ks

            U, E_f = self.on_device(h.device)
            z = ks.compress(h, U, E_f, None if tok is None else tok.to(h.device))
        else:
            z = h @ self.U  # (..., k)
        return w.getvalue(), [z.contiguous()]

    def on_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """U and E_f on ``device`` (copied once per device)."""
        if device not in self._on_device:
            self._on_device[device] = (self.U.to(device), None if self.E_f is None else self.E_f.to(device))
        return self._on_device[device]

    def decode_parts(
        self,
        meta: memoryview,
        parts: list[torch.Tensor],
        tokens: torch.Tensor | None = None,
        device: str | torch.device | None = None,
        max_numel: int | None = None,
        **context: Any,
    ) -> torch.Tensor:
        r = Reader(meta)
        if r.u32() != self.fingerprint:
            raise CodecError("subspace payload was made with a different basis (d, k, V, seed or std)")
        dtype = code_dtype(r.u8())
        if not dtype.is_floating_point:
            raise CodecError(f"subspace payload claims non-float dtype {dtype}")
        shape = r.shape(max_numel)
        if len(shape) < 1 or shape[-1] != self.d:
            raise CodecError(f"subspace payload shape {shape} does not end in d={self.d}")
        has_tokens = r.u8()
        if has_tokens not in (0, 1) or (has_tokens and self.kind != "activation"):
            raise CodecError("bad token flag")
        lead = shape[:-1]
        if has_tokens:
            tok = torch.from_numpy(r.array(numel_of(lead), np.int32).astype(np.int64)).reshape(lead)
        r.expect_end()
        z = check_part(parts, 0, (*lead, self.k))
        if len(parts) != 1 or not z.is_floating_point():
            raise CodecError("subspace payload must hold exactly one float part")
        if self.kind == "activation":
            if not has_tokens:
                tok = self._check_tokens(tokens, lead, CodecError)
            elif bool(((tok < 0) | (tok >= self.vocab_size)).any()):
                raise CodecError("token id out of range")
        from locomm.kernels import resolve_impl

        dev = z.device if device is None else torch.device(device)
        if resolve_impl(self.impl, dev) == "triton":
            from locomm.kernels import subspace as ks

            U, E_f = self.on_device(dev)
            tk = tok.to(dev) if self.kind == "activation" else None
            return ks.decompress(z.to(dev), U, E_f, tk, out_dtype=dtype)
        h = z.to("cpu").float() @ self.U.T  # (..., d)
        if self.kind == "activation":
            h = h + self.E_f[tok]
        h = h.to(dtype)
        return h if dev.type == "cpu" else h.to(dev)

    def _check_tokens(self, tokens: torch.Tensor | None, lead: Sequence[int], err: type[Exception]) -> torch.Tensor:
        if tokens is None:
            raise err("the subspace activation codec needs tokens= (token ids, shape h.shape[:-1])")
        tok = torch.as_tensor(tokens).to("cpu", torch.long)
        if tuple(tok.shape) != tuple(lead):
            raise err(f"tokens have shape {tuple(tok.shape)}, expected {tuple(lead)}")
        if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= self.vocab_size):
            raise err(f"token ids must be in [0, {self.vocab_size})")
        return tok

    def residual_norm(self, h: torch.Tensor, tokens: torch.Tensor | None = None) -> float:
        """Relative norm of the part of ``h - E_f[tok]`` outside span(U) (0 when exact)."""
        v = h.detach().float()
        if self.kind == "activation":
            v = v - self.E_f[self._check_tokens(tokens, h.shape[:-1], ValueError)]
        off = v - (v @ self.U) @ self.U.T
        return float(off.norm() / v.norm().clamp_min(1e-30))
