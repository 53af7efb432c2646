"""The record validator: each forgery is refused, signed values round-trip, expirations are bounded, and
closed swarms admit key holders only (records built as hivemind's DHTNode builds them)."""

from __future__ import annotations

import dataclasses
import os
import time

import msgpack
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer

from locomm.atomic import atomic_write_bytes
from locomm.config import ConfigError, DataConfig
from locomm.peer.metrics import EventLog
from locomm.peer.transport.records import (
    MAX_ROUND_S,
    SPEC_TTL_S,
    SwarmKey,
    SwarmValidator,
    heartbeat_ttl,
    load_identity,
    peers_key,
    spec_key,
)
from locomm.protocol.membership import MAX_CLOCK_SKEW_S

NOW = 1_000_000.0
RUN = "0123456789abcdef"
TTL = 30.0


@pytest.fixture(scope="module")
def identities(tmp_path_factory) -> list:
    """Three libp2p identity files, as p2pd reads them."""
    folder = tmp_path_factory.mktemp("ids")
    paths = []
    for i in range(3):
        p = folder / f"id{i}"
        P2P.generate_identity(str(p))
        paths.append(p)
    return paths


def _validator(path, **kw) -> SwarmValidator:
    v = SwarmValidator(load_identity(path), clock=lambda: NOW, **kw)
    v.set_run(RUN, TTL)
    return v


def _record(key: str, subkey, value, expiration: float) -> DHTRecord:
    sub = DHTProtocol.IS_REGULAR_VALUE if subkey is None else MSGPackSerializer.dumps(subkey)
    return DHTRecord(DHTID.generate(source=key).to_bytes(), sub, MSGPackSerializer.dumps(value), expiration)


def _signed(v: SwarmValidator, rec: DHTRecord) -> DHTRecord:
    return dataclasses.replace(rec, value=v.sign_value(rec))


def _beat(**over) -> dict:
    return {"round": 3, "join_round": 0, "time": NOW, "version": "t", "round_s": 1.0, **over}


def _spec(**over) -> dict:
    return {"hash": "ab" * 32, "toml": "x = 1", "version": 1, "closed": False, **over}


def test_the_peer_id_is_p2pds(identities):
    v = SwarmValidator(load_identity(identities[0]))
    assert v.peer_id == PeerID.from_identity(identities[0].read_bytes()).to_base58()


def test_sign_and_strip_round_trip(identities):
    a, b = _validator(identities[0]), _validator(identities[1])
    rec = _record(peers_key(RUN), a.peer_id, _beat(), NOW + TTL)
    signed = _signed(a, rec)
    assert signed.value != rec.value and b.validate(signed) and a.validate(signed)
    assert b.strip_value(signed) == rec.value
    assert MSGPackSerializer.loads(b.strip_value(signed)) == _beat()
    own = _signed(a, _record(spec_key(a.peer_id), None, _spec(), NOW + SPEC_TTL_S))
    assert b.validate(own) and b.strip_value(own) == _record("k", None, _spec(), 0).value


def test_a_heartbeat_is_bound_to_its_owner(identities):
    owner, forger, reader = (_validator(p) for p in identities)
    forged = _signed(forger, _record(peers_key(RUN), owner.peer_id, _beat(join_round=2**31 - 1), NOW + TTL))
    assert not reader.validate(forged)
    assert MSGPackSerializer.loads(reader.strip_value(forged)) is None  # however hivemind came to return it
    unsigned = _record(peers_key(RUN), owner.peer_id, _beat(), NOW + TTL)
    assert not reader.validate(unsigned)


def test_a_tampered_record_is_refused(identities):
    a, b = _validator(identities[0]), _validator(identities[1])
    signed = _signed(a, _record(peers_key(RUN), a.peer_id, _beat(), NOW + TTL))
    later = dataclasses.replace(signed, expiration_time=signed.expiration_time + 1)
    assert not b.validate(later)  # the expiration is signed
    elsewhere = dataclasses.replace(signed, key=DHTID.generate(source=peers_key("f" * 16)).to_bytes())
    b.set_run("f" * 16, TTL)
    assert not b.validate(elsewhere)  # so is the key
    flipped = bytearray(signed.value)
    flipped[5] ^= 1
    assert not b.validate(dataclasses.replace(signed, value=bytes(flipped)))
    assert not b.validate(dataclasses.replace(signed, value=signed.value[:-3]))


