"""PayloadCodec: bytes per role and stack, what a receiver gets, validation, the simulator's counting, and
NoLoCo's theta-only payload against a reference written from its equations."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_rpc import RUN, SENDER, Harness, status  # the fake-stream harness of the service base

from locomm.compression import get_codec
from locomm.compression.payload import MIN_PART_ELEMS, Part, PayloadCodec, PayloadError
from locomm.config import CompressionConfig, OuterConfig
from locomm.protocol import NoLoCo, SparseLoCo
from locomm.protocol.messages import PART_LEN, ErrorCode, ProtocolViolation, pack_frame, push_header, validate_transfer
from locomm.protocol.schedule import group_of, noloco_groups

pytestmark = pytest.mark.timeout(120)

SHAPES = {"emb": (300, 40), "w": (50, 50), "bias": (7,)}
P = sum(math.prod(s) for s in SHAPES.values())


def rand_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * 0.05 for k, s in SHAPES.items()}


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32 if x.element_size() == 4 else torch.int16)


def theta_codec(stack: str, part_elems: int = MIN_PART_ELEMS) -> PayloadCodec:
    return PayloadCodec(SHAPES, {"theta": "parameter"}, CompressionConfig(parameter=stack), part_elems=part_elems)


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(2) as ex:
        yield ex


# ------------------------------------------------------------------------------ 4. bytes per stack

FRAMING_PER_PART = 512
"""Generous bound on a codec's per-part framing (magic, header, chunk table, CRC)."""


@pytest.mark.parametrize("stack,raw_per_elem", [("none", 4), ("lossless", 4), ("bf16", 2), ("bf16+lossless", 2)])
def test_noloco_bytes_per_partner_per_round(stack, raw_per_elem):
    algo = NoLoCo(OuterConfig(algo="noloco", group_size=2), rand_params(0), 0)
    params = rand_params(1)
    ex = algo.plan(0, [0, 1], params)
    codec = PayloadCodec(SHAPES, algo.payload_roles, CompressionConfig(parameter=stack), part_elems=MIN_PART_ELEMS)
    nparts = len(codec.parts())
    assert nparts > len(SHAPES)  # emb spans several parts
    assert codec.raw_bytes() == raw_per_elem * P  # 4P in fp32, 2P in bf16, before lossless coding
    received, nbytes = codec.transmit(ex.payload)
    assert nbytes == codec.coded_bytes(ex.payload)
    if stack == "none":
        assert nbytes == 4 * P  # raw fp32, no framing at all
    elif stack == "bf16":
        assert 2 * P < nbytes <= 2 * P + FRAMING_PER_PART * nparts
    else:  # lossless stages never cost more than the raw size plus framing (and win on weights)
        assert nbytes <= raw_per_elem * P + FRAMING_PER_PART * nparts
        assert nbytes < raw_per_elem * P
    assert set(received) == set(ex.payload)


def test_phi_delta_payload_is_twice_the_theta_payload():
    theta = NoLoCo(OuterConfig(algo="noloco"), rand_params(0), 0)
    both = NoLoCo(OuterConfig(algo="noloco", noloco_gamma=0.3), rand_params(0), 0)
    comp = CompressionConfig(parameter="none", outer_gradient="none")
    ct = PayloadCodec(SHAPES, theta.payload_roles, comp)
    cb = PayloadCodec(SHAPES, both.payload_roles, comp)
    params = rand_params(1)
    assert ct.transmit(theta.plan(0, [0, 1], params).payload)[1] == 4 * P
    assert cb.transmit(both.plan(0, [0, 1], params).payload)[1] == 8 * P


@pytest.mark.parametrize("stack", ["bf16", "bf16+lossless", "fp16+lossless"])
def test_a_cast_stack_gives_the_receiver_the_cast_tensors(stack):
    codec = theta_codec(stack)
    payload = {f"theta/{k}": v for k, v in rand_params(2).items()}
    received, _ = codec.transmit(payload)
    want = torch.bfloat16 if stack.startswith("bf16") else torch.float16
    for k, v in payload.items():
        assert received[k].dtype == want and received[k].shape == v.shape
        assert torch.equal(bits(received[k]), bits(v.to(want))), k  # exactly the cast, nothing more lost


