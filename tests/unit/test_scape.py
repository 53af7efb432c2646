"""SCAPE's per-step sync (protocol/scape.py) against a reference written from the paper's equations
(docs/algorithms.md §5), its mask delay, AdamS's second moment rebuilt from the synced buffer, identical
members, a missing slice, bad input; the Trainer split; and ``simulate --algo scape`` (sim/scape.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from locomm.config import ConfigError, RunSpec
from locomm.optim import AdamS
from locomm.protocol.scape import ScapeMessage, ScapeSync, decode_indices, encode_indices, reduce, shard_bounds

SHAPES = {"w": (6, 7), "b": (5,), "u": (3, 4)}  # 59 coordinates: slices cross tensor boundaries
NUMEL = 59
LR, B1, B2, EPS, WD = 0.01, 0.9, 0.95, 1e-8, 0.1


# -- the reference: explicit 0/1 masks and the AdamS equations, numpy, nothing from locomm -----------------


def ref_slices(n: int, workers: int) -> list[tuple[int, int]]:
    sizes = [n // workers + (r < n % workers) for r in range(workers)]
    edges = np.cumsum([0, *sizes])
    return [(int(edges[r]), int(edges[r + 1])) for r in range(workers)]


def ref_mask(m: np.ndarray, workers: int, sparsity: float) -> np.ndarray:
    """0/1 mask: in each worker's slice the ceil((1 - s) * len) coordinates of largest |m|."""
    mask = np.zeros(m.size, dtype=bool)
    for lo, hi in ref_slices(m.size, workers):
        keep = max(1, math.ceil((1 - sparsity) * (hi - lo)))
        order = np.argsort(-np.abs(m[lo:hi]), kind="stable")
        mask[lo + order[:keep]] = True
    return mask


def ref_run(grads: list[list[np.ndarray]], sparsity: float, ef: bool = True):
    """theta, m and the mask of every step, for grads[t][w] (flat, fp32), from theta = 1."""
    workers, n = len(grads[0]), grads[0][0].size
    theta = np.ones(n, dtype=np.float32)
    m = np.zeros(n, dtype=np.float32)
    r = [np.zeros(n, dtype=np.float32) for _ in range(workers)]
    mask = np.ones(n, dtype=bool)  # steps 0 and 1: dense
    history, m_prev2 = [], None
    for t, gs in enumerate(grads):
        if t >= 2:
            mask = ref_mask(m_prev2, workers, sparsity)  # M_t from m_{t-2}
        m_prev2 = m.copy() if t >= 1 else None  # m_{t-1}: what the next mask is built from
        sent = []
        for w in range(workers):
            u = gs[w] + r[w] if ef else gs[w].copy()
            sent.append(np.where(mask, u, 0.0).astype(np.float32))
            r[w] = np.where(mask, 0.0, u).astype(np.float32) if ef else r[w]
        ghat = (sum(sent) / workers).astype(np.float32)
        k = t + 1  # AdamS, as docs/algorithms.md §5 writes it (weight decay on every coordinate here)
        theta = theta * (1 - LR * WD)
        mh = m / (1 - B1**k)
        v = B2 * mh**2 + (1 - B2) * ghat**2
        m = B1 * m + (1 - B1) * ghat
        theta = theta - LR * (m / (1 - B1**k)) / (np.sqrt(v) + EPS)
        history.append((theta.copy(), m.copy(), mask.copy(), ghat))
    return history


# -- the implementation: ScapeSync + reduce + AdamS per worker ----------------------------------------------


def make_grads(steps: int, workers: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(NUMEL).astype(np.float32) for _ in range(workers)] for _ in range(steps)]


