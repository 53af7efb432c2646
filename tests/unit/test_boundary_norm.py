"""The pipeline's poisoning bound: a scaled activation or gradient is refused, honest ones never are."""

from __future__ import annotations

import torch

from locomm.config.defence import DefenceConfig
from locomm.protocol.defence import BoundaryNorm


def test_a_scaled_activation_is_refused_after_the_window_and_honest_ones_never_are():
    gen = torch.Generator().manual_seed(0)
    norm = BoundaryNorm(DefenceConfig())
    honest = [torch.randn(4, 16, 32, generator=gen) * (1 + 0.3 * i / 100) for i in range(100)]
    assert norm.check(honest[0] * 100) is None  # no bound before the window is full: early sizes move fast
    for t in honest[1:40]:
        assert norm.check(t) is None
    assert "RMS" in (norm.check(honest[40] * 100) or "")
    assert norm.check(honest[40] * -1) is None  # a sign flip keeps the norm: not what this bound sees
    for t in honest[41:]:  # the refused one did not move the median: honest drift (30%) still passes
        assert norm.check(t) is None
    assert norm.refused == 1


def test_off_screens_nothing():
    norm = BoundaryNorm(DefenceConfig(mode="off"))
    for _ in range(40):
        assert norm.check(torch.ones(8)) is None
    assert norm.check(torch.ones(8) * 1e6) is None


def test_tiny_tensors_do_not_pull_the_bound_below_honest_ones():
    gen = torch.Generator().manual_seed(1)
    norm = BoundaryNorm(DefenceConfig())
    for _ in range(40):
        assert norm.check(torch.randn(64, generator=gen)) is None
    for _ in range(200):  # a sender of near-zero activations: taken, never moving the median
        assert norm.check(torch.randn(64, generator=gen) * 1e-6) is None
    for _ in range(20):
        assert norm.check(torch.randn(64, generator=gen)) is None