def test_the_peers_key_takes_only_heartbeat_subkeys(identities):
    a, b = _validator(identities[0]), _validator(identities[1])
    plain = _signed(a, _record(peers_key(RUN), None, {"wipe": True}, NOW + TTL))
    assert not b.validate(plain)
    assert not b.validate(_record(peers_key(RUN), None, {"wipe": True}, NOW + TTL))
    for bad in ({"round": "three"}, [1, 2], "x", {"round": -1}):
        assert not b.validate(_signed(a, _record(peers_key(RUN), a.peer_id, bad, NOW + TTL)))


def test_expirations_are_bounded_by_twice_the_ttl(identities):
    a, b = _validator(identities[0]), _validator(identities[1])

    def ok(value: dict, expiration: float) -> bool:
        return b.validate(_signed(a, _record(peers_key(RUN), a.peer_id, value, expiration)))

    # writers add MAX_CLOCK_SKEW_S to a lifetime, and their clock may be that far ahead of the reader's (an NTP
    # step): up to twice that is a clock, past it a lie
    skew = 2 * MAX_CLOCK_SKEW_S
    assert ok(_beat(), NOW + 2 * TTL + skew) and not ok(_beat(), NOW + 2 * TTL + skew + 1)
    assert not ok(_beat(), NOW + 10**9)
    slow = heartbeat_ttl(100.0, TTL)  # (MEMBER_LAG_ROUNDS + 2) rounds of 100 s
    assert slow == 500.0 and ok(_beat(round_s=100.0), NOW + 2 * slow + skew)
    assert heartbeat_ttl(1e12, TTL) == heartbeat_ttl(MAX_ROUND_S, TTL)  # a huge round time is capped
    assert not ok(_beat(round_s=1e12), NOW + 10**9)
    assert b.validate(_signed(a, _record(spec_key(a.peer_id), None, _spec(), NOW + 2 * SPEC_TTL_S + skew)))
    spec = _record(spec_key(a.peer_id), None, _spec(), NOW + 2 * SPEC_TTL_S + skew + 1)
    assert not b.validate(_signed(a, spec))


def test_a_spec_verifies_only_under_its_signers_key(identities):
    creator, forger, reader = (_validator(p) for p in identities)
    reader.trust(creator.peer_id)  # e.g. named in --initial-peers
    theirs = _signed(forger, _record(spec_key(creator.peer_id), None, _spec(hash="cd" * 32), NOW + 60))
    assert not reader.validate(theirs)
    assert not reader.validate(_record(spec_key(creator.peer_id), None, _spec(), NOW + 60))  # unsigned
    own = _signed(forger, _record(spec_key(forger.peer_id), None, _spec(hash="cd" * 32), NOW + 60))
    assert reader.validate(own)  # valid, but nobody who trusts only the creator reads it
    assert not reader.validate(_signed(forger, _record(spec_key(forger.peer_id), None, {"hash": 1}, NOW + 60)))
    subkeyed = _signed(forger, _record(spec_key(forger.peer_id), "x", _spec(), NOW + 60))
    assert not reader.validate(subkeyed)
    # Once a peer's record verified, its spec key is guarded too (here: the forger's own).
    fresh = _validator(identities[0])
    assert fresh.validate(_signed(forger, _record(peers_key(RUN), forger.peer_id, _beat(), NOW + TTL)))
    assert not fresh.validate(_record(spec_key(forger.peer_id), None, _spec(), NOW + 60))


def test_keys_that_are_not_ours_pass_in_an_open_swarm_only(identities):
    a = _validator(identities[0])
    other = _record("someone.else", None, {"x": 1}, NOW + 10**6)
    assert a.validate(other) and a.strip_value(other) == other.value
    closed = _validator(identities[0], swarm_key=SwarmKey(secret=os.urandom(32)))
    assert not closed.validate(other)
    assert not a.validate(_record(peers_key(RUN), "peer", _beat(), NOW + TTL))  # our key, unsigned


