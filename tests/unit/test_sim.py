import json
import math
import subprocess
import sys

import numpy as np
import pytest

from locomm.config import ConfigError
from locomm.protocol.timing import Limits
from locomm.sim import NetworkModel, Schedule, Simulator, network_for, parse_link, replay, time_to_target
from locomm.sim.flows import Flow, FlowLimits, maxmin_rates, run_flows
from locomm.sim.network import RoundRecord


def test_parse_link():
    assert parse_link("80mbit") == 80e6
    assert parse_link("10Gbit/s") == 10e9
    assert parse_link("1.5gbit") == 1.5e9
    with pytest.raises(ValueError, match="link speed"):
        parse_link("fast")


def test_ring_and_direct_formulas():
    net = NetworkModel.build(4, link_bps=8e6, latency_s=0.01, heterogeneity=0.0, step_s=0.1)
    # 2(N-1) steps, each: latency + (S/N) bytes at 1 MB/s.
    assert net.ring_allreduce_s([0, 1, 2, 3], 4e6) == pytest.approx(6 * (0.01 + 1.0))
    assert net.ring_allgather_s([0, 1, 2, 3], {m: 1e6 for m in range(4)}) == pytest.approx(3 * 0.01 + 3.0)
    # A pair exchanging 1 MB each way: latency + 1 s.
    assert net.direct_exchange_s(0, [1], {0: 1e6, 1: 1e6}, {0: 1, 1: 1}) == pytest.approx(1.01)
    assert net.direct_exchange_s(0, [], {0: 1e6}, {}) == 0.0


def test_heterogeneity_spreads_speeds():
    net = NetworkModel.build(64, link_bps=1e8, latency_s=0.0, heterogeneity=1.0, step_s=1.0, seed=3)
    assert min(net.up_bps) >= 1e7 and max(net.up_bps) <= 1e8
    assert max(net.speed) / min(net.speed) > 3
    with pytest.raises(ValueError):
        NetworkModel.build(4, link_bps=1e8, latency_s=0.0, heterogeneity=-1, step_s=1.0)


def test_barrier_vs_pairs_with_a_straggler():
    """The all-reduce waits on the slowest worker every round; pairs wait only on their partner."""
    net = NetworkModel(up_bps=(1e9,) * 4, down_bps=(1e9,) * 4, speed=(1.0, 1.0, 1.0, 0.1), latency_s=0.0, step_s=0.1)
    members = [0, 1, 2, 3]
    allreduce = [RoundRecord(steps=1, bytes_sent={m: 0 for m in members}, kind="allreduce", peers={}, members=members)]
    pairs = [
        RoundRecord(
            steps=1,
            bytes_sent={m: 0 for m in members},
            kind="direct",
            peers={0: [1], 1: [0], 2: [3], 3: [2]},
            members=members,
        )
    ]
    tl_ar, _ = replay(allreduce, net, 4, overlap=False)
    tl_p, _ = replay(pairs, net, 4, overlap=False)
    assert tl_ar.clock == pytest.approx([1.0] * 4)
    assert tl_p.clock == pytest.approx([0.1, 0.1, 1.0, 1.0])
    assert tl_ar.compute_utilisation()[0] == pytest.approx(0.1) and tl_p.compute_utilisation()[3] == 1.0


def test_maxmin_fair_rates():
    # Flows 0->1 and 0->2 share 0's uplink (2); 0->2 and 3->2 share 2's downlink (3).
    rates = maxmin_rates(np.array([0, 0, 3]), np.array([1, 2, 2]), np.array([2.0, 9, 9, 9]), np.array([9, 9, 3.0, 9]))
    assert rates == pytest.approx([1.0, 1.0, 2.0])


def test_flows_share_links_and_slow_ones_are_cut():
    flows = [Flow(0, 1, 1e6, 0.0), Flow(2, 1, 1e6, 0.0)]  # two senders into one 1 MB/s downlink
    run_flows(flows, [1e7, 1e7, 1e7], [1e7, 1e6, 1e7])
    assert [f.done for f in flows] == pytest.approx([2.0, 2.0])
    # Below the floor rate (100 kB/s) for a whole 2 s window: cut at 2 s, never delivered.
    slow = [Flow(0, 1, 1e6, 1.0), Flow(2, 3, 1e6, 1.0)]
    run_flows(slow, [5e4, 1e7, 1e6, 1e7], [1e7] * 4, FlowLimits(floor_Bps=1e5, window_s=2.0, request_timeout_s=30))
    assert slow[0].cut == pytest.approx(3.0) and math.isinf(slow[0].done)
    assert slow[1].done == pytest.approx(2.0) and math.isinf(slow[1].cut)


