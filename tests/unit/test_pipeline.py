"""Pipeline stages in one process: the split equals the unsplit constrained model, the invariant holds,
the wire codes what it should, the simulator trains, and activation frames are validated."""

from __future__ import annotations

import pytest
import torch

from locomm.compression.base import CodecError
from locomm.compression.boundary import BoundaryCoder, NonFinite
from locomm.config import ConfigError, RunSpec
from locomm.model.stages import ConstrainedModel, Geometry, build_stages, stage_layers
from locomm.train.stage import StageWorker

pytestmark = pytest.mark.timeout(300)


def nano_spec(stages: int = 2, layers: int = 4, subspace: bool = True, **pipe) -> RunSpec:
    spec = RunSpec.preset("nano").replace("model", n_layers=layers)
    spec = spec.replace("data", batch_size=4, seq_len=32, max_corpus_mb=1.0)
    return spec.replace("pipeline", stages=stages, micro_batch_size=2, subspace=subspace, **pipe)


def window(spec: RunSpec, batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, spec.data.seq_len + 1), generator=g)


def test_stage_layers_even_split_and_explicit():
    assert stage_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layers(8, 3) == [range(0, 3), range(3, 6), range(6, 8)]
    assert stage_layers(8, 2, (3, 5)) == [range(0, 3), range(3, 8)]
    with pytest.raises(ValueError):
        stage_layers(4, 2, (1, 1))


def test_pipeline_config_is_validated():
    with pytest.raises(ConfigError, match="pipeline.layers"):
        RunSpec.preset("nano").replace("pipeline", stages=2, layers=(1, 2))
    with pytest.raises(ConfigError, match="micro_batch_size"):
        RunSpec.preset("nano").replace("pipeline", stages=2, micro_batch_size=3)
    spec = RunSpec.from_toml(nano_spec().to_toml())
    assert spec.pipeline.stages == 2 and spec.hash() == nano_spec().hash()
    with pytest.raises(ConfigError, match="free_tail_layers"):
        RunSpec.preset("nano").replace("pipeline", stages=2, free_tail_layers=-2)
    # Unconstrained blocks: by default the whole last stage (only blocks before the last boundary must write
    # into span(U)); free_tail_layers = 2 is node0's rule.
    tiny = RunSpec.preset("tiny").replace("pipeline", stages=2)
    assert Geometry.of(tiny).free_layers() == {4, 5, 6, 7}
    assert Geometry.of(tiny.replace("pipeline", free_tail_layers=2)).free_layers() == {6, 7}
    assert Geometry.of(tiny.replace("pipeline", stages=4, free_tail_layers=9)).free_layers() == {6, 7}


@pytest.mark.parametrize("stages", [2, 4])
def test_split_equals_unsplit_loss_and_gradients(stages):
    spec = nano_spec(stages=stages)
    geo = Geometry.of(spec)
    split = build_stages(spec, geo)
    ref = ConstrainedModel(build_stages(spec, geo))
    coder = BoundaryCoder(spec, geo)
    w = window(spec, 4)
    x, y = w[:, :-1], w[:, 1:]

    loss_ref = ref(x, y)
    loss_ref.backward()

    # The split run: each boundary through the real codecs, forward and backward.
    outs, leaves = [], []
    h = None
    for st in split:
        leaf = None
        if h is not None:
            leaf = coder.decode_activation(coder.encode_activation(h, x), x).requires_grad_(True)
        out = st(x, leaf)
        leaves.append(leaf)
        outs.append(out)
        h = out.detach()
    loss = split[-1].loss(outs[-1], y)
    loss.backward()
    for s in range(stages - 2, -1, -1):
        g = coder.decode_gradient(coder.encode_gradient(leaves[s + 1].grad, x), x)
        outs[s].backward(g)

    assert abs(float(loss) - float(loss_ref)) < 1e-5
    for st, st_ref in zip(split, ref.stages):
        ref_params = dict(st_ref.named_parameters())
        for name, p in st.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, atol=1e-5, rtol=0)


