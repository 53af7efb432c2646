"""The fixed subspace of Protocol Models, shared by the stage model and the ``subspace`` codec.

Every peer derives the same objects from a seed, on CPU: the orthonormal basis ``U`` (d x k) and the
fixed token embedding ``E_f`` (V x d) (see :mod:`locomm.compression.subspace` for how the codec uses
them), and :func:`project_onto_subspace_` keeps the model's invariant: every write into the residual
stream lies in span(U).
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Sequence

import torch
from torch import nn

_EMBED_SEED_OFFSET = 1_000_003


@functools.lru_cache(maxsize=8)
def make_basis(d: int, k: int, seed: int = 0) -> torch.Tensor:
    """The shared orthonormal basis U (d x k, float32) for ``seed``."""
    if not 1 <= k <= d:
        raise ValueError(f"need 1 <= k <= d, got k={k}, d={d}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(d, k, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(k, dtype=torch.float64))
    return q.float().contiguous()


@functools.lru_cache(maxsize=8)
def make_fixed_embedding(vocab_size: int, d: int, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    """The shared fixed token embedding E_f (V x d, float32) for ``seed``."""
    g = torch.Generator(device="cpu").manual_seed(seed + _EMBED_SEED_OFFSET)
    return (torch.randn(vocab_size, d, generator=g, dtype=torch.float64) * std).float().contiguous()


def _match(name: str, patterns: str | Sequence[str]) -> bool:
    pats = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    return any(fnmatch.fnmatchcase(name, p) for p in pats)


@torch.no_grad()
def project_onto_subspace_(
    model: nn.Module,
    U: torch.Tensor,
    wo_pattern: str | Sequence[str] = "*.attn.wo",
    w2_pattern: str | Sequence[str] = "*.mlp.w2",
    embed_name: str | None = "embed",
    impl: str = "auto",
) -> list[str]:
    """Project every learned write into the residual stream onto span(U), in place.

    ``W <- U U^T W`` for the matched output projections (nn.Linear weights are
    (out=d, in); a bias, if any, is projected too) and
    ``E <- E U U^T`` for the learned embedding (nn.Embedding weight (V, d)).
    Call it once after init and after every optimizer step. Note: with tied
    input/output embeddings the output head is projected as well.

    With ``impl`` auto, CUDA weights take the fused Triton kernel
    (:func:`locomm.kernels.subspace.project_rows_`).

    Returns:
        The names of the projected modules.

    Raises:
        ValueError: no module matched the patterns.
    """
    from locomm.kernels import resolve_impl

    done: list[str] = []
    for name, mod in model.named_modules():
        if _match(name, wo_pattern) or _match(name, w2_pattern):
            w = mod.weight
            u = U.to(w.device, torch.float32)
            if resolve_impl(impl, w.device) == "triton" and getattr(mod, "bias", None) is None:
                from locomm.kernels import subspace as ks

                ks.project_rows_(w.t(), u.contiguous())  # columns of W are rows of W^T
                done.append(name)
                continue
            w.copy_((u @ (u.T @ w.float())).to(w.dtype))  # (d, k) @ (k, in)
            if getattr(mod, "bias", None) is not None:
                mod.bias.copy_((u @ (u.T @ mod.bias.float())).to(mod.bias.dtype))
            done.append(name)
        elif embed_name is not None and name == embed_name:
            w = mod.weight
            u = U.to(w.device, torch.float32)
            if resolve_impl(impl, w.device) == "triton":
                from locomm.kernels import subspace as ks

                ks.project_rows_(w, u.contiguous())
                done.append(name)
                continue
            w.copy_(((w.float() @ u) @ u.T).to(w.dtype))  # (V, d) @ (d, k) @ (k, d)
            done.append(name)
    if not done:
        raise ValueError(f"no module matched {wo_pattern!r}, {w2_pattern!r} or {embed_name!r}")
    return done
