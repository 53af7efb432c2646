"""The one codec decision: codec_choice gives each role the stack CompressionConfig names, and PayloadCodec,
BoundaryCoder and SparseLoCo code with exactly what it gives."""

from __future__ import annotations

import pytest
import torch

import locomm.compression as compression
from locomm.compression import CodecChoice, CodecStack, TensorRole, codec_choice
from locomm.compression.boundary import BoundaryCoder
from locomm.compression.payload import MIN_PART_ELEMS, PayloadCodec
from locomm.compression.subspace import SubspaceCodec
from locomm.compression.topk2bit import TopK2BitCodec
from locomm.config import CompressionConfig, OuterConfig, RunSpec
from locomm.model.stages import FIXED_EMBED_STD, Geometry
from locomm.protocol import build_outer
from locomm.protocol.sparseloco import SparseLoCo

pytestmark = pytest.mark.timeout(120)

CONFIGS = [
    CompressionConfig(),
    CompressionConfig(
        parameter="bf16+lossless",
        outer_gradient="topk2bit+lossless",
        activation="bf16+lossless",
        act_gradient="subspace+fp16",
    ),
]
PAYLOAD_ROLES = (TensorRole.PARAMETER, TensorRole.OUTER_GRADIENT)
BOUNDARY_ROLES = (TensorRole.ACTIVATION, TensorRole.ACT_GRADIENT)
SHAPES = {"w": (64, 80), "b": (7,)}


def params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


@pytest.mark.parametrize("comp", CONFIGS)
def test_each_role_gets_the_stack_compression_names(comp: CompressionConfig) -> None:
    for role in (*PAYLOAD_ROLES, *BOUNDARY_ROLES):
        want = getattr(comp, role.value)
        for r in (role, role.value):
            assert codec_choice(r, comp) == CodecChoice(role, want)
            assert codec_choice(r, {role.value: want}).stack == want  # a role -> stack mapping reads the same
        # An outer config changes nothing for an algorithm that does not encode its own payload.
        assert codec_choice(role, comp, outer=OuterConfig(algo="diloco")).stack == want
    defaults = CompressionConfig()
    assert codec_choice(TensorRole.ACTIVATION, defaults).stack == "subspace+lossless"  # not bf16+lossless
    assert codec_choice(TensorRole.TOKENS, comp).stack == "none" and codec_choice("tokens", comp).build() is None
    with pytest.raises(ValueError):
        codec_choice("weights", comp)


def test_dead_role_defaults_are_gone() -> None:
    assert not hasattr(compression, "DEFAULT_ROLE_CODECS")


@pytest.mark.parametrize("subspace", [True, False])
@pytest.mark.parametrize("comp", CONFIGS)
def test_boundary_stacks_and_boundary_coder_agree(comp: CompressionConfig, subspace: bool) -> None:
    spec = RunSpec.preset("nano").replace("pipeline", stages=2)
    spec = spec.replace("compression", **{f: getattr(comp, f) for f in ("activation", "act_gradient")})
    geo = Geometry.of(spec, subspace=subspace)
    coder = BoundaryCoder(spec, geo)
    for role, stack, codec, kind in (
        (TensorRole.ACTIVATION, coder.act_stack, coder.act, "activation"),
        (TensorRole.ACT_GRADIENT, coder.grad_stack, coder.grad, "gradient"),
    ):
        choice = codec_choice(role, spec.compression, boundary=geo)
        assert coder.choices[role] == choice and stack == choice.stack
        names = [n for n in getattr(comp, role.value).split("+") if n != "subspace"]
        assert choice.stack == "+".join(["subspace", *names] if subspace else names)
        first = codec.codecs[0] if isinstance(codec, CodecStack) else codec
        if subspace:
            assert isinstance(first, SubspaceCodec)
            assert (first.d, first.k, first.vocab_size, first.seed) == (geo.d, geo.k, geo.vocab_size, geo.seed)
            assert first.fixed_std == FIXED_EMBED_STD and first.kind == kind and not first.include_tokens
        else:
            assert not isinstance(first, SubspaceCodec)
        # The same bytes as a codec built from the choice alone.
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, spec.model.vocab_size, (2, 5), generator=g)
        h = torch.randn(2, 5, geo.d, generator=g)
        built = choice.build()
        assert built is not None
        assert (coder.encode_activation if kind == "activation" else coder.encode_gradient)(h, tokens) == (
            built.encode(h, tokens=tokens)
        )
    assert coder.choices[TensorRole.TOKENS] == codec_choice(TensorRole.TOKENS, spec.compression, boundary=geo)


@pytest.mark.parametrize("algo", ["noloco", "diloco", "gasloc", "sparseloco"])
@pytest.mark.parametrize("comp", CONFIGS)
def test_payload_codec_and_sparseloco_agree(comp: CompressionConfig, algo: str) -> None:
    outer = OuterConfig(algo=algo)
    a = build_outer(outer, params(), 0)
    codec = PayloadCodec(SHAPES, a.payload_roles, comp, encoded=a.payload_encoded, part_elems=MIN_PART_ELEMS)
    for t in codec.tensors:
        role = a.payload_roles[t.name.split("/", 1)[0]]
        choice = codec_choice(role, comp, outer=outer)
        assert (t.codec, t.encoded) == (choice.stack, choice.encoded)
    if algo != "sparseloco":
        assert all(not t.encoded for t in codec.tensors)


def test_sparseloco_codes_with_the_choice() -> None:
    outer = OuterConfig(algo="sparseloco", sparse_density=0.05, sparse_ef_beta=0.9)
    choice = codec_choice(TensorRole.OUTER_GRADIENT, CompressionConfig(outer_gradient="lossless"), outer=outer)
    assert choice == CodecChoice(TensorRole.OUTER_GRADIENT, "topk2bit", {"density": 0.05, "beta": 0.9}, encoded=True)
    p = params()
    algo = SparseLoCo(outer, {k: v.clone() for k, v in p.items()}, 0)
    assert algo.payload_roles == {"sparse": "outer_gradient"} and algo.payload_encoded == {"sparse": choice.stack}
    for c in algo.codecs.values():
        ref = choice.build()
        assert isinstance(c, TopK2BitCodec) and isinstance(ref, TopK2BitCodec)
        assert (c.k, c.beta, c.error_feedback) == (ref.k, ref.beta, ref.error_feedback)
    moved = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(2)) for k, v in p.items()}
    payload = algo.plan(0, [0, 1], moved).payload
    for k in SHAPES:  # the same bytes as a fresh codec from the choice, on the same pseudo-gradient
        ref = choice.build()
        assert ref is not None
        assert payload[f"sparse/{k}"] == ref.encode(p[k] - moved[k])