def test_projection_invariant_after_100_steps():
    spec = nano_spec(stages=2).replace("inner", lr=1e-2, warmup_steps=5)
    geo = Geometry.of(spec)
    workers = [StageWorker(spec, s, geo=geo) for s in range(2)]
    coder = BoundaryCoder(spec, geo)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only contends with other work (5x slower under load)
    try:
        for step in range(100):
            w = window(spec, 2, seed=step)
            x, y = w[:, :-1], w[:, 1:]
            for _ in range(workers[0].micro_per_step):
                h = workers[0].forward(step, x)
                _, g = workers[1].forward_backward(x, y, coder.decode_activation(coder.encode_activation(h, x), x))
                workers[0].backward(step, coder.decode_gradient(coder.encode_gradient(g, x), x))
            assert all(wk.maybe_step() for wk in workers)
    finally:
        torch.set_num_threads(threads)
    x = window(spec, 2, seed=999)[:, :-1]
    with torch.no_grad():
        h = workers[0].module(x)
    assert workers[0].module.residual_norm(h, x) < 1e-5
    # The boundary's reconstruction from k numbers per token is exact.
    rebuilt = coder.decode_activation(coder.encode_activation(h, x), x)
    assert float((rebuilt - h).norm() / h.norm()) < 1e-5
    # The tail's last two layers are free (not projected): their writes leave span(U).
    wo = dict(workers[1].module.named_parameters())["layers.3.attn.wo.weight"]
    U = geo.U
    assert float((wo - U @ (U.T @ wo)).norm() / wo.norm()) > 1e-2


def test_wire_bytes_and_bad_input():
    spec = nano_spec().replace(
        "compression", activation="subspace+bf16+lossless", act_gradient="subspace+bf16+lossless"
    )
    geo = Geometry.of(spec)
    coder = BoundaryCoder(spec, geo)
    plain = BoundaryCoder(spec, Geometry.of(spec, subspace=False))
    assert coder.act_stack == "subspace+bf16+lossless" and plain.act_stack == "bf16+lossless"
    st = build_stages(spec, geo)[0]
    w = window(spec, 2)
    x = w[:, :-1]
    with torch.no_grad():
        h = st(x)
    small, big = coder.encode_activation(h, x), plain.encode_activation(h, x)
    tokens = x.numel()
    assert len(small) / tokens < 2 * geo.k + 8  # bf16 z (2k bytes) plus framing, lossless on top
    assert len(big) / tokens > 1.2 * geo.d  # bf16 h: about 2 d bytes before lossless coding
    tok = coder.encode_window(w)
    assert torch.equal(coder.decode_window(tok, 2, spec.data.seq_len), w)
    with pytest.raises(CodecError):
        coder.decode_window(tok[:-2], 2, spec.data.seq_len)
    with pytest.raises(CodecError):
        coder.decode_activation(b"garbage" * 10, x)
    with pytest.raises(CodecError):  # right bytes, wrong micro-batch shape
        coder.decode_activation(small, window(spec, 1)[:, :-1])
    with pytest.raises(NonFinite):
        plain.decode_gradient(plain.encode_gradient(torch.full_like(h, float("nan")), x), x)


def test_replay_bubble_matches_the_1f1b_formula():
    """One replica, S=2, M=4 micro-batches all in flight, free network: bubble = (S-1)/(M+S-1)."""
    from locomm.sim.pipeline import MicroTrace, PipelineResult, replay

    res = PipelineResult(stages=2, replicas=1, steps=1, tokens_per_step=4, subspace=True, k=2, tokens_per_micro=1)
    res.traces = [[MicroTrace(0, (0, 0), (0,), (0,)) for _ in range(4)]]
    tl = replay(res, fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0], link_bps=1e12, latency_s=0.0, in_flight=4)
    assert tl.wall_s == pytest.approx(15.0)
    assert tl.bubble_fraction() == pytest.approx(1 / 5)
    assert 0 < tl.overlap_share[0] < 1 and 0 < tl.overlap_share[1] < 1
    # One micro-batch at a time: the stages never compute together.
    serial = replay(res, fwd_s=[1.0, 1.0], bwd_s=[2.0, 2.0], link_bps=1e12, latency_s=0.0, in_flight=1)
    assert serial.overlap_share == {0: 0.0, 1: 0.0} and serial.bubble_fraction() == pytest.approx(0.5)


def test_pipeline_simulator_2x2_trains_and_syncs_replicas():
    from locomm.sim.pipeline import PipelineSim, summarize

    spec = nano_spec(stages=2, layers=2).replace("outer", algo="noloco", inner_steps=3)
    spec = spec.replace("train", steps=6, eval_batches=2).replace("inner", warmup_steps=2)
    sim = PipelineSim(spec, 2)
    res = sim.run(6)
    out = summarize(sim, res, link_bps=80e6, latency_s=0.03, tflops=10.0)
    assert out["final_val_loss"] < out["initial_val_loss"] - 0.3
    assert len(res.sync_steps) == 2 and out["outer_algo"] == "noloco"
    # Every micro-batch crossed the boundary: bf16-free default stack, fp32 z (4k bytes) + uint16 tokens, coded.
    assert 0 < out["bytes_per_token_per_boundary"] < 2 * (4 * sim.geo.k + 2 + 2)
    assert 0 <= out["bubble_fraction"] < 1 and out["tokens_per_s"] > 0
    # Replicas of a stage stay close after a NoLoCo round; both replicas' stage-0 weights still in span(U).
    x = window(spec, 2)[:, :-1]
    with torch.no_grad():
        for r in range(2):
            m = sim.workers[r][0].module
            assert m.residual_norm(m(x), x) < 1e-5


