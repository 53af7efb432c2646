"""The DHT clock's rule (peer/transport/dht_clock.py): the median of the answers and our own clock."""

from __future__ import annotations

import time

import hivemind.dht.node
import hivemind.dht.protocol
import hivemind.utils.timed_storage
import pytest

from locomm.peer.transport import dht_clock


def test_one_answer_against_ours_moves_nothing() -> None:
    assert dht_clock.correction([30.0]) == 0.0
    assert dht_clock.correction([]) == 0.0


def test_a_majority_with_the_same_offset_moves_us_there() -> None:
    assert dht_clock.correction([-30.0, -30.1]) == -30.0
    assert dht_clock.correction([-30.0, -29.8, 0.2, -29.9]) == pytest.approx(-29.8)  # 3 of 5 with us


def test_a_tie_moves_nothing() -> None:
    assert dht_clock.correction([-30.0, -29.8, 0.2]) == 0.0  # -30 -29.8 | 0 0.2: the middle nearer our 0


def test_a_minority_of_liars_moves_nothing() -> None:
    assert dht_clock.correction([0.1, -0.2, 1e6, 1e6]) == 0.0  # -0.2 0 0.1 1e6 1e6: the median is 0.1
    assert dht_clock.correction([0.1, -0.2, 1e6, 1e6], move_s=0.0) == pytest.approx(0.1)


def test_jitter_under_the_threshold_moves_nothing() -> None:
    assert dht_clock.correction([0.5, 0.7, 0.9]) == 0.0


def test_the_offset_stays_within_the_skew_records_tolerate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dht_clock, "_offset", 0.0)
    assert dht_clock.follow([-1e6, -1e6, -1e6]) == -dht_clock.BOUND_S
    assert dht_clock.offset() == -dht_clock.BOUND_S
    assert dht_clock.follow([-1e6, -1e6, -1e6]) is None  # at the bound already
    assert dht_clock.follow([dht_clock.BOUND_S] * 3) == dht_clock.BOUND_S
    assert dht_clock.offset() == 0.0


def test_install_points_hivemind_at_our_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (hivemind.utils.timed_storage, hivemind.dht.protocol, hivemind.dht.node):
        monkeypatch.setattr(module, "get_dht_time", time.time)
    monkeypatch.setattr(dht_clock, "_offset", 12.5)
    dht_clock.install()
    for module in (hivemind.utils.timed_storage, hivemind.dht.protocol, hivemind.dht.node):
        assert module.get_dht_time is dht_clock.now
    assert hivemind.dht.protocol.get_dht_time() - time.time() == pytest.approx(12.5, abs=0.5)


def test_the_loop_handler_quiets_hiveminds_refused_pings_and_nothing_else():
    """The unretrieved errors of a strict bootstrap that refused an initial peer's time (its pings' ValidationError,
    and a ping that reached the refused node's protocol before its handlers were removed: chaos seed 14) go to the
    debug log; anything else goes on to the loop's own handler."""
    from hivemind.dht.protocol import ValidationError

    from locomm.peer.transport.dht_clock import quiet_refusals

    passed: list[BaseException] = []
    handle = quiet_refusals(lambda loop, context: passed.append(context["exception"]))
    handle(None, {"message": "x", "exception": ValidationError("local time must be within 3 seconds of others")})
    handle(None, {"message": "x", "exception": AttributeError("'DHTProtocol' object has no attribute 'node_info'")})
    other = AttributeError("'NoneType' object has no attribute 'peer_id'")
    handle(None, {"message": "x", "exception": other})
    assert passed == [other]
