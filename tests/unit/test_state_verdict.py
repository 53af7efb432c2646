"""The joiner's check of a downloaded state before it trains on it (``state_sync.loss_verdict``)."""

from __future__ import annotations

import math

from locomm.peer.transport.state_sync import STATE_LOSS_FACTOR, loss_verdict


def test_a_state_near_the_members_losses_is_taken():
    assert loss_verdict(2.6, [2.4, 2.5, 2.3], own=5.5) is None
    assert loss_verdict(2.0 * STATE_LOSS_FACTOR, [2.0, 2.0, None, math.nan], own=None) is None  # at the bound


def test_a_state_far_above_the_members_losses_is_refused():
    why = loss_verdict(2.0 * STATE_LOSS_FACTOR + 0.01, [2.0, 2.1, 1.9], own=None)
    assert why is not None and "members'" in why


def test_a_minority_of_published_losses_cannot_move_the_reference():
    # two liars publish a loss of 1000 (to let a poisoned state through), three members publish 2.0
    assert loss_verdict(50.0, [1000.0, 1000.0, 2.0, 2.0, 2.0]) is not None


def test_a_state_worse_than_our_own_weights_is_refused_once_the_swarm_has_trained():
    why = loss_verdict(5.6, [4.0, 4.2], own=5.5)  # within the factor, but worse than not syncing at all
    assert why is not None and "our own weights" in why
    assert loss_verdict(5.6, [5.6, 5.7], own=5.5) is None  # the swarm has not trained below our own loss yet
    # the run's initial weights, served by colluding live identities (ghosts.py --live: 4 of 5 donors), score
    # exactly a fresh joiner's own loss and were taken; no better than not syncing, they are refused now
    why = loss_verdict(5.3355, [1.8, 1.9, 1.7], own=5.3355)
    assert why is not None and "no better than our own weights" in why


def test_a_non_finite_loss_is_refused_and_nothing_published_takes_a_finite_one():
    assert loss_verdict(math.nan, [2.0]) is not None
    assert loss_verdict(math.inf, []) is not None
    assert loss_verdict(9.0, [None, math.inf]) is None