def test_a_closed_swarm_admits_key_holders_only(identities):
    secret = os.urandom(32)
    a = _validator(identities[0], swarm_key=SwarmKey(secret=secret))
    b = _validator(identities[1], swarm_key=SwarmKey(secret=secret))
    wrong = _validator(identities[2], swarm_key=SwarmKey(secret=os.urandom(32)))
    outsider = _validator(identities[2])
    rec = _signed(a, _record(peers_key(RUN), a.peer_id, _beat(), NOW + TTL))
    assert b.validate(rec) and not wrong.validate(rec)
    assert outsider.validate(rec)  # an outsider can read (and verify) the swarm's records
    for forger in (wrong, outsider):
        theirs = _signed(forger, _record(peers_key(RUN), forger.peer_id, _beat(), NOW + TTL))
        assert not b.validate(theirs)
    listed = SwarmKey(allowed=frozenset({a.peer_id}))
    reader = _validator(identities[1], swarm_key=listed)
    assert reader.validate(_signed(a, _record(peers_key(RUN), a.peer_id, _beat(), NOW + TTL)))
    assert not reader.validate(_signed(outsider, _record(peers_key(RUN), outsider.peer_id, _beat(), NOW + TTL)))


def test_swarm_key_files(identities, tmp_path):
    secret = tmp_path / "swarm.key"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)  # a secret: locomm refuses one others can read
    assert SwarmKey.load(secret).secret == secret.read_bytes()
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others.*chmod 600"):
        SwarmKey.load(secret)
    a, b = (PeerID.from_identity(p.read_bytes()).to_base58() for p in identities[:2])
    listed = tmp_path / "peers.txt"
    listed.write_text(f"# the lab's machines\n{a}\n\n{b}  # gpu box\n")
    assert SwarmKey.load(listed).allowed == {a, b}
    short = tmp_path / "short.key"
    short.write_bytes(b"hunter2")
    with pytest.raises(ConfigError, match="at least 32"):
        SwarmKey.load(short)
    not_ids = tmp_path / "typo.txt"
    not_ids.write_text(a[:-3] + "\n")
    with pytest.raises(ConfigError):
        SwarmKey.load(not_ids)
    with pytest.raises(ConfigError, match="swarm-key"):
        SwarmKey.load(tmp_path / "missing")
    assert msgpack.unpackb(msgpack.packb(a)) == a


def test_only_rsa_identities_sign(tmp_path):
    ed = tmp_path / "ed25519.key"
    ed.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=b"\x00" * 64).SerializeToString())
    ed.chmod(0o600)
    with pytest.raises(ConfigError, match="RSA"):
        load_identity(ed)
    junk = tmp_path / "junk.key"
    junk.write_bytes(b"\xff" * 10)
    junk.chmod(0o600)
    with pytest.raises(ConfigError):
        load_identity(junk)


def test_secrets_others_can_read_are_refused_and_files_we_write_are_the_users_alone(identities, tmp_path):
    """ssh's rule for keys: an identity (or a swarm secret) that group or others can read is refused, saying
    how to fix it; what locomm writes is 0600, in folders it creates 0700 (a checkpoint folder)."""
    ident = identities[0]
    assert ident.stat().st_mode & 0o077 == 0  # hivemind generates identities 0400
    load_identity(ident)
    ident.chmod(0o644)
    try:
        with pytest.raises(ConfigError, match=f"--identity {ident} is readable by others .*chmod 600 {ident}"):
            load_identity(ident)
    finally:
        ident.chmod(0o400)
    ckpt = tmp_path / "new" / "ckpt"
    atomic_write_bytes(ckpt / "state.bin", b"x")
    log = EventLog(tmp_path / "logs" / "events.jsonl")
    log.write("round", round=1)
    log.close()
    assert (ckpt.stat().st_mode & 0o777, (ckpt / "state.bin").stat().st_mode & 0o777) == (0o700, 0o600)
    assert (
        (tmp_path / "logs").stat().st_mode & 0o777,
        (tmp_path / "logs" / "events.jsonl").stat().st_mode & 0o777,
    ) == (
        0o700,
        0o600,
    )


