"""The model split into pipeline stages, with Protocol Models' subspace constraint (docs/algorithms.md §7).

Notable:
- Built by wrapping :class:`locomm.model.llama.LlamaModel`, never by editing it: the
  full model is built from the run's seed (with an untied head: stage 0 holds the
  embedding and the last stage the head, and no two peers can share a tensor), and
  each stage takes its own slice of those modules, so every stage of every replica
  starts from the weights of one unsplit model. Parameter names stay the full
  model's (``layers.5.mlp.w2.weight``), so a stage's state is a subset of the model's.
- Stage 0 computes ``h0 = E_learn[tok] + E_f[tok]`` with a fixed random E_f from the
  run's seed. A stage hands the next one h (B, T, d); on the wire the role-aware codec
  (``compression.activation = "subspace+lossless"``) sends ``z = U^T (h - E_f[tok])`` and
  the receiver rebuilds ``h = U z + E_f[tok]``; the gradient goes back as ``U^T dL/dh``
  (``compression.act_gradient``) and is rebuilt as ``U U^T dL/dh``, which is exactly
  autograd through the map z(h): k numbers per token each way.
- :meth:`StageModule.project_` keeps the invariant after every optimizer step:
  ``W_o``, ``W_2`` and ``E_learn`` are projected onto span(U), except in the last
  stage's final two layers (they write into nothing that is sent), as node0 does.
- ``pipeline.subspace_form = "reparam"``: W = U U^T W' for the same writes; a hook projects each one's gradient
  before it is accumulated, so the optimizer's moments, the clipping norm and the replica sync see only what
  can move W (with "project" the optimizer sees the whole gradient, and the part outside span(U) is thrown away
  after the step). Both keep ``h - E_f[tok]`` in span(U) exactly.
- ``pipeline.branch_norm``: node0's block form ``h + rms(f(norm(h)))`` with a gain-free RMSNorm on each branch;
  ``pipeline.fixed_embed_std``: E_f's std, part of the geometry every stage and the codec share.
- :class:`ConstrainedModel` is the unsplit reference: the same modules, the same
  constraint, and the same boundary map at the same layers, in one module. A split run
  in one process gives its loss and gradients (tests/unit/test_pipeline.py).
- With ``subspace=False`` the boundary carries h itself (d numbers per token) and
  nothing is projected: the uncompressed pipeline that the compressed one is compared with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from locomm.config import RunSpec
from locomm.model.llama import LlamaModel, rms_norm
from locomm.model.subspace import make_basis, make_fixed_embedding, project_onto_subspace_

FIXED_EMBED_STD = 1.0
"""``pipeline.fixed_embed_std``'s default: the standard deviation of E_f (the stages and the boundary codec
both take the run's value from :class:`Geometry`)."""


def stage_layers(n_layers: int, stages: int, layers: tuple[int, ...] = ()) -> list[range]:
    """The block indices of each stage: ``layers`` per stage, or an even split (earlier stages take the extra)."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"need 1 <= stages <= n_layers, got {stages} stages for {n_layers} layers")
    counts = list(layers) or [n_layers // stages + (1 if s < n_layers % stages else 0) for s in range(stages)]
    if len(counts) != stages or sum(counts) != n_layers or min(counts) < 1:
        raise ValueError(f"layers {counts} do not split {n_layers} layers into {stages} stages")
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


@dataclass(frozen=True)
class Geometry:
    """What every stage of a run agrees on: the split, U, E_f and whether the constraint is on."""

    stages: int
    ranges: tuple[range, ...]
    d: int
    k: int
    vocab_size: int
    seed: int
    subspace: bool
    free_tail: int = -1
    """Blocks at the end of the last stage left unconstrained; -1: all of them."""
    fixed_std: float = FIXED_EMBED_STD
    """Standard deviation of E_f (``pipeline.fixed_embed_std``); the codec must use the same."""
    branch_norm: bool = False
    """A non-trainable RMSNorm on each branch output before the residual add (``pipeline.branch_norm``)."""
    form: str = "project"
    """'project' or 'reparam' (``pipeline.subspace_form``): whether the optimizer sees projected gradients."""

    @classmethod
    def of(cls, spec: RunSpec, *, stages: int | None = None, subspace: bool | None = None) -> Geometry:
        p = spec.pipeline
        n = p.stages if stages is None else stages
        ranges = stage_layers(spec.model.n_layers, n, p.layers if stages is None else ())
        d = spec.model.d_model
        sub = p.subspace if subspace is None else subspace
        return cls(
            stages=n,
            ranges=tuple(ranges),
            d=d,
            k=max(1, d // spec.compression.subspace_rate),
            vocab_size=spec.model.vocab_size,
            seed=spec.train.seed,
            subspace=sub,
            free_tail=p.free_tail_layers,
            fixed_std=p.fixed_embed_std,
            branch_norm=sub if p.branch_norm is None else p.branch_norm,
            form=p.subspace_form,
        )

    @property
    def U(self) -> torch.Tensor:  # (d, k)
        return make_basis(self.d, self.k, self.seed)

    @property
    def E_f(self) -> torch.Tensor:  # (V, d)
        return make_fixed_embedding(self.vocab_size, self.d, self.seed, self.fixed_std)

    def free_layers(self) -> set[int]:
        """Blocks left unconstrained: the last stage's final ``free_tail`` (-1 or more than it has: all)."""
        last = self.ranges[-1]
        if self.free_tail < 0:
            return set(last)
        return set(range(max(last.start, last.stop - self.free_tail), last.stop))


