"""Each outer rule against an independent few-line reference of its equations (docs/algorithms.md §1-4)."""

import pytest
import torch

from locomm.config import OuterConfig
from locomm.protocol import DDP, DiLoCo, GASLoC, NoLoCo, SparseLoCo
from locomm.protocol.schedule import gasloc_graph, noloco_groups, participants, round_permutation

SHAPES = {"a": (6, 4), "b": (5,)}


def rand_params(seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def run_round(algos, thetas, round_idx, members, drop=()):
    """Drive one round the way a transport does; workers in ``drop`` never answer."""
    plans = {i: algos[i].plan(round_idx, members, thetas[i]) for i in members}
    for i in members:
        peers = plans[i].peers if not plans[i].collective else [m for m in members if m != i]
        got = {i: plans[i].payload}
        got.update({j: plans[j].payload for j in peers if j not in drop})
        if i in drop:
            got = {i: plans[i].payload}
        algos[i].apply(round_idx, thetas[i], got)


def drift(thetas, seed):
    g = torch.Generator().manual_seed(seed)
    for th in thetas.values():
        for v in th.values():
            v.add_(torch.randn(v.shape, generator=g) * 0.1)


# ------------------------------------------------------------------------------- schedule


def test_groups_partition_and_are_deterministic():
    members = [3, 9, 1, 7, 5, 11, 2]
    for r in range(5):
        groups = noloco_groups(r, members, 2, seed=1)
        flat = sorted(m for g in groups for m in g)
        assert flat == sorted(members)
        assert all(2 <= len(g) <= 3 for g in groups)
        assert groups == noloco_groups(r, list(reversed(members)), 2, seed=1)  # order-free
    assert round_permutation(0, members) != round_permutation(1, members)


def test_gasloc_graphs():
    members = list(range(7))
    m = gasloc_graph(0, members, "matching")
    assert all(len(n) >= 1 for n in m.values()) and sum(len(n) for n in m.values()) == 2 * 3 + 2 * 2 - 2 + 2
    ring = gasloc_graph(0, members, "ring")
    assert all(len(n) == 2 for n in ring.values())
    kp = gasloc_graph(0, members, "kpeers", k=2)
    assert all(len(n) >= 2 for n in kp.values())
    assert all(i in kp[j] for i in kp for j in kp[i])  # symmetric
    full = gasloc_graph(0, members, "complete")
    assert all(len(n) == 6 for n in full.values())
    some = participants(3, list(range(1000)), 0.3)
    assert 200 < len(some) < 400 and some == participants(3, list(range(1000)), 0.3)


# -------------------------------------------------------------------------------- DiLoCo


@pytest.mark.parametrize("nesterov, mu", [(True, 0.9), (False, 0.3)])  # heavy-ball 0.3: NoLoCo's baseline
def test_diloco_matches_torch_sgd(nesterov, mu):
    cfg = OuterConfig(algo="diloco", lr=0.7, momentum=mu, nesterov=nesterov)
    start = rand_params(0)
    members = [0, 1, 2, 3]
    thetas = {i: {k: v.clone() for k, v in start.items()} for i in members}
    algos = {i: DiLoCo(cfg, thetas[i], i) for i in members}
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in start.items()}
    opt = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=mu, nesterov=nesterov)
    for r in range(4):
        drift(thetas, 100 + r)
        for k, p in ref.items():
            p.grad = torch.stack([p.detach() - thetas[i][k] for i in members]).mean(0)
        opt.step()
        run_round(algos, thetas, r, members)
        for i in members:
            for k in SHAPES:
                assert torch.allclose(thetas[i][k], ref[k].detach(), atol=1e-5)