@pytest.mark.parametrize("corpus", ["stdlib", "hf:roneneldan/TinyStories", "hf:wikitext:wikitext-2-raw-v1"])
def test_a_swarm_spec_may_name_builtin_corpora_and_dataset_ids(corpus):
    DataConfig(corpus=corpus).check_from_swarm()


@pytest.mark.parametrize("corpus", ["~", "/etc", "./data", "notes.txt", "hf:/home/x", "hf:~/x", "hf:../x", "hf:a/../b"])
def test_a_swarm_spec_may_not_name_a_path(corpus):
    with pytest.raises(ConfigError, match="--config"):
        DataConfig(corpus=corpus).check_from_swarm()


def test_an_hf_id_that_is_a_local_folder_is_refused(tmp_path, monkeypatch):
    (tmp_path / "mydata").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError):
        DataConfig(corpus="hf:mydata").check_from_swarm()


def test_admission_certificates_admit_the_founders_members_only(identities, tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from locomm.peer.transport.admission import Certificate, load_founder, new_founder

    new_founder(tmp_path / "founder.key")
    founder = load_founder(tmp_path / "founder.key")
    ids = [SwarmValidator(load_identity(p)).peer_id for p in identities]
    member = SwarmKey(certificate=Certificate.issue(founder, ids[0], NOW + 3600))
    reader = _validator(identities[1], swarm_key=SwarmKey(certificate=Certificate.issue(founder, ids[1], NOW + 60)))
    a = _validator(identities[0], swarm_key=member)
    assert reader.validate(_signed(a, _record(peers_key(RUN), a.peer_id, _beat(), NOW + TTL)))
    # A minted identity: a certificate of its own founder, one stolen from a member, one expired, none at all.
    rogue = Ed25519PrivateKey.generate()
    forged = [
        SwarmKey(certificate=Certificate.issue(rogue, ids[2], NOW + 3600)),
        member,  # ids[0]'s certificate carried by ids[2]
        SwarmKey(certificate=Certificate.issue(founder, ids[2], NOW - 1)),
        None,
    ]
    for key in forged:
        m = _validator(identities[2], swarm_key=key)
        assert not reader.validate(_signed(m, _record(peers_key(RUN), m.peer_id, _beat(), NOW + TTL))), key
        assert not reader.validate(_signed(m, _record(spec_key(m.peer_id), None, _spec(), NOW + 60))), key
    # A certificate file: the member's key file is checked against it; a damaged one is a one-line error.
    path = tmp_path / "member.cert"
    fresh = Certificate.issue(founder, ids[0], time.time() + 3600)  # loading checks the expiry by the real clock
    atomic_write_bytes(path, fresh.encode())
    assert SwarmKey.load(path).certificate == fresh
    SwarmKey.load(path).check_identity(ids[0])
    with pytest.raises(ConfigError, match="certificate is for peer"):
        SwarmKey.load(path).check_identity(ids[1])
    atomic_write_bytes(path, fresh.encode()[:-5])
    with pytest.raises(ConfigError, match="damaged admission certificate"):
        SwarmKey.load(path)
    os.chmod(tmp_path / "founder.key", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_founder(tmp_path / "founder.key")


async def test_a_bootstrap_node_with_a_certificate_runs_with_the_identity_it_names(identities, tmp_path):
    """`locomm-peer bootstrap --swarm-key member.cert` follows the peers' rule: without --identity, or with another
    peer's key file, it stops with the fix before any p2pd starts (before, it ran with a throwaway id whose records
    every member refused)."""
    from locomm.peer.bootstrap import run_bootstrap
    from locomm.peer.options import NodeOptions
    from locomm.peer.transport.admission import Certificate, load_founder, new_founder

    new_founder(tmp_path / "founder.key")
    ids = [SwarmValidator(load_identity(p)).peer_id for p in identities]
    cert = tmp_path / "boot.cert"
    atomic_write_bytes(
        cert, Certificate.issue(load_founder(tmp_path / "founder.key"), ids[0], time.time() + 600).encode()
    )
    with pytest.raises(ConfigError, match="pass --identity"):
        await run_bootstrap(NodeOptions(swarm_key=cert), None)
    with pytest.raises(ConfigError, match="certificate is for peer"):
        await run_bootstrap(NodeOptions(swarm_key=cert, identity=identities[1]), None)
