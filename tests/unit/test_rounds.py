"""protocol/rounds.py: the one-round-late apply against an independent reference, and the schedule."""

from __future__ import annotations

import pytest
import torch

from locomm.config import OuterConfig
from locomm.protocol import NoLoCo
from locomm.protocol.rounds import RECEIVE_WINDOW, Rounds, apply_blocking, apply_late, apply_step, in_window, plan


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _reference(alpha, beta, phi, m, sent, now, partners):
    """NoLoCo (gamma = alpha) on the sent weights, then theta = phi_new + (theta_now - theta_sent)."""
    out, phis, ms = {}, {}, {}
    for k in phi:
        mean = (sent[k] + sum(p[k] for p in partners)) / (1 + len(partners))
        ms[k] = beta * m[k] + alpha * (mean - phi[k])
        phis[k] = phi[k] + ms[k]
        out[k] = phis[k] + (now[k] - sent[k])
    return out, phis, ms


def test_apply_late_keeps_local_progress() -> None:
    cfg = OuterConfig(algo="noloco", lr=0.7, noloco_beta=0.5, group_size=2)
    start = _params(0)
    params = {k: v.clone() for k, v in start.items()}
    algo = NoLoCo(cfg, params, 0)
    with torch.no_grad():  # a round of local progress, then the plan
        for p in params.values():
            p.add_(0.1)
    planned = plan(algo, 0, [0, 1], params)
    assert planned.exchange.peers == [1]
    sent = {k: v.clone() for k, v in params.items()}
    assert all(torch.equal(planned.sent[k], sent[k]) for k in sent)
    with torch.no_grad():  # the next round computes while the exchange is in flight
        for p in params.values():
            p.mul_(1.01).sub_(0.02)
    now = {k: v.clone() for k, v in params.items()}
    partner = {k: v + 0.3 for k, v in _params(1).items()}
    received = planned.received(0, {1: {f"theta/{k}": v for k, v in partner.items()}})
    apply_late(algo, 0, params, planned.sent, received)
    zeros = {k: torch.zeros_like(v) for k, v in start.items()}
    want, phi, _ = _reference(0.7, 0.5, start, zeros, sent, now, [partner])
    for k in params:
        torch.testing.assert_close(params[k], want[k], atol=1e-6, rtol=0)
        torch.testing.assert_close(algo.phi[k], phi[k], atol=1e-6, rtol=0)


def test_blocking_is_the_outer_update() -> None:
    cfg = OuterConfig(algo="noloco", lr=0.7, noloco_beta=0.5, group_size=2)
    params = _params(2)
    algo = NoLoCo(cfg, params, 0)
    planned = plan(algo, 3, [0], params)  # alone: a local step
    apply_blocking(algo, planned, params, planned.received(0, {}))
    for k in params:  # no progress since the plan: theta = phi_new
        torch.testing.assert_close(params[k], algo.phi[k], atol=1e-6, rtol=0)


def test_apply_step() -> None:
    assert apply_step(10) == 10
    assert apply_step(10, 3) == 3
    assert apply_step(10, 10) == 10 and apply_step(10, 25) == 10
    assert in_window(4, 5) and in_window(6, 5) and not in_window(7, 5)
    assert RECEIVE_WINDOW == 1


def test_rounds_schedule() -> None:
    cfg = OuterConfig(algo="noloco", lr=0.7, noloco_beta=0.5, group_size=2)
    params = _params(3)
    r = Rounds(NoLoCo(cfg, params, 0), 4, apply_delay_steps=2)
    assert not r.due(2) and r.settle(params) is None
    planned = r.start(0, [0], params)
    with pytest.raises(RuntimeError):
        r.start(1, [0], params)
    assert not r.due(1) and r.due(2)
    with pytest.raises(RuntimeError):  # nothing arrived yet
        r.settle(params)
    r.start(0, [0], params)
    r.arrived(planned.received(0, {}))
    assert r.settle(params) == 0 and r.pending is None
    assert Rounds(NoLoCo(cfg, params, 0), 4, overlap=False, apply_delay_steps=2).at == 4