@pytest.mark.parametrize("stack", ["none", "lossless"])
def test_lossless_is_bit_exact(stack):
    codec = theta_codec(stack)
    payload = {f"theta/{k}": v for k, v in rand_params(3).items()}
    payload["theta/w"][0, :4] = torch.tensor([0.0, -0.0, 1e-40, -3.4e38])  # zero signs, a denormal, a huge value
    received, _ = codec.transmit(payload)
    for k, v in payload.items():
        assert received[k].dtype == torch.float32 and torch.equal(bits(received[k]), bits(v)), k


def test_simulator_counts_the_daemons_bytes_and_rounding(nano_spec, nano_splits, pool):
    """One NoLoCo round on 2 workers: the simulator's bytes are the daemon's parts, and what a receiver gets
    through the daemon's push handler (fake stream) is bit for bit what the simulator delivered."""
    from locomm.sim import Simulator

    for stack, per_elem in [("none", 4), ("bf16", 2)]:
        spec = (
            nano_spec.replace("outer", algo="noloco", inner_steps=2, group_size=2)
            .replace("train", steps=2, eval_batches=1)
            .replace("compression", parameter=stack)
        )
        sim = Simulator(spec, 2, splits=nano_splits)
        seen = []
        real = sim.coder.transmit

        def transmit(payload, real=real, seen=seen):
            got, n = real(payload)
            seen.append(({k: (v.clone() if torch.is_tensor(v) else v) for k, v in payload.items()}, got, n))
            return got, n

        sim.coder.transmit = transmit
        res = sim.run(1)
        assert len(seen) == 2
        params = dict(sim.trainers[0].model.named_parameters())
        n_params = sum(p.numel() for p in params.values())
        # The daemon's codec, built as Node._payload_codec builds it.
        daemon = PayloadCodec(
            {k: tuple(p.shape) for k, p in params.items()},
            sim.algos[0].payload_roles,
            spec.compression,
            encoded=sim.algos[0].payload_encoded,
        )
        for w, (payload, _got, n) in enumerate(seen):
            assert set(payload) == {f"theta/{k}" for k in params}
            size = daemon.coded_bytes(payload)
            assert res.bytes_sent[w] == size == n  # one partner per round
            assert res.bytes_received[1 - w] == size
            if stack == "none":
                assert size == 4 * n_params
            else:
                assert 2 * n_params < size <= 2 * n_params + FRAMING_PER_PART * len(daemon.parts())

        async def through_the_daemon(payload):
            h = Harness(pool, codec=daemon, max_body_bytes=1 << 30)
            parts = daemon.parts()
            body = b"".join(PART_LEN.pack(len(d)) + d for d in (daemon.encode_part(payload, p) for p in parts))
            ans = await h.request(pack_frame(push_header(RUN, 0, SENDER, 1, 0, 1, {}, parts)) + body)
            assert status(ans) == ErrorCode.OK
            return h.gossip.mailbox[0][SENDER], h.gossip.stats.bytes_received

        payload, got, n = seen[0]
        mailbox, received = asyncio.run(through_the_daemon(payload))
        assert received == n
        for k in payload:
            assert mailbox[k].dtype == got[k].dtype == (torch.float32 if per_elem == 4 else torch.bfloat16)
            assert torch.equal(bits(mailbox[k]), bits(got[k])), k


# ------------------------------------------------------------------------------ encoded values (SparseLoCo)


SPARSE_SHAPES = {"w": (400, 500), "b": (7,)}


def sparse_setup(density: float = 0.25):
    params = {
        k: torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, (k, s) in enumerate(SPARSE_SHAPES.items())
    }
    algo = SparseLoCo(OuterConfig(algo="sparseloco", sparse_density=density), params, 0)
    moved = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9)) for k, v in params.items()}
    ex = algo.plan(0, [0, 1], moved)
    codec = PayloadCodec(
        SPARSE_SHAPES, algo.payload_roles, CompressionConfig(), encoded=algo.payload_encoded, part_elems=MIN_PART_ELEMS
    )
    return algo, ex.payload, codec


