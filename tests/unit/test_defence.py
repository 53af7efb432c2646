"""protocol/defence.py and protocol/attacks.py: each rule clips or rejects each attack, never an honest update."""

from __future__ import annotations

import math

import pytest
import torch

from locomm.compression.topk2bit import TopK2BitCodec
from locomm.config import ConfigError, DefenceConfig, OuterConfig, RunSpec
from locomm.protocol import DiLoCo, GASLoC, NoLoCo, SparseLoCo
from locomm.protocol.attacks import ATTACKS, corrupt
from locomm.protocol.defence import GROUP_MEAN, Defence, RunningMedian
from locomm.protocol.rounds import Rounds

WORKERS = 4


def _start() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(32, 16, generator=g) * 0.1, "b": torch.randn(64, generator=g) * 0.1}


def _progress(phi: dict[str, torch.Tensor], w: int, r: int) -> dict[str, torch.Tensor]:
    """Worker w's theta after a round of local steps: a shared drift plus its own noise."""
    g = torch.Generator().manual_seed(1000 * r + w)
    common = torch.Generator().manual_seed(r)
    return {
        k: v + 0.01 * torch.randn(v.shape, generator=common) + 0.01 * torch.randn(v.shape, generator=g)
        for k, v in phi.items()
    }


def _swarm(algo: str, **outer):
    cfg = OuterConfig(algo=algo, **outer)
    start = _start()
    cls = {"noloco": NoLoCo, "gasloc": GASLoC, "sparseloco": SparseLoCo, "diloco": DiLoCo}[algo]
    kw = {"codec_factory": lambda: TopK2BitCodec(density=1 / 16, beta=0.9)} if algo == "sparseloco" else {}
    params = [{k: v.clone() for k, v in start.items()} for _ in range(WORKERS)]
    algos = [cls(cfg, params[w], w, **kw) for w in range(WORKERS)]
    return params, algos


def _decoded(algo, payload):
    """What the transport hands the receiver: SparseLoCo's bytes decoded to tensors."""
    if algo.name != "sparseloco":
        return payload
    return {key: algo.codecs[key.split("/", 1)[1]].decode(v) for key, v in payload.items()}


def _run(algo: str, rounds: int, attack: str | None, defence: DefenceConfig | None = None, **outer):
    """All-to-all rounds (every worker screens every other); worker 0 attacks when ``attack`` is set.
    Returns the honest receivers' rejected and clipped senders over all rounds, and the final params."""
    params, algos = _swarm(algo, **outer)
    rs = [Rounds(a, 1, overlap=False, defence=defence) for a in algos]
    gen = torch.Generator().manual_seed(5)
    rejected: list[tuple[int, int]] = []
    clipped: list[tuple[int, int]] = []
    members = list(range(WORKERS))
    for r in range(rounds):
        planned = []
        for w in members:
            theta = _progress(algos[w].phi, w, r)
            if attack is not None and w == 0:
                theta = corrupt(attack, theta, algos[w].phi, gen)
            with torch.no_grad():
                for k, p in params[w].items():
                    p.copy_(theta[k])
            planned.append(rs[w].start(r, members, params[w]))
        for w in members:
            got = {j: _decoded(algos[j], planned[j].exchange.payload) for j in members if j != w}
            rs[w].arrived(planned[w].received(w, got))
            rs[w].settle(params[w])
            if w != 0 or attack is None:
                rejected += [(w, j) for j, _ in rs[w].rejected]
                clipped += [(w, j) for j, _ in rs[w].clipped]
    return rejected, clipped, params


ALGOS = [("noloco", {}), ("noloco", {"noloco_gamma": 0.5}), ("gasloc", {"topology": "complete"}), ("sparseloco", {})]


@pytest.mark.parametrize(("algo", "outer"), ALGOS)
def test_clean_updates_are_never_rejected_or_clipped(algo, outer) -> None:
    rejected, clipped, _ = _run(algo, 8, None, **outer)
    assert rejected == [] and clipped == []


@pytest.mark.parametrize(("algo", "outer"), ALGOS)
@pytest.mark.parametrize("attack", ["scale100", "target", "noise"])
def test_each_attack_is_clipped_or_rejected(algo, outer, attack) -> None:
    rounds = 5
    rejected, clipped, params = _run(algo, rounds, attack, **outer)
    flagged = [(w, j) for w, j in rejected + clipped if j == 0]
    assert len(flagged) >= (WORKERS - 1) * (rounds - 1)  # every honest receiver, every round after the first
    assert all(j == 0 for _, j in rejected + clipped)  # no honest sender flagged
    assert all(torch.isfinite(p).all() for w in range(1, WORKERS) for p in params[w].values())


def test_reject_mode_and_signflip_in_reject_mode() -> None:
    rejected, clipped, _ = _run("noloco", 4, "scale100", DefenceConfig(mode="reject"))
    assert clipped == [] and {j for _, j in rejected} == {0} and len(rejected) == (WORKERS - 1) * 4
    off_rej, off_clip, _ = _run("noloco", 3, "scale100", DefenceConfig(mode="off"))
    assert off_rej == [] and off_clip == []