def test_diloco_goes_on_with_who_answered():
    cfg = OuterConfig(algo="diloco", lr=1.0, momentum=0.0)
    start = rand_params(0)
    members = [0, 1, 2]
    thetas = {i: {k: v.clone() for k, v in start.items()} for i in members}
    algos = {i: DiLoCo(cfg, thetas[i], i) for i in members}
    drift(thetas, 5)
    expect = {k: (thetas[0][k] + thetas[1][k]) / 2 for k in SHAPES}  # lr 1, no momentum: the mean
    run_round(algos, thetas, 0, members, drop={2})
    for k in SHAPES:
        assert torch.allclose(thetas[0][k], expect[k], atol=1e-6)


# -------------------------------------------------------------------------------- NoLoCo


def noloco_reference(phi, theta, m, group, alpha, beta, gamma):
    dbar = sum(theta[j] - phi[j] for j in group) / len(group)
    pbar = sum(phi[j] for j in group) / len(group)
    out_phi, out_m = {}, {}
    for i in group:
        out_m[i] = beta * m[i] + alpha * dbar + gamma * (pbar - phi[i])
        out_phi[i] = phi[i] + out_m[i]
    return out_phi, out_m


@pytest.mark.parametrize("gamma", [None, 0.3])
def test_noloco_matches_reference(gamma):
    cfg = OuterConfig(algo="noloco", lr=0.7, noloco_beta=0.5, noloco_gamma=gamma, group_size=2)
    g = cfg.gamma
    members = list(range(6))
    thetas = {i: rand_params(i) for i in members}  # workers start apart
    algos = {i: NoLoCo(cfg, thetas[i], i) for i in members}
    phi = {i: {k: v.clone() for k, v in thetas[i].items()} for i in members}
    m = {i: {k: torch.zeros_like(v) for k, v in thetas[i].items()} for i in members}
    for r in range(3):
        drift(thetas, 50 + r)
        for group in noloco_groups(r, members, 2, cfg.seed):
            for k in SHAPES:
                new_phi, new_m = noloco_reference(
                    {j: phi[j][k] for j in group},
                    {j: thetas[j][k] for j in group},
                    {j: m[j][k] for j in group},
                    group,
                    0.7,
                    0.5,
                    g,
                )
                for j in group:
                    phi[j][k], m[j][k] = new_phi[j], new_m[j]
        run_round(algos, thetas, r, members)
        for i in members:
            for k in SHAPES:
                assert torch.allclose(thetas[i][k], phi[i][k], atol=1e-5)


def test_noloco_alone_is_a_local_step():
    cfg = OuterConfig(algo="noloco", lr=0.7, noloco_beta=0.5)
    members = [0, 1]
    thetas = {i: rand_params(i) for i in members}
    start = {k: v.clone() for k, v in thetas[0].items()}
    algos = {i: NoLoCo(cfg, thetas[i], i) for i in members}
    drift(thetas, 9)
    moved = {k: thetas[0][k] - start[k] for k in SHAPES}
    run_round(algos, thetas, 0, members, drop={1})
    for k in SHAPES:
        assert torch.allclose(thetas[0][k], start[k] + 0.7 * moved[k], atol=1e-6)


# -------------------------------------------------------------------------------- GASLoC


def test_gasloc_complete_graph_reproduces_diloco():
    members = [0, 1, 2, 3]
    start = rand_params(0)
    g_cfg = OuterConfig(algo="gasloc", topology="complete", lr=0.7, gasloc_mix=0.5, gasloc_gamma=0.9)
    d_cfg = OuterConfig(algo="diloco", lr=0.7, momentum=0.9)
    tg = {i: {k: v.clone() for k, v in start.items()} for i in members}
    td = {i: {k: v.clone() for k, v in start.items()} for i in members}
    ga = {i: GASLoC(g_cfg, tg[i], i) for i in members}
    da = {i: DiLoCo(d_cfg, td[i], i) for i in members}
    for r in range(6):
        drift(tg, 200 + r)
        drift(td, 200 + r)
        run_round(ga, tg, r, members)
        run_round(da, td, r, members)
        for i in members:
            for k in SHAPES:
                assert torch.allclose(tg[i][k], td[i][k], atol=1e-5), (r, i, k)