def test_encoded_values_round_trip_through_transmit():
    algo, payload, codec = sparse_setup()
    assert all(isinstance(v, bytes) for v in payload.values())
    enc = {k: len(v) for k, v in payload.items()}
    assert len([p for p in codec.parts(enc) if p.tensor == codec.index["sparse/w"]]) > 1  # several byte runs
    received, nbytes = codec.transmit(payload)
    assert nbytes == sum(enc.values())  # the codec's bytes are the wire's bytes
    stateless = get_codec("topk2bit")  # a receiver's instance: no options, no error-feedback state
    for k, v in payload.items():
        name = k.split("/", 1)[1]
        want = algo.codecs[name].decode(v).float().reshape(SPARSE_SHAPES[name])
        assert received[k].dtype == torch.float32 and received[k].shape == SPARSE_SHAPES[name]
        assert torch.equal(received[k], want)
        assert torch.equal(received[k], stateless.decode(v).float().reshape(want.shape))
    # 16 of every 64 values kept (the 7-element bias is one padded chunk: all kept).
    assert (received["sparse/w"] != 0).float().mean().item() == pytest.approx(0.25, abs=0.01)


def test_encoded_values_over_the_fake_stream(pool):
    algo, payload, codec = sparse_setup()
    enc = {k: len(v) for k, v in payload.items()}
    parts = codec.parts(enc)

    async def body():
        h = Harness(pool, codec=codec)
        data = b"".join(PART_LEN.pack(len(d)) + d for d in (codec.encode_part(payload, p) for p in parts))
        ans = await h.request(pack_frame(push_header(RUN, 0, SENDER, 1, 0, 1, enc, parts)) + data)
        assert status(ans) == ErrorCode.OK
        got = h.gossip.mailbox[0][SENDER]
        for k in payload:
            assert torch.equal(got[k], codec.transmit(payload)[0][k])
        # A declared byte length it cannot take, or a missing one, is refused from the header.
        bad = {**enc, "sparse/w": codec.tensors[codec.index["sparse/w"]].max_bytes() + 1}
        assert (
            status(await h.request(pack_frame(push_header(RUN, 1, SENDER, 2, 0, 1, bad, parts)))) == ErrorCode.TOO_LARGE
        )
        assert (
            status(await h.request(pack_frame(push_header(RUN, 1, SENDER, 3, 0, 1, {}, parts))))
            == ErrorCode.UNEXPECTED_TENSOR
        )

    asyncio.run(body())


def test_encoded_values_are_validated():
    algo, payload, codec = sparse_setup()
    with pytest.raises(PayloadError) as e:  # truncated: the seal's CRC fails
        codec.transmit({**payload, "sparse/w": payload["sparse/w"][:-10]})
    assert e.value.kind == "payload"
    with pytest.raises(PayloadError) as e:  # flipped bytes
        b = bytearray(payload["sparse/w"])
        b[100] ^= 0x55
        codec.transmit({**payload, "sparse/w": bytes(b)})
    assert e.value.kind == "payload"
    with pytest.raises(PayloadError) as e:  # a valid encoding of a tensor of another size
        codec.transmit({**payload, "sparse/b": get_codec("topk2bit", density=0.25).encode(torch.randn(9))})
    assert e.value.kind == "shape"
    with pytest.raises(PayloadError) as e:  # a run of the wrong length
        enc = {k: len(v) for k, v in payload.items()}
        part = codec.parts(enc)[0]
        codec.decode_part(codec.allocate(enc), part, b"\0" * (part.count - 1))
    assert e.value.kind == "shape"
    with pytest.raises(KeyError):  # an encoded value's length is needed for its layout
        codec.parts()
    with pytest.raises(ProtocolViolation) as v:
        validate_transfer(
            {"xfer": 1, "stream": 0, "streams": 1, "enc": {"sparse/w": 10}, "parts": [[0, 0, 1]]}, codec, 1 << 30
        )
    assert v.value.code == ErrorCode.UNEXPECTED_TENSOR