def test_signflip_of_a_shared_drift_is_seen_once_it_grows() -> None:
    """A sign-flipped NoLoCo update has an honest norm: the rule sees it only through the attacker's own
    drift, which it doubles every round (theta <- outer(sent) + 2*(theta - phi)). Reported, not hidden."""
    rejected, clipped, _ = _run("noloco", 6, "signflip")
    assert all(j == 0 for _, j in rejected + clipped)


def test_clip_scales_the_deviation_to_the_reference() -> None:
    params, algos = _swarm("noloco")
    d = Defence(DefenceConfig(warmup=0), algos[1])
    own = {f"theta/{k}": v + 0.01 for k, v in algos[1].phi.items()}
    far = {f"theta/{k}": v + 0.1 for k, v in algos[1].phi.items()}  # 10x the own distance
    out = d.screen({1: own, 0: far}, {})
    assert out.rejected == [] and [j for j, _ in out.clipped] == [0]
    for k, phi in algos[1].phi.items():
        torch.testing.assert_close(out.received[0][f"theta/{k}"], phi + 0.01)
    nan = {k: v.clone() for k, v in own.items()}
    nan["theta/w"][0, 0] = math.nan
    assert [j for j, _ in d.screen({1: own, 0: nan}, {}).rejected] == [0]


def test_running_median() -> None:
    m = RunningMedian(3)
    assert m.median() is None and m.bound(2.0) is None and len(m) == 0
    for v in (1.0, 5.0, math.inf, 3.0):
        m.update(v)
    assert len(m) == 3 and m.median() == 3.0 and m.bound(2.0) == 6.0
    m.update(10.0)  # window: 5, 3, 10
    assert m.median() == 5.0
    with pytest.raises(ValueError):
        RunningMedian(0)


@pytest.mark.parametrize("bad", ["nan", "huge"])
def test_diloco_falls_back_to_the_own_step(bad) -> None:
    params, algos = _swarm("diloco")
    r = Rounds(algos[0], 1, overlap=False)
    theta = _progress(algos[0].phi, 0, 0)
    with torch.no_grad():
        for k, p in params[0].items():
            p.copy_(theta[k])
    planned = r.start(0, [0, 1], params[0])
    own = planned.exchange.payload
    mean = {k: (v * math.nan if bad == "nan" else v * 1e6) for k, v in own.items()}
    r.arrived({GROUP_MEAN: mean})  # what the daemon's averager hands back
    want = DiLoCo(OuterConfig(algo="diloco"), _start(), 0)
    want_params = {k: v.clone() for k, v in theta.items()}
    want.apply(0, want_params, {0: own})
    r.settle(params[0])
    assert r.fallback is not None and r.rejected == []
    for k in params[0]:
        torch.testing.assert_close(params[0][k], want_params[k])
    r.start(1, [0, 1], params[0])  # a sane mean is taken as it is
    r.arrived({GROUP_MEAN: dict(r.pending.exchange.payload)})
    r.settle(params[0])
    assert r.fallback is None


def test_corrupt_kinds() -> None:
    phi = {"w": torch.zeros(10, 10)}
    theta = {"w": torch.full((10, 10), 0.5)}
    assert torch.equal(corrupt("scale100", theta, phi)["w"], torch.full((10, 10), 50.0))
    assert torch.equal(corrupt("signflip", theta, phi)["w"], torch.full((10, 10), -0.5))
    assert torch.equal(corrupt("target", theta, phi)["w"], -theta["w"])
    noisy = corrupt("noise", theta, phi, torch.Generator().manual_seed(0))["w"]
    assert 8 < float((noisy - theta["w"]).norm()) / float(theta["w"].norm()) < 12
    assert set(ATTACKS) == {"scale100", "signflip", "target", "noise"}
    with pytest.raises(ValueError):
        corrupt("nope", theta, phi)


def test_config_round_trip_and_validation() -> None:
    spec = RunSpec.preset("nano").replace("defence", mode="reject", factor=4.0, window=16)
    again = RunSpec.from_toml(spec.to_toml())
    assert again == spec and again.hash() == spec.hash()
    assert "[defence]" in spec.to_toml()
    assert spec.hash() != RunSpec.preset("nano").hash()
    assert RunSpec.preset("nano").defence.enabled and not DefenceConfig(mode="off").enabled
    with pytest.raises(ConfigError, match="defence.mode"):
        RunSpec.from_toml('[defence]\nmode = "maybe"\n')
    with pytest.raises(ConfigError, match="reject_factor"):
        DefenceConfig(factor=5.0, reject_factor=2.0)
    with pytest.raises(ConfigError, match="warmup"):
        DefenceConfig(window=2, warmup=3)


def test_simulator_counts_the_attackers_exchanges(nano_spec, nano_splits) -> None:
    from locomm.sim import Simulator  # noqa: PLC0415

    spec = nano_spec.replace("outer", algo="noloco", inner_steps=2).replace("train", steps=6, eval_batches=1)
    res = Simulator(spec, 4, splits=nano_splits, codec="none", eval_every=3, attackers={0: "scale100"}).run(3)
    d = res.defence
    assert d["attacker_exchanges"] >= 1 and d["attacker_rejected"] + d["attacker_clipped"] == d["attacker_exchanges"]
    assert d["honest_rejected"] == d["honest_clipped"] == 0
    assert all(map(math.isfinite, res.val_loss))
    with pytest.raises(ConfigError, match="attackers"):
        Simulator(spec, 4, splits=nano_splits, attackers={9: "scale100"})