def test_flows_in_turn_start_when_the_one_before_ends_or_one_turn_after_it_began():
    """The daemon's pushes in turn (``gossip.Gossip._pushes_in_turn``): 0 sends 1 MB to 1, then to 2, over a
    1 MB/s uplink; the second starts when the first is done (1 s), or at ``turn_s`` if the first is slower
    (1's downlink at 0.25 MB/s: the first would take 4 s, the second starts at 1.5 s and they share)."""
    first = Flow(0, 1, 1e6, 0.0)
    second = Flow(0, 2, 1e6, 0.0, after=first, turn_s=1.5)
    run_flows([first, second], [1e6] * 3, [1e7] * 3)
    assert (first.done, second.start, second.done) == pytest.approx((1.0, 1.0, 2.0))
    first = Flow(0, 1, 1e6, 0.0)
    second = Flow(0, 2, 1e6, 0.0, after=first, turn_s=1.5)
    run_flows([first, second], [1e6] * 3, [1e7, 0.25e6, 1e7])
    # to 1.5 s the first moves 0.375 MB; then 0.25 + 0.75 MB/s: the second is done at 1.5 + 1/0.75
    assert second.start == pytest.approx(1.5) and second.done == pytest.approx(1.5 + 1 / 0.75)
    assert first.done == pytest.approx(4.0)
    late = Flow(0, 2, 1e6, 5.0, after=Flow(0, 1, 0.0, 0.0), turn_s=1.5)  # never before its own start
    run_flows([late.after, late], [1e6] * 3, [1e7] * 3)
    assert late.start == pytest.approx(5.0) and late.done == pytest.approx(6.0)


def test_butterfly_allreduce_by_hand():
    """4 workers, hivemind's butterfly: group assembly, parts exchanged in parallel, the slowest member."""
    mbit = 1e6
    net = NetworkModel(
        up_bps=(80 * mbit, 80 * mbit, 40 * mbit, 20 * mbit),
        down_bps=(80 * mbit, 80 * mbit, 40 * mbit, 20 * mbit),
        speed=(1.0, 1.0, 1.0, 0.5),
        latency_s=0.01,
        step_s=1.0,
    )
    S = 4e6  # bytes per member: each link carries 2 * S * 3/4 = 6 MB = 48 Mbit; the 20 Mbit member takes 2.4 s
    assert net.butterfly_allreduce_s([0, 1, 2, 3], S) == pytest.approx(48 / 20 + 2 * 0.01)
    rec = RoundRecord(steps=2, bytes_sent={m: S for m in range(4)}, kind="butterfly", peers={}, members=[0, 1, 2, 3])
    sched = Schedule(net, 4, overlap=True, deadlines=Limits(request_timeout_s=30.0))
    got = sched.step(rec)
    # Ready at 2, 2, 2, 4 (worker 3 computes at half speed); assembled when the last arrives + 6 latencies.
    assert sched.tl.plans[0] == pytest.approx([2, 2, 2, 4])
    assert sched.tl.ends[0] == pytest.approx([4 + 0.06 + 2.42] * 4)
    assert got == [{1, 2, 3}, {0, 2, 3}, {0, 1, 3}, {0, 1, 2}]
    # With overlap the next round computes meanwhile and plans at max(end of compute, end of the exchange).
    sched.step(rec)
    assert sched.tl.plans[1] == pytest.approx([6.48, 6.48, 6.48, 8.0])
    assert sched.tl.ends[1] == pytest.approx([8.0 + 0.06 + 2.42] * 4)
    assert sched.tl.compute_utilisation() == pytest.approx([4 / 10.48] * 3 + [8 / 10.48])
    # A step timeout of 1.5 s: worker 3 (ready at 4) misses the group, which assembles at 2 + 1.5 without it.
    sched = Schedule(net, 4, overlap=True, deadlines=Limits(request_timeout_s=1.5))
    got = sched.step(rec)
    three = 2 * S * (2 / 3) * 8 / (40 * mbit) + 0.02
    assert sched.tl.ends[0] == pytest.approx([3.5 + 0.06 + three] * 3 + [4 + 1.5])
    assert got == [{1, 2}, {0, 2}, {0, 1}, set()]
    # No overlap: the second round starts at the end of the first exchange.
    sched = Schedule(net, 4, overlap=False, deadlines=Limits())
    sched.step(rec)
    sched.step(rec)
    assert sched.tl.plans[1] == pytest.approx([6.48 + 2] * 3 + [6.48 + 4])