# ------------------------------------------------------------------------------ garbage parts


GARBAGE = [
    # stack, how, kind
    ("none", "short", "shape"),
    ("none", "nan", "finite"),
    ("none", "inf", "finite"),
    ("lossless", "zeros", "payload"),
    ("lossless", "random", "payload"),
    ("lossless", "truncated", "payload"),
    ("lossless", "other_count", "shape"),
    ("lossless", "nan", "finite"),
    ("lossless", "bf16_inside", "payload"),  # the run sends fp32
    ("bf16+lossless", "fp32_inside", "payload"),  # the run sends bf16
    ("bf16", "other_count", "shape"),
    ("bf16", "random", "payload"),
]


@pytest.mark.parametrize("stack,how,kind", GARBAGE)
def test_garbage_parts_raise_payload_error_of_their_kind(stack, how, kind):
    codec = theta_codec(stack)
    part = codec.parts()[-1]
    t = codec.tensors[part.tensor]
    assert part.count > 8
    g = torch.Generator().manual_seed(4)
    x = torch.randn(part.count, generator=g)

    def encode(v: torch.Tensor) -> bytes:
        pl = {n.name: torch.zeros(n.shape) for n in codec.tensors}
        flat = pl[t.name].view(-1)
        flat[part.start : part.start + v.numel()] = v
        return codec.encode_part(pl, Part(part.tensor, part.start, v.numel()))

    good = encode(x)
    if how == "short":
        data = good[:-4]
    elif how in ("nan", "inf"):
        x[3] = float("nan") if how == "nan" else float("inf")
        data = encode(x)
    elif how == "zeros":
        data = bytes(len(good))
    elif how == "random":
        data = torch.randint(0, 256, (len(good),), generator=g, dtype=torch.uint8).numpy().tobytes()
    elif how == "truncated":
        data = good[: len(good) // 2]
    elif how == "other_count":
        data = encode(x[:-1])
    elif how == "bf16_inside":
        data = get_codec("lossless").encode(x.bfloat16())
    elif how == "fp32_inside":
        data = get_codec("lossless").encode(x)
    dest = codec.allocate()
    for v in dest.values():
        v.zero_()
    codec.decode_part(dest, part, good)  # the good part decodes
    before = dest[t.name].clone()
    with pytest.raises(PayloadError) as e:
        codec.decode_part(dest, part, data)
    assert e.value.kind == kind, e.value
    assert torch.equal(bits(dest[t.name]), bits(before))  # nothing of a bad part is written


# ------------------------------------------------------------------------------ 5. NoLoCo's theta-only payload


def noloco_theta_reference(
    phi: torch.Tensor, thetas: list[torch.Tensor], m: torch.Tensor, alpha: float, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """m = beta*m + alpha*(mean_j theta_j - phi); phi += m; over whoever answered (self included)."""
    tbar = sum(thetas) / len(thetas)
    m = beta * m + alpha * (tbar - phi)
    return phi + m, m


def drift(thetas, seed):
    g = torch.Generator().manual_seed(seed)
    for th in thetas.values():
        for v in th.values():
            v.add_(torch.randn(v.shape, generator=g) * 0.1)


def run_round(algos, thetas, round_idx, members, drop=()):
    """A transport's round; workers in ``drop`` never answer (and hear nobody)."""
    plans = {i: algos[i].plan(round_idx, members, thetas[i]) for i in members}
    for i in members:
        got = {i: plans[i].payload}
        if i not in drop:
            got.update({j: plans[j].payload for j in plans[i].peers if j not in drop})
        algos[i].apply(round_idx, thetas[i], got)
    return plans


@pytest.mark.parametrize("gamma", [None, 0.7])  # None means gamma = alpha; 0.7 == alpha given explicitly
def test_noloco_theta_only_matches_the_reference(gamma):
    alpha, beta, size = 0.7, 0.5, 3
    cfg = OuterConfig(algo="noloco", lr=alpha, noloco_beta=beta, noloco_gamma=gamma, group_size=size)
    members = list(range(6))
    thetas = {i: rand_params(10 + i) for i in members}
    algos = {i: NoLoCo(cfg, thetas[i], i) for i in members}
    assert all(a.theta_only for a in algos.values())
    phi = {i: {k: v.clone() for k, v in thetas[i].items()} for i in members}
    m = {i: {k: torch.zeros_like(v) for k, v in thetas[i].items()} for i in members}
    for r, drop in enumerate([(), (), {2, 5}, ()]):
        drift(thetas, 60 + r)
        groups = noloco_groups(r, members, size, cfg.seed)
        for i in members:
            group = group_of(i, groups)
            answered = [i] if i in drop else [j for j in group if j == i or j not in drop]
            for k in SHAPES:
                phi[i][k], m[i][k] = noloco_theta_reference(
                    phi[i][k], [thetas[j][k].clone() for j in answered], m[i][k], alpha, beta
                )
        plans = run_round(algos, thetas, r, members, drop)
        for i in members:
            assert set(plans[i].payload) == {f"theta/{k}" for k in SHAPES}
            assert plans[i].roles == {"theta": "parameter"} == algos[i].payload_roles
            assert sorted(plans[i].peers + [i]) == group_of(i, groups)
            for k in SHAPES:
                assert torch.allclose(thetas[i][k], phi[i][k], atol=1e-5), (r, i, k)
                assert torch.allclose(algos[i].phi[k], phi[i][k], atol=1e-5)
                assert torch.allclose(algos[i].m[k], m[i][k], atol=1e-5)


def test_theta_only_equals_the_phi_delta_form_when_gamma_is_alpha():
    """The fold alpha*Dbar + gamma*(Pbar - phi) = alpha*(mean theta - phi) holds: forcing the phi/delta
    payload on the same workers gives the same weights."""
    cfg = OuterConfig(algo="noloco", lr=0.7, noloco_beta=0.5, group_size=2)
    members = [0, 1, 2, 3]
    start = {i: rand_params(20 + i) for i in members}
    ta = {i: {k: v.clone() for k, v in start[i].items()} for i in members}
    tb = {i: {k: v.clone() for k, v in start[i].items()} for i in members}
    a = {i: NoLoCo(cfg, ta[i], i) for i in members}
    b = {i: NoLoCo(cfg, tb[i], i) for i in members}
    for x in b.values():
        x.theta_only = False
        x.payload_roles = {"phi": "parameter", "delta": "outer_gradient"}
    for r in range(3):
        drift(ta, 70 + r)
        drift(tb, 70 + r)
        pa = run_round(a, ta, r, members, drop={3} if r == 1 else ())
        pb = run_round(b, tb, r, members, drop={3} if r == 1 else ())
        assert all(set(pb[i].payload) == {f"{p}/{k}" for p in ("phi", "delta") for k in SHAPES} for i in members)
        assert all(set(pa[i].payload) == {f"theta/{k}" for k in SHAPES} for i in members)
        for i in members:
            for k in SHAPES:
                assert torch.allclose(ta[i][k], tb[i][k], atol=1e-5), (r, i, k)


def test_payload_keys_follow_gamma():
    params = rand_params(0)
    theta = NoLoCo(OuterConfig(algo="noloco", lr=0.7), params, 0)
    ex = theta.plan(0, [0, 1], params)
    assert set(ex.payload) == {f"theta/{k}" for k in SHAPES} and ex.roles == {"theta": "parameter"}
    for k, v in params.items():  # theta is a snapshot of the weights, not a view of them
        assert torch.equal(ex.payload[f"theta/{k}"], v) and ex.payload[f"theta/{k}"].data_ptr() != v.data_ptr()
    both = NoLoCo(OuterConfig(algo="noloco", lr=0.7, noloco_gamma=0.3), params, 0)
    ex = both.plan(0, [0, 1], params)
    assert set(ex.payload) == {f"{p}/{k}" for p in ("phi", "delta") for k in SHAPES}
    assert ex.roles == {"phi": "parameter", "delta": "outer_gradient"}
    codec = PayloadCodec(SHAPES, ex.roles, CompressionConfig())
    assert {t.name for t in codec.tensors} == set(ex.payload)
