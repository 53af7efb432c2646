"""The wire schema and membership rules, without a network."""

import urllib.request

import msgpack
import pytest

from locomm import PROTOCOL_VERSION
from locomm.peer.metrics import Metrics
from locomm.peer.transport.swarm import Heartbeat, members_for_round
from locomm.protocol.messages import (
    ErrorCode,
    ProtocolViolation,
    TensorSpec,
    decode_header,
    pack_frame,
    read_header_length,
    validate_header,
)

EXPECTED = {"phi/w": TensorSpec((4, 4)), "delta/w": TensorSpec((4, 4))}


def header(**over):
    h = {
        "v": PROTOCOL_VERSION,
        "run": "r1",
        "type": "push",
        "round": 3,
        "sender": "me",
        "tensors": [
            {"name": "phi/w", "codec": "none", "nbytes": 64, "shape": [4, 4]},
            {"name": "delta/w", "codec": "none", "nbytes": 64, "shape": [4, 4]},
        ],
    }
    h.update(over)
    return h


def check(h, max_body=1 << 20):
    return validate_header(h, run_id="r1", expected=EXPECTED, max_body_bytes=max_body, types=("push",))


def test_valid_header_round_trips_through_a_frame():
    frame = pack_frame(header())
    n = read_header_length(frame[:4])
    msg = check(decode_header(frame[4 : 4 + n]))
    assert msg.round == 3 and msg.sender == "me" and msg.body_bytes == 128


@pytest.mark.parametrize(
    "over, code",
    [
        ({"v": 2}, ErrorCode.BAD_VERSION),
        ({"run": "other"}, ErrorCode.WRONG_RUN),
        ({"type": "nope"}, ErrorCode.MALFORMED),
        ({"round": -1}, ErrorCode.MALFORMED),
        ({"round": True}, ErrorCode.MALFORMED),
        ({"sender": 5}, ErrorCode.MALFORMED),
        ({"tensors": "x"}, ErrorCode.MALFORMED),
        ({"tensors": [7]}, ErrorCode.MALFORMED),
        ({"tensors": [{"name": "phi/w", "codec": "none", "nbytes": 10**12}]}, ErrorCode.TOO_LARGE),
        ({"tensors": [{"name": "phi/w", "codec": "none", "nbytes": -1}]}, ErrorCode.TOO_LARGE),
        ({"tensors": [{"name": "x", "codec": "none", "nbytes": 1}]}, ErrorCode.UNEXPECTED_TENSOR),
        ({"tensors": [{"name": "phi/w", "codec": "zip", "nbytes": 1}]}, ErrorCode.MALFORMED),
        ({"tensors": [{"name": "phi/w", "codec": "none", "nbytes": 1, "shape": [2]}]}, ErrorCode.BAD_SHAPE),
        ({"tensors": [{"name": "phi/w", "codec": "none", "nbytes": 1}] * 2}, ErrorCode.UNEXPECTED_TENSOR),
    ],
)
def test_violations_carry_their_code(over, code):
    with pytest.raises(ProtocolViolation) as e:
        check(header(**over))
    assert e.value.code == code


def test_body_limit_and_frame_limits():
    with pytest.raises(ProtocolViolation) as e:
        check(header(), max_body=100)
    assert e.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(ProtocolViolation):
        read_header_length((1 << 30).to_bytes(4, "big"))
    with pytest.raises(ProtocolViolation):
        read_header_length(b"\x00\x00\x00\x00")
    for junk in (b"\xc1\xc1", msgpack.packb([1, 2]), b""):
        with pytest.raises(ProtocolViolation):
            decode_header(junk)


def test_members_for_round():
    beats = [Heartbeat(peer="b", round=5), Heartbeat(peer="c", round=5, join_round=7), Heartbeat(peer="d", round=5)]
    assert members_for_round(beats, 5, "a") == ["a", "b", "d"]
    assert members_for_round(beats, 7, "a") == ["a", "b", "c", "d"]
    # A peer whose round counter stopped (it died) drops out for everyone at the same round.
    beats.append(Heartbeat(peer="e", round=4))
    assert members_for_round(beats, 7, "a") == ["a", "b", "c", "d", "e"]
    assert members_for_round(beats, 8, "a") == ["a", "b", "c", "d"]


