"""The typed heartbeat: every field is checked once, when read; a bad field drops the record, never raises."""

from __future__ import annotations

import math

import pytest

from locomm.protocol.membership import NOT_ADMITTED, Heartbeat, members_for_round

GOOD = {
    "round": 4,
    "join_round": 0,
    "step": 80,
    "time": 1000.0,
    "version": "0.1.0",
    "maddrs": ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW"],
    "started": True,
    "loss": 2.5,
    "val_loss": None,
    "round_t0": 990.0,
    "round_s": 10.0,
    "up_Bps": 1e6,
    "partners": 1,
    "stage": -1,
}


def test_a_good_record_round_trips():
    b = Heartbeat.parse("peerA", GOOD, expires=2000.0)
    assert b is not None and b.round == 4 and b.round_s == 10.0 and b.stage is None and b.started
    again = Heartbeat.parse("peerA", b.record(), expires=2000.0)
    assert again == b


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("round", "4"),
        ("round", -1),
        ("round", 2**40),
        ("round", True),
        ("join_round", 1.5),
        ("round_s", math.nan),
        ("round_s", -3.0),
        ("round_s", "fast"),
        ("up_Bps", math.inf),
        ("partners", None),
        ("loss", "low"),
        ("maddrs", "not-a-list"),
        ("maddrs", ["x" * 1000]),
        ("maddrs", ["/ip4/1.2.3.4"] * 100),
        ("version", 7),
        ("started", 1),
        ("stage", 10**6),
        ("time", [1]),
    ],
)
def test_any_bad_field_drops_the_record(key, bad):
    assert Heartbeat.parse("peerA", {**GOOD, key: bad}) is None


@pytest.mark.parametrize("value", [None, 3, "x", [1, 2], b"\x00"])
def test_a_record_that_is_not_a_mapping_is_dropped(value):
    assert Heartbeat.parse("peerA", value) is None


def test_a_bad_peer_id_is_dropped():
    assert Heartbeat.parse(7, GOOD) is None
    assert Heartbeat.parse("", GOOD) is None
    assert Heartbeat.parse("p" * 1000, GOOD) is None


def test_missing_fields_take_their_defaults_and_unknown_ones_are_kept_apart():
    b = Heartbeat.parse("peerA", {"round": 2, "future_field": {"x": 1}})
    assert b is not None and b.join_round == 0 and b.round_s == 0.0 and b.extra == {"future_field": {"x": 1}}


def test_an_unadmitted_joiner_is_nobodys_member():
    beats = [Heartbeat(peer="b", round=5), Heartbeat(peer="c", round=5, join_round=NOT_ADMITTED)]
    assert members_for_round(beats, 6, "a") == ["a", "b"]
    assert not beats[1].admitted