def test_gasloc_pair_average_and_plain_gossip():
    cfg = OuterConfig(algo="gasloc", topology="matching", lr=1.0, gasloc_mix=0.5, gasloc_gamma=0.0)
    members = [0, 1]
    thetas = {i: rand_params(i) for i in members}
    algos = {i: GASLoC(cfg, thetas[i], i) for i in members}
    drift(thetas, 1)
    mean = {k: (thetas[0][k] + thetas[1][k]) / 2 for k in SHAPES}
    run_round(algos, thetas, 0, members)
    for i in members:
        for k in SHAPES:
            assert torch.allclose(thetas[i][k], mean[k], atol=1e-6)


@pytest.mark.parametrize("topology", ["ring", "kpeers", "matching"])
def test_gasloc_gossip_keeps_the_mean(topology):
    """Metropolis weights are doubly stochastic: with gamma=0 the workers' mean is y's mean."""
    cfg = OuterConfig(algo="gasloc", topology=topology, lr=0.5, gasloc_gamma=0.0, k_peers=2)
    members = list(range(7))
    thetas = {i: rand_params(i) for i in members}
    algos = {i: GASLoC(cfg, thetas[i], i) for i in members}
    drift(thetas, 3)
    y_mean = {k: sum(algos[i].phi[k] + 0.5 * (thetas[i][k] - algos[i].phi[k]) for i in members) / 7 for k in SHAPES}
    spread_before = sum(float((thetas[i]["a"] - y_mean["a"]).norm()) for i in members)
    run_round(algos, thetas, 0, members)
    for k in SHAPES:
        assert torch.allclose(sum(thetas[i][k] for i in members) / 7, y_mean[k], atol=1e-5)
    assert sum(float((thetas[i]["a"] - y_mean["a"]).norm()) for i in members) < spread_before


def test_gasloc_non_participant_keeps_training():
    cfg = OuterConfig(algo="gasloc", participation=0.5, seed=0)
    members = list(range(8))
    thetas = {i: rand_params(i) for i in members}
    algos = {i: GASLoC(cfg, thetas[i], i) for i in members}
    drift(thetas, 4)
    before = {i: {k: v.clone() for k, v in thetas[i].items()} for i in members}
    run_round(algos, thetas, 0, members)
    skipped = set(members) - set(participants(0, members, 0.5, 0))
    assert skipped and skipped != set(members)
    for i in skipped:
        assert all(torch.equal(thetas[i][k], before[i][k]) for k in SHAPES)
    for i in set(members) - skipped:
        assert not torch.equal(thetas[i]["a"], before[i]["a"])


# ---------------------------------------------------------------------------- SparseLoCo


class DenseCodec:
    """Identity 'codec' so the outer rule can be checked on its own."""

    def encode(self, x):
        return x.clone()

    def decode(self, data):
        return data


def test_sparseloco_outer_rule_counts_senders_per_index():
    cfg = OuterConfig(algo="sparseloco", sparse_lr=0.8, sparseloco_aggregation="senders")
    members = [0, 1, 2]
    thetas = {i: {k: v.clone() for k, v in rand_params(0).items()} for i in members}
    algos = {i: SparseLoCo(cfg, thetas[i], i, codec_factory=DenseCodec) for i in members}
    phi0 = {k: v.clone() for k, v in algos[0].phi.items()}
    drift(thetas, 2)
    thetas[2]["b"][:2] = phi0["b"][:2]  # worker 2 sends zeros at two indices: they don't count
    d = {i: {k: phi0[k] - thetas[i][k] for k in SHAPES} for i in members}
    run_round(algos, thetas, 0, members)
    mean_b = (d[0]["b"] + d[1]["b"] + d[2]["b"]) / 3
    mean_b[:2] = (d[0]["b"][:2] + d[1]["b"][:2]) / 2
    assert torch.allclose(thetas[0]["b"], phi0["b"] - 0.8 * mean_b, atol=1e-6)
    assert torch.allclose(thetas[1]["a"], phi0["a"] - 0.8 * (d[0]["a"] + d[1]["a"] + d[2]["a"]) / 3, atol=1e-6)