def test_metrics_are_served():
    m = Metrics(0, "12D3KooWpeer")
    try:
        m.set(round=4, loss=1.5, bytes_sent=1000)
        m.set(bytes_sent=2500)
        text = urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=10).read().decode()
        assert 'locomm_round{peer="12D3KooWpeer"} 4.0' in text
        assert "locomm_train_loss" in text
        assert 'locomm_bytes_sent_total{peer="12D3KooWpeer"} 2500.0' in text  # a Counter, as Prometheus expects
        assert "# TYPE locomm_bytes_sent_total counter" in text
    finally:
        m.close()


# ---------------------------------------------------------------- state manifests and fetches

SHA = "ab" * 32


def manifest(entries=None, **over):
    m = {
        "state_hash": "cd" * 32,
        "round": 3,
        "manifest": entries if entries is not None else [{"name": "model/w", "shape": [4, 4], "sha256": SHA}],
    }
    m.update(over)
    return m


def test_a_manifest_in_bounds_is_accepted_and_normalised():
    from locomm.protocol.state_messages import validate_manifest

    rnd, h, entries = validate_manifest(manifest())
    assert (rnd, h) == (3, "cd" * 32)
    assert entries == [{"name": "model/w", "shape": [4, 4], "dtype": "float32", "sha256": SHA}]


@pytest.mark.parametrize(
    ("resp", "code"),
    [
        (manifest(round=True), ErrorCode.MALFORMED),
        (manifest(round=-1), ErrorCode.MALFORMED),
        (manifest(state_hash="short"), ErrorCode.MALFORMED),
        (manifest(manifest={"model/w": [4]}), ErrorCode.MALFORMED),
        (manifest([{"name": "", "shape": [4], "sha256": SHA}]), ErrorCode.MALFORMED),
        (manifest([{"name": "x" * 513, "shape": [4], "sha256": SHA}]), ErrorCode.MALFORMED),
        (manifest([{"name": "w", "shape": [4], "sha256": "zz" * 32}]), ErrorCode.MALFORMED),
        (manifest([{"name": "w", "shape": [1] * 9, "sha256": SHA}]), ErrorCode.MALFORMED),
        (manifest([{"name": "w", "shape": [-1], "sha256": SHA}]), ErrorCode.MALFORMED),
        (manifest([{"name": "w", "shape": [4.0], "sha256": SHA}]), ErrorCode.MALFORMED),
        (manifest([{"name": "w", "shape": [4], "dtype": "float16", "sha256": SHA}]), ErrorCode.MALFORMED),
        (manifest([{"name": "w", "shape": [4], "sha256": SHA}] * 2), ErrorCode.MALFORMED),
        (manifest([{"name": "w", "shape": [1 << 32, 1 << 32], "sha256": SHA}]), ErrorCode.TOO_LARGE),
        (manifest([{"name": f"w{i}", "shape": [1 << 32], "sha256": SHA} for i in range(5)]), ErrorCode.TOO_LARGE),
        (manifest([{"name": f"w{i}", "shape": [1], "sha256": SHA} for i in range(16385)]), ErrorCode.TOO_LARGE),
    ],
    ids=lambda x: x.name if isinstance(x, ErrorCode) else "",
)
def test_a_manifest_out_of_bounds_is_refused_before_anything_is_sized_from_it(resp, code):
    from locomm.protocol.state_messages import validate_manifest

    with pytest.raises(ProtocolViolation) as e:
        validate_manifest(resp)
    assert e.value.code == code


def test_a_state_fetch_names_known_tensors_once_and_a_sha256():
    from locomm.protocol.messages import Message
    from locomm.protocol.state_messages import validate_state_fetch

    known = {"model/w": None, "model/b": None}

    def fetch(names, h=SHA):
        return validate_state_fetch(Message("state_fetch", 0, "me", {"names": names, "state_hash": h}, ()), known)

    assert fetch(["model/w"]) == (["model/w"], SHA)
    for names in ([], ["model/w", "model/w"], ["model/x"], ["x" * 600], "model/w", [1]):
        with pytest.raises(ProtocolViolation) as e:
            fetch(names)
        assert e.value.code == ErrorCode.UNEXPECTED_TENSOR
    for h in (None, "cd", "CD" * 32):
        with pytest.raises(ProtocolViolation) as e:
            fetch(["model/w"], h)
        assert e.value.code == ErrorCode.MALFORMED
