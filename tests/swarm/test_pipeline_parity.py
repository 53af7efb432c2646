"""The pipeline simulator runs the stage daemon's schedule: a real pipeline swarm ends on its weights.

Real `locomm-peer join --stage K` processes on loopback and ``sim.pipeline.PipelineSim`` train
the same spec: one micro-batch in flight, the daemon's seeded routing over the peers' own ids,
replica syncs by the data clock and applied one round late (``protocol/rounds.py``). Each stage
replica's final weights agree to float tolerance.

Held at 2 stages x 1 replica. With 2 replicas per stage the daemon is not deterministic: a
stage-1 replica serves micro-batches from both stage-0 replicas in whatever order they arrive
(which sets which micro-batches share its optimizer steps); the simulator fixes it to the order
(step, micro-batch, stage-0 replica). A replica applies and plans its sync before it answers the
micro-batch that made it due, so the sync itself falls at a fixed point of the data clock.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from locomm.config import RunSpec
from locomm.sim.pipeline import PipelineSim
from locomm.testing.launcher import Launcher

pytestmark = pytest.mark.timeout(240)
STAGES, REPLICAS = 2, int(os.environ.get("LOCOMM_PARITY_REPLICAS", "1"))


def parity_spec(tmp: Path) -> tuple[RunSpec, Path]:
    spec = RunSpec.preset("nano").replace("data", batch_size=4, seq_len=32, max_corpus_mb=1.0)
    spec = spec.replace("train", steps=6, eval_batches=1, eval_interval=0).replace("inner", warmup_steps=2)
    spec = spec.replace("outer", algo="noloco", inner_steps=2)
    spec = spec.replace(
        "network", request_timeout_s=10.0, stall_timeout_s=5.0, heartbeat_interval_s=1.0, heartbeat_ttl_s=10.0
    )
    spec = spec.replace("pipeline", stages=STAGES, micro_batch_size=2, in_flight=1, stage_timeout_s=20.0)
    path = tmp / "pipe.toml"
    spec.save(path)
    return spec, path


def test_pipeline_swarm_matches_the_pipeline_simulator(launcher: Launcher, tmp_path: Path) -> None:
    spec, cfg = parity_spec(tmp_path)
    n = STAGES * REPLICAS
    common = ("--wait-for-peers", str(n), "-q")
    peers = {}
    first = None
    for s in range(STAGES):
        for r in range(REPLICAS):
            name = f"s{s}r{r}"
            args = ("--stage", str(s), "--shard", f"{r}/{REPLICAS}", *common)
            peers[(s, r)] = launcher.start(name, *args, config=cfg, initial_peers=first, weights=True)
            if first is None:
                first = peers[(s, r)].address()
    for p in peers.values():
        assert p.wait(200) == 0, p.tail()
    ids = {k: p.events("started")[0]["peer"] for k, p in peers.items()}
    names = [[ids[(s, r)] for r in range(REPLICAS)] for s in range(STAGES)]
    sim = PipelineSim(spec, REPLICAS, names=names)
    sim.run(spec.train.steps)
    blocking = PipelineSim(spec, REPLICAS, names=names, overlap=False)
    blocking.run(spec.train.steps)
    for (s, r), p in peers.items():
        fin = p.events("finished")[0]
        assert fin["microbatches_lost"] == 0 and fin["interrupted"] is False, fin
        net = load_file(str(p.weights))
        mine = sim.workers[r][s].params()
        assert set(net) == set(mine)
        for k, v in mine.items():
            err = float((net[k] - v.detach()).abs().max())
            assert torch.allclose(net[k], v.detach(), atol=1e-5, rtol=0), (s, r, k, err)
        # ... and the schedule matters: replica syncs applied at once end elsewhere.
        other = blocking.workers[r][s].params()
        assert max(float((net[k] - other[k].detach()).abs().max()) for k in net) > 1e-4