def test_status_shows_stage_replicas():
    from rich.console import Console

    from locomm.cli.status import render

    peers = [
        {
            "peer": f"12D3Koo{i}xxxxxxxxxx",
            "round": 1,
            "step": 3,
            "loss": 2.0 if s == 0 else None,
            "stage": s,
            "mb_per_s": 1.5,
            "rerouted": i,
            "lost": 0,
            "heartbeat_age_s": 1.0,
            "state": "paused" if i == 1 else "training",
        }
        for i, s in enumerate([0, 0, 1])
    ]
    console = Console(width=200, record=True)
    console.print(render({"run": "r", "peers": peers}))
    text = console.export_text()
    assert "2 stages, 3 stage replicas" in text and "mb/s" in text and "re-routed" in text
    assert text.count("paused") == 1 and text.count("training") == 2  # a paused replica says so


def test_stage_auto_picks_the_stage_with_fewest_fresh_replicas():
    from locomm.protocol.membership import Heartbeat, pick_stage

    def beat(peer: str, stage: int, age: float, **f) -> Heartbeat:
        return Heartbeat.parse(peer, {"stage": stage, "time": 100.0 - age, **f}, 1e9)

    beats = [
        beat("a", 0, 1),
        beat("b", 0, 1),
        beat("c", 1, 1),
        beat("d", 1, 20),
        beat("e", 2, 1),
        beat("f", 2, 1, finished=True),
        beat("g", -1, 1),
    ]
    assert pick_stage(beats, 3, "me", now=100.0) == 2  # the finished one does not count
    assert pick_stage(beats, 3, "me", fresh_s=5.0, now=100.0) == 1  # d's heartbeat is 20 s old: dead
    assert pick_stage([], 2, "me") == 0
    # A paused replica serves nothing: stage 0 with one of its two paused has fewer serving replicas than stage 2.
    paused = [beat("a", 0, 1), beat("b", 0, 1, paused=True), beat("c", 1, 1), beat("e", 2, 1)]
    assert pick_stage(paused, 3, "me", now=100.0) == 0


def test_simulate_pipeline_cli_json(tmp_path):
    import json
    import subprocess
    import sys

    cfg = tmp_path / "run.toml"
    nano_spec(stages=2, layers=2).replace("train", eval_batches=1).save(cfg)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "locomm.cli.main",
            "simulate",
            "--pipeline",
            "2x2",
            "--config",
            str(cfg),
            "--rounds",
            "1",
            "--inner-steps",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["stages"] == 2 and r["replicas"] == 2 and r["steps"] == 2 and r["subspace"] is True
    for key in ("final_val_loss", "tokens_per_s", "bubble_fraction", "bytes_per_token_per_boundary"):
        assert isinstance(r[key], float), key
    bad = subprocess.run(
        [sys.executable, "-m", "locomm.cli.main", "simulate", "--pipeline", "2by2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "STAGESxREPLICAS" in bad.stderr


def test_the_pipeline_simulator_schedules_rounds_as_the_stage_daemon_does():
    """sim/pipeline.py describes the pipeline daemon: the same round schedule, the run spec's defence included."""
    from locomm.peer.pipeline.stage import Stage
    from locomm.protocol import build_outer
    from locomm.sim.pipeline import PipelineSim

    spec = nano_spec(stages=2, layers=2).replace("outer", algo="noloco", inner_steps=3, apply_delay_steps=1)
    spec = spec.replace("defence", factor=5.0, window=7)
    sim = PipelineSim(spec, 2)
    for s, row in enumerate(sim.rounds):
        for r, rounds in enumerate(row):
            daemon = Stage.schedule(build_outer(spec.outer, sim.workers[r][s].params(), "p"), spec)
            assert rounds.defence.cfg == daemon.defence.cfg == spec.defence
            assert (rounds.at, rounds.overlap) == (daemon.at, daemon.overlap)