class Member:
    def __init__(self, rank: int, workers: int, sparsity: float, ef: bool = True) -> None:
        self.params = {k: torch.nn.Parameter(torch.ones(s)) for k, s in SHAPES.items()}
        self.opt = AdamS(self.params.values(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
        self.sync = ScapeSync(SHAPES, rank=rank, workers=workers, sparsity=sparsity, error_feedback=ef)
        self.history: list[tuple[np.ndarray, np.ndarray]] = []

    def moment(self) -> dict[str, torch.Tensor] | None:
        if not self.opt.state:
            return None
        return {k: self.opt.state[p]["exp_avg"] for k, p in self.params.items()}

    def flat(self) -> np.ndarray:
        return self.sync.flatten(self.params).numpy()

    def step(self, ghat: dict[str, torch.Tensor]) -> None:
        for k, p in self.params.items():
            p.grad = ghat[k].clone()
        self.opt.step()


def run_members(grads, sparsity, ef=True, drop_shard_of=None, record=False):
    workers = len(grads[0])
    members = [Member(w, workers, sparsity, ef) for w in range(workers)]
    trace = []
    for gs in grads:
        masks = [None if mb.sync.mask is None else mb.sync.mask.clone() for mb in members]
        msgs = []
        for w, mb in enumerate(members):
            g = mb.sync.unflatten(torch.from_numpy(gs[w]))
            msgs.append(mb.sync.plan(g, mb.moment()))
        if drop_shard_of is not None:
            msgs[drop_shard_of].mask_shard = None
        synced = reduce(msgs)
        for mb in members:
            mb.step(mb.sync.apply(synced, mb.moment()))
            if record:
                mb.history.append((mb.flat().copy(), mb.sync.flatten(mb.moment()).numpy().copy()))
        trace.append((members, masks, msgs, synced))
        for mb in members[1:]:  # bit-identical after every step: weights, first moment, mask
            assert np.array_equal(mb.flat(), members[0].flat())
            assert all(torch.equal(a, b) for a, b in zip(mb.moment().values(), members[0].moment().values()))
            assert (mb.sync.mask is None) == (members[0].sync.mask is None)
            assert mb.sync.mask is None or torch.equal(mb.sync.mask, members[0].sync.mask)
    return members, trace


@pytest.mark.parametrize(("workers", "sparsity"), [(2, 0.9), (3, 0.75), (4, 0.0)])
def test_scape_matches_the_papers_equations(workers, sparsity):
    grads = make_grads(8, workers)
    ref = ref_run(grads, sparsity)
    members, trace = run_members(grads, sparsity, record=True)
    for t, ((r_theta, r_m, r_mask, _), (_, masks, _, _), (theta, m)) in enumerate(
        zip(ref, trace, members[0].history, strict=True)
    ):
        used = np.ones(NUMEL, bool) if masks[0] is None else np.isin(np.arange(NUMEL), masks[0].numpy())
        assert np.array_equal(used, r_mask), f"step {t}: mask"
        np.testing.assert_allclose(theta, r_theta, rtol=1e-5, atol=1e-6, err_msg=f"step {t}: theta")
        np.testing.assert_allclose(m, r_m, rtol=1e-5, atol=1e-7, err_msg=f"step {t}: first moment")
    if sparsity > 0:  # the sparse steps changed something: the test would see a dense rule
        assert not ref[-1][2].all()


def test_mask_delay_and_slices():
    workers, sparsity = 3, 0.8
    grads = make_grads(5, workers, seed=1)
    members, trace = run_members(grads, sparsity)
    bounds = shard_bounds(NUMEL, workers)
    assert trace[0][1][0] is None and trace[1][1][0] is None  # steps 0 and 1 are dense
    assert all(m.values.numel() == NUMEL for m in trace[0][2] + trace[1][2])
    assert all(m.mask_shard is None for m in trace[0][2])  # no moment before step 0
    ms = []  # m after each step, rebuilt from the reference equations on the same inputs
    for _, m, _, _ in ref_run(grads, sparsity):
        ms.append(m)
    for t in (2, 3, 4):
        assert torch.equal(trace[t][1][0], torch.from_numpy(np.flatnonzero(ref_mask(ms[t - 2], workers, sparsity))))
        for w, msg in enumerate(trace[t][2]):
            lo, hi = bounds[w]
            assert msg.mask_shard.min() >= lo and msg.mask_shard.max() < hi  # each rank its own slice
            assert msg.values.numel() == trace[t][1][0].numel()
    # The slices gathered at step t are the mask of step t + 1.
    assert torch.equal(trace[2][3].next_mask, trace[3][1][0])


def test_second_moment_rebuilt_from_the_one_buffer():
    """AdamS keeps one buffer; off the mask ghat is 0, so v = b2 * mh^2 there and m decays by b1."""
    workers, sparsity = 2, 0.9
    grads = make_grads(4, workers, seed=2)
    members, trace = run_members(grads[:3], sparsity)
    mb = members[0]
    assert all(set(mb.opt.state[p]) == {"step", "exp_avg"} for p in mb.params.values())
    m_prev = mb.sync.flatten(mb.moment()).numpy().copy()
    theta_prev = mb.flat().copy()
    msgs = [x.sync.plan(x.sync.unflatten(torch.from_numpy(grads[3][w])), x.moment()) for w, x in enumerate(members)]
    synced = reduce(msgs)
    mask = mb.sync.mask.numpy()
    ghat_d = mb.sync.apply(synced)
    ghat = mb.sync.flatten(ghat_d).numpy()
    off = np.setdiff1d(np.arange(NUMEL), mask)
    assert off.size > 0 and np.all(ghat[off] == 0)
    expect_on = (sum(torch.from_numpy(grads[3][w]) for w in range(workers)) / workers).numpy()[mask]
    assert not np.allclose(ghat[mask], expect_on)  # error feedback added what earlier steps held back
    mb.step(ghat_d)
    k = 4
    mh = m_prev / (1 - B1**k)
    v = B2 * mh**2 + (1 - B2) * ghat**2
    m = B1 * m_prev + (1 - B1) * ghat
    theta = theta_prev * (1 - LR * WD) - LR * (m / (1 - B1**k)) / (np.sqrt(v) + EPS)
    np.testing.assert_allclose(mb.flat(), theta, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(mb.sync.flatten(mb.moment()).numpy()[off], B1 * m_prev[off], rtol=1e-6)


def test_error_feedback_off_drops_the_rest():
    grads = make_grads(6, 2, seed=3)
    ref = ref_run(grads, 0.9, ef=False)
    members, _ = run_members(grads, 0.9, ef=False)
    assert float(members[0].sync.residual.abs().sum()) == 0.0
    np.testing.assert_allclose(members[0].flat(), ref[-1][0], rtol=1e-5, atol=1e-6)
    with_ef, _ = run_members(grads, 0.9, ef=True)
    assert float(with_ef[0].sync.residual.abs().sum()) > 0
    assert not np.allclose(with_ef[0].flat(), members[0].flat())


def test_missing_slice_rebuilt_locally():
    grads = make_grads(6, 3, seed=4)
    full, trace_full = run_members(grads, 0.8)
    lost, trace_lost = run_members(grads, 0.8, drop_shard_of=1)  # rank 1's slice never arrives
    for t in range(2, 6):
        assert 1 not in trace_lost[t][3].shards_given
        assert torch.equal(trace_full[t][1][0], trace_lost[t][1][0])  # the same masks all the same
    assert np.array_equal(full[0].flat(), lost[0].flat())
    # A worker that lost a slice and has no moment to rebuild it from goes dense next step (every member holds
    # the same moment, so all of them do alike; a lying sender cannot make it raise).
    mbs = [Member(w, 3, 0.8) for w in range(3)]
    for gs in grads[:2]:
        msgs = [mb.sync.plan(mb.sync.unflatten(torch.from_numpy(gs[w])), mb.moment()) for w, mb in enumerate(mbs)]
        synced = reduce(msgs)
        for mb in mbs:
            mb.step(mb.sync.apply(synced, mb.moment()))
    msgs = [mb.sync.plan(mb.sync.unflatten(torch.from_numpy(grads[2][w])), mb.moment()) for w, mb in enumerate(mbs)]
    msgs[2].mask_shard = None
    mbs[0].sync.apply(reduce(msgs), None)
    assert mbs[0].sync.mask is None


def test_bad_input_raises():
    sync = ScapeSync(SHAPES, rank=0, workers=2, sparsity=0.9)
    v = torch.zeros(NUMEL)
    with pytest.raises(ValueError, match="step"):
        reduce([ScapeMessage(0, 0, v, None), ScapeMessage(1, 1, v, None)])
    with pytest.raises(ValueError, match="values"):
        reduce([ScapeMessage(0, 0, v, None), ScapeMessage(1, 0, torch.zeros(3), None)])
    with pytest.raises(ValueError):
        reduce([])
    with pytest.raises(ValueError, match="step"):
        sync.apply(reduce([ScapeMessage(0, 1, v, None)]))
    with pytest.raises(ValueError, match="values"):
        sync.apply(reduce([ScapeMessage(0, 0, torch.zeros(5), None)]))
    for kw in (dict(sparsity=1.0), dict(sparsity=-0.1), dict(rank=2)):
        with pytest.raises(ValueError):
            ScapeSync(SHAPES, **{"rank": 0, "workers": 2, "sparsity": 0.9, **kw})


def test_indices_round_trip_and_bounds():
    idx = torch.tensor([0, 3, 4, 200, 70000])
    data = encode_indices(idx)
    assert torch.equal(decode_indices(data, 5, 70001), idx)
    with pytest.raises(Exception):  # noqa: B017 - the codec's error type
        decode_indices(data, 5, 70000)


def test_spec_fields():
    o = RunSpec().outer
    assert o.scape_sparsity == 0.9 and o.scape_error_feedback is True
    assert RunSpec().replace("outer", scape_sparsity=0.0).outer.scape_sparsity == 0.0
    for bad in (dict(scape_sparsity=1.0), dict(scape_sparsity=-0.01), dict(scape_error_feedback="yes")):
        with pytest.raises(ConfigError):
            RunSpec().replace("outer", **bad)


def test_train_step_is_compute_then_apply(nano_spec, nano_splits):
    from locomm.train import Trainer

    a, b = Trainer(nano_spec, splits=nano_splits), Trainer(nano_spec, splits=nano_splits)
    for _ in range(2):
        la = a.train_step()
        lb = b.compute_gradients()
        assert all(p.grad is not None for p in b.model.parameters()) and b.step == a.step - 1
        b.apply_gradients()
        assert la == lb
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


# -- the simulator -------------------------------------------------------------------------------------------


def test_simulator_runs_and_reports(nano_spec, nano_splits):
    from locomm.sim.scape import comparison, run_method

    spec = nano_spec.replace("outer", scape_sparsity=0.9, scape_dense_steps=2)
    res = {m: run_method(spec, 2, 6, m, splits=nano_splits, eval_every=3) for m in ("scape", "adams_ddp", "adamw_ddp")}
    res["topk_raw"] = run_method(spec.replace("outer", scape_sparsity=0.99), 2, 6, "topk_raw", splits=nano_splits)
    rows = {r["method"]: r for r in comparison(list(res.values()))}
    assert res["scape"].steps == [0, 3, 6] and all(math.isfinite(v) for v in res["scape"].val_loss)
    assert res["scape"].val_loss[-1] < res["scape"].val_loss[0]
    assert res["scape"].identical is True and res["adams_ddp"].identical is True
    assert rows["adams_ddp"]["bytes_vs_dense"] == 1.0 and rows["adams_ddp"]["vs_dense_adams"] == 0.0
    # 2 of 6 steps dense, 4 at 10% values + the mask slices
    assert 0.4 < rows["scape"]["bytes_vs_dense"] < 0.5 and res["scape"].mask_bytes > 0
    assert rows["topk_raw"]["bytes_vs_dense"] < 0.03
    assert res["adamw_ddp"].values_bytes >= res["adamw_ddp"].dense_bytes  # raw fp32 through the ddp path's codec
    assert res["scape"].sim_time_s < res["adams_ddp"].sim_time_s
    # SCAPE at sparsity 0 is dense AdamS DDP, step for step.
    dense = run_method(spec.replace("outer", scape_sparsity=0.0), 2, 6, "scape", splits=nano_splits, eval_every=3)
    assert dense.val_loss == res["adams_ddp"].val_loss


def test_cli_simulate_scape():
    from locomm.cli.local_commands import simulate

    args = ["--algo", "scape", "--workers", "2", "--sparsity", "0.99", "--rounds", "2", "--inner-steps", "2"]
    out = CliRunner().invoke(simulate, [*args, "--json", "--no-baselines"])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.output.strip().splitlines()[-1])
    assert (
        summary["sparsity"] == 0.99 and summary["steps"] == 4 and [r["method"] for r in summary["table"]] == ["scape"]
    )
    bad = CliRunner().invoke(simulate, ["--algo", "scape", "--sparsity", "1.0", "--rounds", "1"])
    assert bad.exit_code == 2 and "scape_sparsity" in bad.output
    wrong = CliRunner().invoke(simulate, ["--algo", "noloco", "--sparsity", "0.9"])
    assert wrong.exit_code == 2 and "--algo scape" in wrong.output


# -- the options that make SCAPE the method (issue 33): hold, residual decay, residual-fed masks, warm-up ----------


def test_hold_off_keeps_off_mask_coordinates_still_and_steps_the_rest_as_adams():
    torch.manual_seed(0)
    p0 = torch.randn(40)
    held, free = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    oh = AdamS([held], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    of = AdamS([free], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    on = torch.zeros(40, dtype=torch.bool)
    on[::3] = True
    for step in range(4):
        g = torch.randn(40)
        held.grad, free.grad = g.clone(), g.clone()
        if step >= 2:  # two dense steps build a moment, then two held ones
            m_before, p_before = oh.state[held]["exp_avg"].clone(), held.detach().clone()
            oh.hold_off({held: on})
        oh.step()
        of.step()
    # Off the mask: weight and first moment exactly as before the held steps (no decay, no stale momentum).
    assert torch.equal(held.detach()[~on], p_before[~on])
    assert torch.equal(oh.state[held]["exp_avg"][~on], m_before[~on])
    # On the mask the last step is AdamS's own (the held coordinates do not enter it).
    assert not torch.equal(held.detach()[on], p_before[on])
    assert oh._masks == {}  # one step only


def test_residual_decay_bounds_the_residual():
    shapes = {"w": (100,)}
    g = {"w": torch.ones(100)}
    grown = {}
    for decay in (1.0, 0.9):
        sync = ScapeSync(shapes, rank=0, workers=1, sparsity=0.99, residual_decay=decay)
        sync.mask = torch.tensor([0])
        for _ in range(200):
            sync.plan(g, None)
        grown[decay] = float(sync.residual[1:].max())
    assert grown[1.0] == 200.0  # never decayed: it grows with every step off the mask
    assert 9.9 < grown[0.9] <= 10.0  # bounded by max|g| / (1 - decay)


def test_a_coordinate_whose_residual_piles_up_comes_back_to_the_mask():
    shapes = {"w": (50,)}
    m = {"w": torch.linspace(1.0, 0.5, 50)}  # the moment ranks coordinate 0 first, 49 last
    for weight, back in ((0.0, False), (0.1, True)):
        sync = ScapeSync(shapes, rank=0, workers=1, sparsity=0.9, residual_weight=weight)
        sync.mask = torch.arange(5)
        g = torch.zeros(50)
        g[49] = 3.0  # coordinate 49's gradient is never sent: it piles up in the residual
        for _ in range(5):
            msg = sync.plan({"w": g}, m)
        assert (49 in msg.mask_shard.tolist()) is back


def test_dense_warm_up_sends_every_coordinate_for_its_steps():
    workers, d = 2, 5
    members = [Member(w, workers, 0.9) for w in range(workers)]
    for mb in members:
        mb.sync.dense_steps = d
    sent = []
    for gs in make_grads(8, workers, seed=4):
        msgs = [mb.sync.plan(mb.sync.unflatten(torch.from_numpy(gs[w])), mb.moment()) for w, mb in enumerate(members)]
        synced = reduce(msgs)
        for mb in members:
            mb.step(mb.sync.apply(synced, mb.moment()))
        sent.append(msgs[0].values.numel())
    assert sent[:d] == [NUMEL] * d and all(n < NUMEL for n in sent[d:])


def test_spec_options_reach_the_sync():
    outer = RunSpec.preset("nano").replace("outer", scape_residual_decay=0.8, scape_residual_weight=0.2).outer
    sync = ScapeSync.of_spec(SHAPES, outer, rank=0, workers=2)
    assert (sync.residual_decay, sync.residual_weight, sync.dense_steps) == (0.8, 0.2, outer.scape_dense_steps)
    for bad in (dict(scape_residual_decay=0.0), dict(scape_residual_weight=-1.0), dict(scape_dense_steps=-1)):
        with pytest.raises(ConfigError):
            RunSpec.preset("nano").replace("outer", **bad)