def build_full(spec: RunSpec) -> LlamaModel:
    """The unsplit model every stage slices, from the run's seed; the head is untied from the embedding."""
    cfg = dataclasses.replace(spec.model, tie_embeddings=False)
    return LlamaModel(cfg, seed=spec.train.seed)


class StageModule(nn.Module):
    """One stage: blocks ``ranges[s]``; stage 0 also the embedding (and E_f), the last also norm + head.

    ``forward(tokens, h)``: ``h`` is None at stage 0, else the residual stream (B, T, d) from the
    previous stage. Returns the residual stream for the next stage, or at the last stage the
    logits (B, T, V).
    """

    def __init__(self, geo: Geometry, stage: int, full: LlamaModel) -> None:
        super().__init__()
        if not 0 <= stage < geo.stages:
            raise ValueError(f"stage {stage} is not in [0, {geo.stages})")
        self.geo, self.stage = geo, stage
        self.first, self.last = stage == 0, stage == geo.stages - 1
        self.layer_ids = list(geo.ranges[stage])
        self.embed = full.embed if self.first else None
        self.layers = nn.ModuleDict({str(i): full.layers[i] for i in self.layer_ids})
        self.norm = full.norm if self.last else None
        self.head = full.head if self.last else None
        self.register_buffer("rope_cos", full.rope_cos, persistent=False)
        self.register_buffer("rope_sin", full.rope_sin, persistent=False)
        self.register_buffer("U", geo.U.clone(), persistent=False)
        self.register_buffer("E_f", geo.E_f.clone(), persistent=False)
        self.max_seq_len = full.cfg.max_seq_len
        self.norm_eps = full.cfg.norm_eps
        self.checkpointing = False
        """Recompute each block in backward (a memory plan's choice, as ``LlamaModel.checkpointing``)."""
        if geo.subspace and geo.form == "reparam":
            self._reparameterise()

    # -- the boundary map ----------------------------------------------------------------

    def encode_boundary(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """z = U^T (h - E_f[tok]) (B, T, k); h itself without the subspace."""
        if not self.geo.subspace:
            return h
        return (h - self.E_f[tokens]) @ self.U

    def decode_boundary(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """h = U z + E_f[tok] (B, T, d)."""
        if not self.geo.subspace:
            return x
        return x @ self.U.T + self.E_f[tokens]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.embed is not None
        h = self.embed(tokens)
        return h + self.E_f[tokens] if self.geo.subspace else h

    # -- forward -------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.max_seq_len}")
        if self.first:
            h = self.embed_tokens(tokens)
        elif h is None:
            raise ValueError(f"stage {self.stage} needs the previous stage's output")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        for i in self.layer_ids:
            blk = self.layers[str(i)]
            if recompute:
                h = checkpoint(self._block, blk, h, cos, sin, use_reentrant=False)
            else:
                h = self._block(blk, h, cos, sin)
        if not self.last:
            return h
        return self.head(self.norm(h))

    def _block(self, blk: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A block; with ``branch_norm`` node0's form ``h + rms(f(norm(h)))``, the branch RMSNorm without a gain
        (a per-token scale, so a write in span(U) stays there)."""
        if not self.geo.branch_norm:
            return blk(h, cos, sin)
        h = h + rms_norm(blk.attn(blk.attn_norm(h), cos, sin), self.norm_eps)
        return h + rms_norm(blk.mlp(blk.mlp_norm(h)), self.norm_eps)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    # -- the constraint ------------------------------------------------------------------

    def constrained(self) -> tuple[list[str], list[str], list[str]]:
        """The modules whose writes must lie in span(U): (W_o, W_2 of the constrained blocks, the embedding)."""
        if not self.geo.subspace:
            return [], [], []
        free = self.geo.free_layers()
        wo = [f"layers.{i}.attn.wo" for i in self.layer_ids if i not in free]
        w2 = [f"layers.{i}.mlp.w2" for i in self.layer_ids if i not in free]
        return wo, w2, (["embed"] if self.first else [])

    def _reparameterise(self) -> None:
        """W = U U^T W' for every constrained write: the gradient of W' is the projected gradient of W.

        Kept as W' in span(U) (:meth:`project_` after each step) with the gradient projected by a hook
        before it is accumulated, which is the same update as the reparameterisation (the part of W' outside
        span(U) never reaches the forward) and keeps the parameter names and shapes. The optimizer's moments,
        the clipping norm and the replica sync then see only the part of the gradient that can move W.
        """
        mods = dict(self.named_modules())
        wo, w2, embed = self.constrained()
        for name in wo + w2:
            mods[name].weight.register_hook(self._project_columns)
        for name in embed:
            mods[name].weight.register_hook(self._project_rows)

    def _project_columns(self, g: torch.Tensor) -> torch.Tensor:  # (d, in): U U^T g
        u = self.U.to(g.dtype)
        return u @ (u.T @ g)

    def _project_rows(self, g: torch.Tensor) -> torch.Tensor:  # (V, d): g U U^T
        u = self.U.to(g.dtype)
        return (g @ u) @ u.T

    @torch.no_grad()
    def project_(self) -> list[str]:
        """Project this stage's writes into the residual stream onto span(U) (no-op without the subspace)."""
        if not self.geo.subspace:
            return []
        wo, w2, _ = self.constrained()
        if not wo and not self.first:
            return []
        return project_onto_subspace_(
            self, self.U, wo_pattern=wo or "-", w2_pattern=w2 or "-", embed_name="embed" if self.first else None
        )

    def residual_norm(self, h: torch.Tensor, tokens: torch.Tensor) -> float:
        """Relative norm of h - E_f[tok] outside span(U): 0 while the invariant holds."""
        v = h.detach().float() - self.E_f[tokens]
        off = v - (v @ self.U) @ self.U.T
        return float(off.norm() / v.norm().clamp_min(1e-30))


def build_stages(spec: RunSpec, geo: Geometry | None = None) -> list[StageModule]:
    """Every stage of one replica, sliced from one unsplit model and projected once."""
    geo = geo or Geometry.of(spec)
    full = build_full(spec)
    stages = [StageModule(geo, s, full) for s in range(geo.stages)]
    for st in stages:
        st.project_()
    return stages


def build_stage(spec: RunSpec, stage: int, geo: Geometry | None = None) -> StageModule:
    """One stage (a peer serving it builds only what it needs after init; init itself is of the full model)."""
    return build_stages(spec, geo)[stage]


class ConstrainedModel(nn.Module):
    """The unsplit reference: the stages of one replica run back to back in one module.

    Its boundary map (encode then decode) is the identity on values while the invariant holds and
    projects the gradient onto span(U), exactly what a split run does across the wire.
    """

    def __init__(self, stages: list[StageModule]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = None
        for st in self.stages:
            if h is not None:  # the wire's map: z = U^T (h - E_f[tok]), then h = U z + E_f[tok]
                h = st.decode_boundary(st.encode_boundary(h, tokens), tokens)
            h = st(tokens, h)
        if targets is None:
            return h
        return StageModule.loss(h, targets)

    def project_(self) -> None:
        for st in self.stages:
            st.project_()
