"""The pipeline's subspace options: E_f's std, node0's branch norm, the reparameterised form (issue 19 item 5)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from locomm.compression.boundary import BoundaryCoder
from locomm.compression.choice import TensorRole, codec_choice
from locomm.config import ConfigError, RunSpec
from locomm.model.stages import FIXED_EMBED_STD, Geometry, build_stages
from locomm.train.stage import StageWorker


def _spec(**pipeline: object) -> RunSpec:
    spec = RunSpec.preset("nano").replace("data", batch_size=4, seq_len=16)
    return spec.replace("pipeline", stages=2, micro_batch_size=2, free_tail_layers=0, **pipeline)


def _batch(spec: RunSpec, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, spec.model.vocab_size, (2, 16), generator=g)
    return x, torch.randint(0, spec.model.vocab_size, (2, 16), generator=g)


def _train(spec: RunSpec, steps: int = 3) -> tuple[list[StageWorker], torch.Tensor]:
    geo = Geometry.of(spec)
    w = [StageWorker(spec, s, geo=geo, module=m) for s, m in enumerate(build_stages(spec, geo))]
    for step in range(steps):
        for mb in range(w[0].micro_per_step):
            x, y = _batch(spec, step * 10 + mb)
            h = w[0].forward(mb, x)
            _, g = w[1].forward_backward(x, y, h)
            w[0].backward(mb, g)
        for wk in w:
            assert wk.maybe_step()
    return w, _batch(spec, 99)[0]


def test_fixed_std_reaches_geometry_and_stages() -> None:
    spec = _spec()
    geo = Geometry.of(spec)
    assert geo.fixed_std == spec.pipeline.fixed_embed_std == FIXED_EMBED_STD == 1.0
    assert abs(float(geo.E_f.std()) - 1.0) < 0.02
    for st in build_stages(spec, geo):
        assert torch.equal(st.E_f, geo.E_f)
    first = BoundaryCoder(spec, geo).act
    assert getattr(first, "codecs", [first])[0].fixed_std == geo.fixed_std
    # Another std reaches the boundary codec too, so the wire rebuilds h with the stages' own E_f.
    other = Geometry.of(_spec(fixed_embed_std=0.02))
    assert other.fixed_std == 0.02
    assert getattr(BoundaryCoder(_spec(fixed_embed_std=0.02), other).act, "codecs", [None])[0].fixed_std == 0.02


def test_codec_built_with_the_geometry_std_rebuilds_the_stage_boundary() -> None:
    """A subspace codec with the geometry's std carries exactly the stage's own boundary map."""
    spec = _spec()
    geo = dataclasses.replace(Geometry.of(spec), fixed_std=0.02)
    s0 = build_stages(spec, geo)[0]
    ch = codec_choice(TensorRole.ACTIVATION, spec.compression, boundary=geo)
    codec = ch.build(subspace={**ch.options["subspace"], "fixed_std": geo.fixed_std})
    x, _ = _batch(spec)
    with torch.no_grad():
        h = s0(x)
    back = codec.decode(codec.encode(h, tokens=x), tokens=x)
    assert torch.allclose(back, s0.decode_boundary(s0.encode_boundary(h, x), x), atol=1e-5)
    assert torch.allclose(back, h, atol=1e-4)


def test_boundary_coder_uses_the_geometry_std() -> None:
    spec = _spec()
    geo = dataclasses.replace(Geometry.of(spec), fixed_std=0.5)
    first = BoundaryCoder(spec, geo).act
    assert getattr(first, "codecs", [first])[0].fixed_std == geo.fixed_std


def test_branch_norm_adds_no_parameters_and_normalises_each_write() -> None:
    assert Geometry.of(_spec()).branch_norm and not Geometry.of(_spec(subspace=False)).branch_norm  # None: follows
    plain, normed = build_stages(_spec(branch_norm=False)), build_stages(_spec(branch_norm=True))
    for a, b in zip(plain, normed, strict=True):
        assert [(n, p.shape) for n, p in a.named_parameters()] == [(n, p.shape) for n, p in b.named_parameters()]
    st = normed[0]
    x, _ = _batch(_spec())
    h = st.embed_tokens(x)
    blk = st.layers["0"]
    cos, sin = st.rope_cos[:16], st.rope_sin[:16]
    out = st._block(blk, h, cos, sin)
    mid = h + _unit(blk.attn(blk.attn_norm(h), cos, sin))
    assert torch.allclose(out - mid, _unit(blk.mlp(blk.mlp_norm(mid))), atol=1e-5)
    assert not torch.allclose(out, plain[0]._block(plain[0].layers["0"], h, cos, sin))


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()


@pytest.mark.parametrize("branch_norm", [False, True])
@pytest.mark.parametrize("form", ["project", "reparam"])
def test_forms_keep_the_invariant(form: str, branch_norm: bool) -> None:
    w, x = _train(_spec(subspace_form=form, branch_norm=branch_norm))
    with torch.no_grad():
        h = w[0].module(x)
    assert w[0].module.residual_norm(h, x) < 1e-5


def test_reparam_hands_the_optimizer_projected_gradients() -> None:
    spec = _spec(subspace_form="reparam")
    geo = Geometry.of(spec)
    s0 = build_stages(spec, geo)[0]
    x, y = _batch(spec)
    s0(x).square().mean().backward()
    U = geo.U
    for name in ("layers.0.attn.wo.weight", "layers.0.mlp.w2.weight"):
        g = dict(s0.named_parameters())[name].grad
        assert torch.allclose(U @ (U.T @ g), g, atol=1e-7)
    g = s0.embed.weight.grad
    assert torch.allclose(g @ U @ U.T, g, atol=1e-7)
    # The projected form sees the whole gradient, outside span(U) too.
    p0 = build_stages(_spec())[0]
    p0(x).square().mean().backward()
    g = p0.layers["0"].attn.wo.weight.grad
    assert float((g - U @ (U.T @ g)).norm()) > 1e-3 * float(g.norm())


@pytest.mark.parametrize(
    "bad",
    [
        {"fixed_embed_std": 0.0},
        {"fixed_embed_std": -1.0},
        {"fixed_embed_std": math.nan},
        {"fixed_embed_std": math.inf},
        {"subspace_form": "projected"},
        {"branch_norm": 1},
        {"branch_norm": "yes"},
    ],
)
def test_bad_values_raise_config_error(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        _spec(**bad)
