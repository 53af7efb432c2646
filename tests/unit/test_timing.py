"""protocol/timing.py: Limits from the run spec, the partner ETA on hand-computed cases, the EMAs."""

from __future__ import annotations

import math

import pytest

from locomm.config import NetworkConfig
from locomm.protocol.timing import Limits, ema, partner_eta, sibling_wait_s, wait_deadline


def test_limits_from_network() -> None:
    net = NetworkConfig(
        request_timeout_s=12.0,
        stall_timeout_s=7.0,
        min_rate_mbit=8.0,
        rate_window_s=9.0,
        max_wait_s=100.0,
        max_streams_per_peer=5,
    )
    lim = Limits.from_network(net)
    assert lim == Limits(
        request_timeout_s=12.0,
        stall_timeout_s=7.0,
        min_rate_Bps=1e6,
        rate_window_s=9.0,
        max_streams_per_peer=5,
        max_wait_s=100.0,
    )
    assert Limits.from_network(NetworkConfig()) == Limits()  # the defaults agree
    assert lim.deadline_s(4e6) == pytest.approx(12.0 + 4.0)
    assert lim.deadline_s(4e6, streams=2) == pytest.approx(12.0 + 8.0)
    assert lim.allreduce_deadline_s(4e6) == pytest.approx(12.0 + 8.0)
    assert Limits.never().deadline_s(1e9) == math.inf
    from locomm.peer.transport.rpc import Limits as RpcLimits  # noqa: PLC0415 - the RPC layer's name is the same class

    assert RpcLimits is Limits


LIM = Limits(stall_timeout_s=20.0, min_rate_Bps=1e6)


def test_eta_partner_still_computing() -> None:
    # Partner in round 5 since t=100, 40 s per round, 2 MB/s up to 2 partners; 10 MB payload; now = 110.
    eta = partner_eta(
        round_idx=5,
        partner_round=5,
        round_t0=100.0,
        round_s=40.0,
        up_Bps=2e6,
        partners=2,
        own_round_s=30.0,
        wire_bytes=10e6,
        limits=LIM,
        now=110.0,
    )
    assert eta == pytest.approx(140.0 + 10.0 + 20.0 + 10.0)


def test_eta_partner_has_sent() -> None:
    # Its heartbeat says round 6: round 5 is planned and on its way; the upload starts from now.
    eta = partner_eta(
        round_idx=5,
        partner_round=6,
        round_t0=100.0,
        round_s=40.0,
        up_Bps=2e6,
        partners=1,
        own_round_s=30.0,
        wire_bytes=10e6,
        limits=LIM,
        now=150.0,
    )
    assert eta == pytest.approx(150.0 + 5.0 + 20.0 + 10.0)


def test_eta_partner_behind_and_unknown() -> None:
    # Two rounds to go from t0 = 100 at 40 s each.
    behind = partner_eta(
        round_idx=5,
        partner_round=4,
        round_t0=100.0,
        round_s=40.0,
        up_Bps=1e6,
        partners=1,
        own_round_s=30.0,
        wire_bytes=1e6,
        limits=LIM,
        now=110.0,
    )
    assert behind == pytest.approx(180.0 + 1.0 + 20.0 + 10.0)
    # No heartbeat: it computes the round from now, at our round time, uploading at the floor rate.
    unknown = partner_eta(
        round_idx=5,
        partner_round=None,
        round_t0=None,
        round_s=None,
        up_Bps=None,
        partners=None,
        own_round_s=0.2,
        wire_bytes=3e6,
        limits=LIM,
        now=50.0,
    )
    assert unknown == pytest.approx(50.0 + 1.0 + 3.0 + 20.0 + 0.25)  # own round time at least 1 s
    # Without a floor rate and no measured upload rate, no upload time is charged.
    free = partner_eta(
        round_idx=0,
        partner_round=1,
        round_t0=0.0,
        round_s=2.0,
        up_Bps=0.0,
        partners=1,
        own_round_s=2.0,
        wire_bytes=1e9,
        limits=Limits(stall_timeout_s=1.0, min_rate_Bps=0.0),
        now=3.0,
    )
    assert free == pytest.approx(3.0 + 1.0 + 0.5)


def test_waits_and_ema() -> None:
    assert wait_deadline(10.0, 500.0, Limits(max_wait_s=60.0)) == 70.0
    assert wait_deadline(10.0, 50.0, Limits(max_wait_s=60.0)) == 50.0
    assert sibling_wait_s(3.0, Limits(stall_timeout_s=20.0)) == 26.0
    assert sibling_wait_s(3.0, Limits(stall_timeout_s=20.0, max_wait_s=10.0)) == 10.0
    assert ema(0.0, 5.0) == 5.0
    assert ema(10.0, 20.0) == pytest.approx(13.0)


def test_eta_partner_two_rounds_past_is_not_waited_for() -> None:
    # Its heartbeat says round 7: it applied round 5 (one round late) and dropped its payload; a peer that fell
    # behind would otherwise wait out this ETA every round and never catch up.
    kw = dict(round_t0=100.0, round_s=40.0, up_Bps=2e6, partners=1, own_round_s=30.0, wire_bytes=10e6, limits=LIM)
    assert partner_eta(round_idx=5, partner_round=7, now=150.0, **kw) == 150.0
    assert partner_eta(round_idx=5, partner_round=6, now=150.0, **kw) > 150.0 + LIM.stall_timeout_s


def test_a_partner_declaring_an_upload_below_the_floor_is_waited_for_as_at_the_floor():
    """An ETA liar declaring 1 B/s made its partners wait max_wait_s every round; a transfer below the floor is
    cut anyway, so the ETA takes the floor."""
    lim = Limits(stall_timeout_s=20.0, min_rate_Bps=1e6)
    kw = dict(round_idx=3, partner_round=4, round_t0=0.0, round_s=10.0, partners=2, own_round_s=10.0)
    honest = partner_eta(**kw, up_Bps=1e6, wire_bytes=50e6, limits=lim, now=100.0)
    liar = partner_eta(**kw, up_Bps=1.0, wire_bytes=50e6, limits=lim, now=100.0)
    assert liar == honest == 100.0 + 100.0 + 20.0 + 2.5


def test_a_declared_pace_is_believed_only_as_far_as_it_was_seen() -> None:
    # A partner that declares 3 hours a round but moved its round counter every 40 s on our clock: its payload
    # is expected as from a 2 x 40 s round, not in 3 hours (when it would be waited for max_wait_s, no fault).
    kw = dict(round_idx=5, partner_round=5, up_Bps=2e6, partners=1, own_round_s=30.0, wire_bytes=2e6, limits=LIM)
    liar = partner_eta(round_t0=100.0, round_s=3 * 3600.0, now=110.0, **kw)
    assert liar > 10_000
    seen = partner_eta(round_t0=100.0, round_s=3 * 3600.0, now=110.0, observed_round_s=40.0, **kw)
    assert seen == pytest.approx(100.0 + 80.0 + 1.0 + 20.0 + 0.25 * 80.0)
    # An honest partner that declares what we saw is unchanged.
    honest = partner_eta(round_t0=100.0, round_s=40.0, now=110.0, **kw)
    assert partner_eta(round_t0=100.0, round_s=40.0, now=110.0, observed_round_s=40.0, **kw) == honest
    # A round that "began" an hour in the future began by now.
    future = partner_eta(round_t0=3700.0, round_s=40.0, now=110.0, **kw)
    assert future == pytest.approx(110.0 + 40.0 + 1.0 + 20.0 + 10.0)
