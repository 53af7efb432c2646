import json
import math
import subprocess
import sys

import pytest

from locomm.config import ConfigError
from locomm.sim import NetworkModel, Simulator, network_for, parse_link, replay, time_to_target
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
    net = NetworkModel(up_bps=(1e9,) * 4, down_bps=(1e9,) * 4, speed=(1.0, 1.0, 1.0, 0.1), latency_s=0.0,
                       step_s=0.1)
    members = [0, 1, 2, 3]
    allreduce = [RoundRecord(steps=1, bytes_sent={m: 0 for m in members}, kind="allreduce", peers={},
                             members=members)]
    pairs = [RoundRecord(steps=1, bytes_sent={m: 0 for m in members}, kind="direct",
                         peers={0: [1], 1: [0], 2: [3], 3: [2]}, members=members)]
    tl_ar, _ = replay(allreduce, net, 4)
    tl_p, _ = replay(pairs, net, 4)
    assert tl_ar.clock == pytest.approx([1.0] * 4)
    assert tl_p.clock == pytest.approx([0.1, 0.1, 1.0, 1.0])
    assert tl_ar.idle[0] == pytest.approx(0.9) and tl_p.idle[0] == 0.0


@pytest.mark.parametrize("algo", ["ddp", "diloco", "noloco", "gasloc"])
def test_every_algorithm_learns(nano_spec, nano_splits, algo):
    spec = nano_spec.replace("outer", algo=algo, inner_steps=5).replace("train", steps=20, eval_batches=2)
    sim = Simulator(spec, 3, splits=nano_splits)
    res = sim.run(4)
    assert res.val_loss[-1] < res.val_loss[0] - 1.0
    assert len(res.records) == (20 if algo == "ddp" else 4)
    assert min(res.bytes_sent) > 0
    wall, done, idle = network_for(res, link_bps=80e6, latency_s=0.02, heterogeneity=0.5, step_s=0.01)
    assert wall > 0 and 0 <= idle < 1 and done == sorted(done)
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
    out = subprocess.run([sys.executable, "-m", "locomm.cli.main", "simulate", "--algo", "gasloc", "--workers", "2",
                          "--rounds", "2", "--inner-steps", "3", "--heterogeneity", "0.5", "--json"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("algo", "workers", "final_val_loss", "bytes_sent_per_worker", "sim_wall_clock_s", "idle_fraction"):
        assert key in s
    assert s["workers"] == 2 and s["final_val_loss"] < s["initial_val_loss"]
    bad = subprocess.run([sys.executable, "-m", "locomm.cli.main", "simulate", "--algo", "noloco", "--workers", "2",
                          "--inner-steps", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "inner_steps" in bad.stderr and "Traceback" not in bad.stderr