def test_sparseloco_median_clip_caps_each_sender():
    """The public code's robustness step: each sender's update scaled to at most the median norm."""
    cfg = OuterConfig(algo="sparseloco", sparse_lr=1.0, sparseloco_aggregation="senders", sparseloco_clip="median")
    members = [0, 1, 2]
    thetas = {i: {k: v.clone() for k, v in rand_params(0).items()} for i in members}
    algos = {i: SparseLoCo(cfg, thetas[i], i, codec_factory=DenseCodec) for i in members}
    phi0 = {k: v.clone() for k, v in algos[0].phi.items()}
    drift(thetas, 4)
    for k in SHAPES:  # worker 2 lies with a 100x update: clipped to the median, it cannot move phi far
        thetas[2][k] = phi0[k] - 100 * (phi0[k] - thetas[2][k])
    d = {i: {k: phi0[k] - thetas[i][k] for k in SHAPES} for i in members}
    run_round(algos, thetas, 0, members)
    for k in SHAPES:
        norms = torch.stack([d[i][k].norm() for i in members])
        cap = norms.median()
        clipped = [d[i][k] * min(1.0, float(cap / d[i][k].norm())) for i in members]
        assert torch.allclose(thetas[0][k], phi0[k] - sum(clipped) / 3, atol=1e-5)
        assert (phi0[k] - thetas[0][k]).norm() <= cap * 1.0001


def test_sparseloco_paper_rule_is_the_mean_over_all_workers():
    """Default rule (arXiv 2508.15706): D = (1/R) sum_r Q2(TopK(e_r)), an index a worker did not send counting
    as 0, checked against a reference built from the codec alone; one worker not answering makes R = 2."""
    from locomm.compression import get_codec

    cfg = OuterConfig(algo="sparseloco", sparse_lr=0.8, sparse_density=0.02)  # k = 1 per chunk of 64
    members = [0, 1, 2]
    thetas = {i: {k: v.clone() for k, v in rand_params(0).items()} for i in members}
    algos = {i: SparseLoCo(cfg, thetas[i], i) for i in members}
    phi0 = {k: v.clone() for k, v in algos[0].phi.items()}
    drift(thetas, 3)
    sent = {}
    for i in members:  # the reference: each worker's own codec state, fresh, on the same pseudo-gradient
        for k in SHAPES:
            c = get_codec("topk2bit", density=0.02, beta=cfg.sparse_ef_beta)
            sent[i, k] = c.decode(c.encode(phi0[k] - thetas[i][k])).float().reshape(SHAPES[k])
    run_round(algos, thetas, 0, members, drop=(2,))
    for k in SHAPES:
        assert (sent[0, k] != 0).sum() < sent[0, k].numel()  # really sparse: a mean with zeros, not a dense one
        want01 = phi0[k] - 0.8 * (sent[0, k] + sent[1, k]) / 2  # workers 0 and 1: R = 2 (2 never answered)
        assert torch.allclose(thetas[0][k], want01, atol=1e-6) and torch.allclose(thetas[1][k], want01, atol=1e-6)
        assert torch.allclose(thetas[2][k], phi0[k] - 0.8 * sent[2, k], atol=1e-6)  # alone: R = 1


# ----------------------------------------------------------------------------------- DDP


def test_ddp_averages_gradients_of_who_answered():
    grads = {i: rand_params(i) for i in range(3)}
    ddp = {i: DDP(i) for i in range(3)}
    plans = {i: ddp[i].plan([0, 1, 2], grads[i]) for i in range(3)}
    expect = {k: (grads[0][k] + grads[1][k]) / 2 for k in SHAPES}
    ddp[0].apply(grads[0], {0: plans[0].payload, 1: plans[1].payload})
    assert all(torch.allclose(grads[0][k], expect[k]) for k in SHAPES)