def test_a_late_partner_is_skipped_at_its_eta(nano_spec, nano_splits):
    """Worker 1 computes 1000x slower: worker 0 goes on without it at the ETA, worker 1 still gets 0's payload,
    and a replay of the network-free run on that network says its numerics would differ."""
    spec = (
        nano_spec.replace("outer", algo="noloco", inner_steps=2)
        .replace("train", steps=4, eval_batches=1)
        .replace("network", stall_timeout_s=0.5)
    )
    net = NetworkModel(up_bps=(1e9, 1e9), down_bps=(1e9, 1e9), speed=(1.0, 0.001), latency_s=0.001, step_s=0.01)
    live = Simulator(spec, 2, splits=nano_splits, network=net, codec="none")
    res = live.run(2)
    assert res.records[0].answered == {0: [], 1: [0]}
    assert res.timeline.skipped >= 1
    ideal = Simulator(spec, 2, splits=nano_splits, codec="none").run(2)
    assert ideal.records[0].answered is None and ideal.final_val_loss != res.final_val_loss
    from locomm.sim import replay_on

    assert replay_on(ideal, net).mismatches >= 1
    assert replay_on(res, net).mismatches == 0


@pytest.mark.parametrize("algo", ["ddp", "diloco", "noloco", "gasloc"])
def test_every_algorithm_learns(nano_spec, nano_splits, algo):
    spec = nano_spec.replace("outer", algo=algo, inner_steps=5).replace("train", steps=20, eval_batches=2)
    sim = Simulator(spec, 3, splits=nano_splits)
    res = sim.run(4)
    assert res.val_loss[-1] < res.val_loss[0] - 1.0
    assert len(res.records) == (20 if algo == "ddp" else 4)
    assert min(res.bytes_sent) > 0
    run = network_for(res, link_bps=80e6, latency_s=0.02, heterogeneity=0.5, step_s=0.01)
    wall, done = run.wall_s, run.round_done
    assert wall > 0 and 0 < run.utilisation_min <= run.utilisation_mean <= 1 and done == sorted(done)
    assert run.mismatches == 0  # nano payloads: no deadline fires on this network
    first = min(i for i, v in enumerate(res.val_loss) if v <= res.val_loss[-1])
    assert time_to_target(res, done, res.val_loss[-1]) == res.curve_times(done)[first] > 0
    assert time_to_target(res, done, 0.0) == math.inf


def test_diloco_workers_agree_noloco_workers_stay_close(nano_spec, nano_splits):
    spec = nano_spec.replace("outer", algo="diloco", inner_steps=5).replace("train", steps=15, eval_batches=1)
    d = Simulator(spec, 4, splits=nano_splits)
    d.run(3)
    assert d.weight_distance() < 1e-4
    n = Simulator(spec.replace("outer", algo="noloco"), 4, splits=nano_splits)
    n.run(3)
    assert 0 < n.weight_distance()


def test_bad_simulations_are_clear_errors(nano_spec, nano_splits):
    with pytest.raises(ConfigError, match="group_size"):
        Simulator(nano_spec.replace("outer", algo="noloco", group_size=5), 4, splits=nano_splits)
    with pytest.raises(ConfigError, match="workers"):
        Simulator(nano_spec.replace("outer", algo="noloco"), 1, splits=nano_splits)
    with pytest.raises(ConfigError, match="single-node"):
        Simulator(nano_spec, 4, splits=nano_splits)


def test_cli_simulate_json(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "locomm.cli.main",
            "simulate",
            "--algo",
            "gasloc",
            "--workers",
            "2",
            "--rounds",
            "2",
            "--inner-steps",
            "3",
            "--heterogeneity",
            "0.5",
            "--sharding",
            "contiguous",
            "--seed",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "algo",
        "workers",
        "final_val_loss",
        "bytes_sent_per_worker",
        "sim_wall_clock_s",
        "compute_utilisation",
        "overlap",
    ):
        assert key in s
    assert s["workers"] == 2 and s["final_val_loss"] < s["initial_val_loss"] and s["overlap"] is True
    assert (s["sharding"], s["seed"], s["outer_seed"]) == ("contiguous", 3, 3)  # --seed varies the grouping too
    assert 0 < s["compute_utilisation"]["min"] <= s["compute_utilisation"]["mean"] <= 1
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "locomm.cli.main",
            "simulate",
            "--algo",
            "noloco",
            "--workers",
            "2",
            "--inner-steps",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "inner_steps" in bad.stderr and "Traceback" not in bad.stderr
