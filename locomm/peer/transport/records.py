"""Signed, validated DHT records: every record locomm writes carries its writer's signature, and every
record a node stores or reads is checked by :class:`SwarmValidator` (hivemind's record validator hook).

Notable:
- The signing key is the peer's libp2p identity (the RSA key of its P2P identity file), so the signer's
  peer id is derived from the public key in the record (libp2p's rule: a sha2-256 multihash of the
  protobuf-wrapped DER key): nobody can write a record as another peer without that peer's key.
- The signature and the public key travel in a trailer appended to the value bytes by ``sign_value``
  and removed by ``strip_value``. The signature covers (key, subkey, value, expiration, public key),
  so a record cannot be moved to another key or given a later expiration.
- What is checked, per key (hivemind hands the validator only DHTID bytes, so the validator knows the
  keys it guards by their hashes):

  - ``locomm.<run>.peers`` (after :meth:`SwarmValidator.set_run`): dictionary subkey records only (a
    plain value would hide every heartbeat), the subkey is the signer's own peer id, the value parses
    as a :class:`~locomm.protocol.membership.Heartbeat`, and the expiration is at most now + 2x the
    heartbeat's TTL (:func:`heartbeat_ttl`) + 2 x ``MAX_CLOCK_SKEW_S``: writers add ``MAX_CLOCK_SKEW_S`` to
    every lifetime (``transport/swarm.py``), so a record lives its TTL for readers up to that far either side of
    its writer's clock (an NTP step; a peer 30 s ahead published nothing anyone stored, one 30 s behind only
    records every reader had expired, and newcomers joining through either found no spec:
    benchmarks/chaos.py's clock_step);
  - ``locomm.spec.<peer id>``: a regular value {hash, toml, version, closed} signed by that peer,
    expiring at most now + 2 x SPEC_TTL_S + 2 x ``MAX_CLOCK_SKEW_S``. A record at the spec key of a peer this
    node knows (itself, its initial peers, any peer whose record verified) signed by anyone else is refused;
  - ``locomm.swarm.<swarm id>`` (certificate mode, the swarm id of this node's founder): the same spec
    value, one dictionary subkey per member, the subkey the signer's own peer id; so a joiner that holds a
    certificate finds the swarm's spec through any DHT node (a bare ``hivemind-dht`` included), signed by
    members the founder admitted, without naming one;
  - any other key: not ours (True), except in a closed swarm.

- Closed swarms (:class:`SwarmKey`): a secret of >= 32 bytes adds an HMAC-SHA256 tag to the trailer,
  and a record without a valid tag is refused whatever its key; or a list of allowed peer ids, and a
  record whose signer is not listed is refused.
- ``validate`` runs on every incoming store and on every record another node returns (hivemind drops
  a whole dictionary when any subkey fails), so a forged record is never stored by an honest node and
  never read by one. What it cannot do: order two valid records of one peer (a replayed old heartbeat
  with its original expiration). The host keeps the newest (round, time) per peer for that.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import math
import os
import re
import time
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer

from locomm.atomic import check_private
from locomm.config import ConfigError
from locomm.peer.transport.admission import CERT_MAGIC, Certificate, founder_id
from locomm.protocol.membership import MAX_CLOCK_SKEW_S, MEMBER_LAG_ROUNDS, Heartbeat

__all__ = [
    "MAX_ROUND_S",
    "SPEC_TTL_S",
    "SwarmKey",
    "SwarmValidator",
    "check_swarm_id",
    "heartbeat_ttl",
    "is_peer_id",
    "load_identity",
    "peer_id_of",
    "public_der",
    "peers_key",
    "spec_key",
    "swarm_spec_key",
]

log = logging.getLogger(__name__)

SPEC_TTL_S = float(os.environ.get("LOCOMM_SPEC_TTL_S", "") or 3600.0)
"""Lifetime of a peer's spec record; the host stores it again every SPEC_TTL_S / 3. ``LOCOMM_SPEC_TTL_S``
overrides it for tests (a swarm that outlives several TTLs in seconds); every peer of a swarm must agree."""
if not SPEC_TTL_S >= 1.0:
    raise ValueError(f"LOCOMM_SPEC_TTL_S must be >= 1 s, got {SPEC_TTL_S}")
MAX_ROUND_S = 3600.0
"""A heartbeat's round time is capped here when it sets the record's TTL (a bound every peer computes alike)."""
MIN_SWARM_SECRET = 32
_MAGIC = b"LCR1"
_MAX_TRAILER = 4096
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)
_KNOWN_CAP = 8192
_REFUSED = MSGPackSerializer.dumps(None)
_PEER_ID_RE = re.compile(r"^(Qm[1-9A-HJ-NP-Za-km-z]{44}|12D3KooW[1-9A-HJ-NP-Za-km-z]{44,48})$")


def peers_key(run_id: str) -> str:
    """The DHT key of a run's heartbeats (one subkey per peer id)."""
    return f"locomm.{run_id}.peers"


def spec_key(peer: str) -> str:
    """The DHT key of the run spec one peer runs (and signs)."""
    return f"locomm.spec.{peer}"


def swarm_spec_key(swarm_id: str) -> str:
    """The DHT key of the spec every member of a founder's swarm stores (one subkey per member)."""
    return f"locomm.swarm.{swarm_id}"


def heartbeat_ttl(round_s: float, heartbeat_ttl_s: float) -> float:
    """A heartbeat record's lifetime: it outlives the membership lag (MEMBER_LAG_ROUNDS + 2 rounds), so a
    peer that died drops out by its frozen round counter, not by a clock; the round time is capped."""
    r = round_s if math.isfinite(round_s) and round_s > 0 else 0.0
    return max(heartbeat_ttl_s, (MEMBER_LAG_ROUNDS + 2) * min(r, MAX_ROUND_S))


def _key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


@lru_cache(maxsize=4096)
def _public_key(der: bytes) -> tuple[rsa.RSAPublicKey, str] | None:
    """The RSA key in a DER SubjectPublicKeyInfo, and the libp2p peer id it makes (None: not an RSA key)."""
    try:
        key = serialization.load_der_public_key(der)
    except (ValueError, TypeError):
        return None
    if not isinstance(key, rsa.RSAPublicKey) or key.key_size < 2048:
        return None
    return key, peer_id_of(der)


def public_der(key: rsa.RSAPrivateKey) -> bytes:
    """The DER (SubjectPublicKeyInfo) of an identity key's public half: what records carry and peer ids hash."""
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def peer_id_of(public_der: bytes) -> str:
    """The base58 libp2p peer id of an RSA public key (DER SubjectPublicKeyInfo), as p2pd derives it."""
    wrapped = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_der).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(wrapped).digest()).to_base58()  # sha2-256 multihash


def _secret(path: str | Path, option: str) -> None:
    """A secret others can read is the user's error: ``check_private``'s message as a ConfigError."""
    try:
        check_private(Path(path), option)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_identity(path: str | Path) -> rsa.RSAPrivateKey:
    """The RSA private key of a libp2p identity file (protobuf PrivateKey, as ``P2P.generate_identity``
    writes it). Raises ConfigError for another key type or an unreadable file."""
    _secret(path, "--identity")
    try:
        proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        if proto.key_type != crypto_pb2.RSA:
            raise ConfigError(f"--identity {path}: only RSA identities can sign swarm records")
        key = serialization.load_der_private_key(proto.data, password=None)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a bad file is the user's error, said in one line
        raise ConfigError(f"--identity {path}: not a libp2p identity file ({type(e).__name__})") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ConfigError(f"--identity {path}: not an RSA key")
    return key


@dataclasses.dataclass(frozen=True)
class SwarmKey:
    """What admits a record to a closed swarm: a shared secret (an HMAC tag), a list of allowed peer ids, or a
    founder's admission certificate (:mod:`locomm.peer.transport.admission`: the record's trailer carries its
    signer's certificate, which must be the founder's and name the signer)."""

    secret: bytes | None = None
    allowed: frozenset[str] | None = None
    certificate: Certificate | None = None
    """Certificate mode: this peer's own certificate (its ``founder`` is the swarm's)."""

    @classmethod
    def load(cls, path: str | Path) -> SwarmKey:
        """Read ``--swarm-key FILE``: a list of peer ids (one a line, ``#`` comments) or >= 32 random bytes."""
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"--swarm-key {path}: {e.strerror or e}") from None
        key = cls.parse(data, str(path))
        if key.secret is not None:  # a list of peer ids is no secret; a shared secret is
            _secret(path, "--swarm-key")
        return key

    @classmethod
    def parse(cls, data: bytes, name: str = "swarm key") -> SwarmKey:
        if data[:4] == CERT_MAGIC:
            cert = Certificate.decode(data)
            if cert is None:
                raise ConfigError(
                    f"--swarm-key {name}: a damaged admission certificate (ask the founder for a new one)"
                )
            if cert.expires <= time.time():
                raise ConfigError(
                    f"--swarm-key {name}: the admission certificate expired (ask the founder for a new one)"
                )
            return cls(certificate=cert)
        ids = _peer_id_list(data, name)
        if ids:
            return cls(allowed=frozenset(ids))
        if len(data) < MIN_SWARM_SECRET:
            raise ConfigError(
                f"--swarm-key {name}: {len(data)} bytes is neither a secret of at least {MIN_SWARM_SECRET} random "
                "bytes (head -c 32 /dev/urandom > swarm.key; chmod 600 swarm.key) nor a list of peer ids, one a line"
            )
        return cls(secret=bytes(data))

    def tag(self, message: bytes) -> bytes:
        if self.certificate is not None:
            return self.certificate.encode()
        return hmac.new(self.secret, message, hashlib.sha256).digest() if self.secret is not None else b""

    def admits(self, signer: str, message: bytes, tag: bytes, now: float | None = None) -> bool:
        if self.allowed is not None:
            return signer in self.allowed
        if self.certificate is not None:
            cert = Certificate.decode(tag)
            return cert is not None and cert.valid_for(signer, self.certificate.founder, now)
        return hmac.compare_digest(self.tag(message), tag)

    @property
    def swarm_id(self) -> str | None:
        """Certificate mode: the founder's swarm id (``join --swarm ID``); None in the other modes."""
        return founder_id(self.certificate.founder) if self.certificate is not None else None

    def check_identity(self, peer: str) -> None:
        """Certificate mode: this peer's id must be the one its certificate names (ConfigError with the fix)."""
        if self.certificate is not None and self.certificate.peer != peer:
            raise ConfigError(
                f"the admission certificate is for peer {self.certificate.peer}, this peer is {peer}: pass the "
                "--identity file whose peer id the founder admitted (locomm-peer admit --show-id --identity FILE)"
            )


def check_swarm_id(swarm_id: str, key: SwarmKey | None) -> None:
    """``join --swarm ID``: ``key`` must be an admission certificate of that founder (ConfigError with the fix)."""
    if key is None or key.swarm_id is None:
        raise ConfigError(
            f"--swarm {swarm_id} needs your admission certificate of that swarm as --swarm-key (the founder makes "
            "it: locomm-peer admit --founder-key FOUNDER.key --peer YOUR_PEER_ID --out member.cert)"
        )
    if key.swarm_id != swarm_id:
        raise ConfigError(f"--swarm {swarm_id}: the certificate is of swarm {key.swarm_id}, not this one")


def is_peer_id(text: str) -> bool:
    """Whether ``text`` is a libp2p peer id as base58 writes it (``Qm...`` or ``12D3KooW...``, round-tripping)."""
    try:
        return bool(_PEER_ID_RE.match(text)) and PeerID.from_base58(text).to_base58() == text
    except Exception:  # noqa: BLE001 - not base58
        return False


def _peer_id_list(data: bytes, name: str = "swarm key") -> list[str] | None:
    """The peer ids of a text list (one a line, ``#`` comments), or None when ``data`` is not meant as one
    (a list with a line that is not a peer id is an error, not a secret)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    lines = [i for i in lines if i]
    if not lines or not ("#" in text or all(i.startswith(("Qm", "12D3")) for i in lines)):
        return None
    out = []
    for i in lines:
        if not is_peer_id(i):
            raise ConfigError(f"--swarm-key {name}: {i[:60]!r} is not a peer id (a list names one per line)")
        out.append(i)
    return out


@dataclasses.dataclass(frozen=True)
class _Signed:
    value: bytes
    public_der: bytes
    signature: bytes
    tag: bytes


def _split(value: bytes) -> _Signed | None:
    """The value and its trailer, or None when there is no well-formed trailer."""
    if len(value) < 8 or value[-4:] != _MAGIC:
        return None
    n = int.from_bytes(value[-8:-4], "big")
    if not 0 < n <= _MAX_TRAILER or n + 8 > len(value):
        return None
    try:
        fields = msgpack.unpackb(value[-8 - n : -8], raw=False)
    except Exception:  # noqa: BLE001 - any garbage is just "no trailer"
        return None
    if not (isinstance(fields, list) and len(fields) == 3 and all(isinstance(f, bytes) for f in fields)):
        return None
    return _Signed(value[: -8 - n], *fields)


def _message(record: DHTRecord, value: bytes, public_der: bytes) -> bytes:
    return msgpack.packb([record.key, record.subkey, value, float(record.expiration_time), public_der])


class SwarmValidator(RecordValidatorBase):
    """Signs this peer's records and checks everyone's (see the module docstring).

    Args:
        private_key: This peer's identity key (None: a reader that signs nothing, e.g. ``status``).
        swarm_key: A closed swarm's key; None: an open swarm.
        clock: DHT time (seconds since the epoch), for the expiration bounds.
    """

    def __init__(
        self,
        private_key: rsa.RSAPrivateKey | None = None,
        *,
        swarm_key: SwarmKey | None = None,
        clock: Any = time.time,
    ) -> None:
        self._key = private_key
        self.swarm_key = swarm_key
        self.clock = clock
        self.public_der = b""
        self.peer_id = ""
        if private_key is not None:
            self.public_der = public_der(private_key)
            self.peer_id = peer_id_of(self.public_der)
        self._peers_keys: dict[bytes, float] = {}  # DHTID bytes of a run's peers key -> its heartbeat TTL
        self._spec_keys: OrderedDict[bytes, str] = OrderedDict()  # DHTID bytes of spec.<id> -> id
        swarm_id = swarm_key.swarm_id if swarm_key is not None else None
        self._swarm_spec = _key_id(swarm_spec_key(swarm_id)) if swarm_id is not None else None
        self.refused = 0
        """Records refused so far (a counter for logs and tests)."""
        if self.peer_id:
            self.trust(self.peer_id)

    @classmethod
    def from_identity(cls, path: str | Path, *, swarm_key: SwarmKey | None = None) -> SwarmValidator:
        return cls(load_identity(path), swarm_key=swarm_key)

    @property
    def closed(self) -> bool:
        return self.swarm_key is not None

    def set_run(self, run_id: str, heartbeat_ttl_s: float) -> None:
        """Guard the heartbeats of ``run_id`` from now on."""
        self._peers_keys[_key_id(peers_key(run_id))] = heartbeat_ttl_s

    def trust(self, peer: str) -> None:
        """Know ``peer``'s spec key: a record there must be signed by ``peer``."""
        k = _key_id(spec_key(peer))
        self._spec_keys[k] = peer
        self._spec_keys.move_to_end(k)
        while len(self._spec_keys) > _KNOWN_CAP:
            self._spec_keys.popitem(last=False)

    # -- hivemind's hooks ---------------------------------------------------------------

    def sign_value(self, record: DHTRecord) -> bytes:
        if self._key is None:
            return record.value
        msg = _message(record, record.value, self.public_der)
        sig = self._key.sign(msg, _PSS, hashes.SHA256())
        tag = self.swarm_key.tag(msg) if self.swarm_key is not None else b""
        trailer = msgpack.packb([self.public_der, sig, tag])
        return record.value + trailer + len(trailer).to_bytes(4, "big") + _MAGIC

    def strip_value(self, record: DHTRecord) -> bytes:
        # Checked again here: hivemind hands the application values that skipped validate() (a dictionary
        # merged into one this node already held, its local storage and cache), and every value it returns
        # passes through here with its record. A record that fails reads as None, which no reader accepts.
        # (swarm.drop_refused clears such records from local storage before a read, so that one read as
        # None never hides a valid record that another node holds.)
        if not self.validate(record):
            return _REFUSED
        signed = _split(record.value)
        return record.value if signed is None else signed.value

    def validate(self, record: DHTRecord) -> bool:
        try:
            ok = self._validate(record)
        except Exception as e:  # noqa: BLE001 - a record that breaks a check is a bad record
            log.debug("record check failed: %s: %s", type(e).__name__, e)
            ok = False
        if not ok:
            self.refused += 1
        return ok

    @property
    def priority(self) -> int:
        return 10  # checked (and stripped) before any validator that reads the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False

    # -- the checks -----------------------------------------------------------------------

    def _validate(self, record: DHTRecord) -> bool:
        ttl_s = self._peers_keys.get(record.key)
        owner = self._spec_keys.get(record.key)
        signed = _split(record.value)
        swarm_spec = record.key == self._swarm_spec
        ours = ttl_s is not None or owner is not None or swarm_spec
        if signed is None:
            return not ours and not self.closed  # an unsigned record of someone else's key, in an open swarm
        signer = self._verify(record, signed)
        if signer is None:
            return False
        if swarm_spec:  # a member's copy of the swarm's spec, under its own subkey
            if record.subkey == DHTProtocol.IS_REGULAR_VALUE or msgpack.unpackb(record.subkey) != signer:
                return False
            if not self._spec_ok(record, signed.value):
                return False
        elif record.key == _key_id(spec_key(signer)):  # the signer's own spec
            if record.subkey != DHTProtocol.IS_REGULAR_VALUE or not self._spec_ok(record, signed.value):
                return False
        elif owner is not None:
            return False  # another peer's spec key
        elif ttl_s is not None and not self._heartbeat_ok(record, signed.value, signer, ttl_s):
            return False
        self.trust(signer)
        return True

    def _verify(self, record: DHTRecord, signed: _Signed) -> str | None:
        """The signer's peer id when the signature (and a closed swarm's admission) holds."""
        found = _public_key(signed.public_der)
        if found is None:
            return None
        key, signer = found
        msg = _message(record, signed.value, signed.public_der)
        try:
            key.verify(signed.signature, msg, _PSS, hashes.SHA256())
        except InvalidSignature:
            return None
        if self.swarm_key is not None and not self.swarm_key.admits(signer, msg, signed.tag, self.clock()):
            return None
        return signer

    def _heartbeat_ok(self, record: DHTRecord, value: bytes, signer: str, ttl_s: float) -> bool:
        if record.subkey == DHTProtocol.IS_REGULAR_VALUE or msgpack.unpackb(record.subkey) != signer:
            return False
        beat = Heartbeat.parse(signer, MSGPackSerializer.loads(value), record.expiration_time)
        if beat is None:
            return False
        return record.expiration_time <= self.clock() + 2 * heartbeat_ttl(beat.round_s, ttl_s) + 2 * MAX_CLOCK_SKEW_S

    def _spec_ok(self, record: DHTRecord, value: bytes) -> bool:
        v = MSGPackSerializer.loads(value)
        if not (
            isinstance(v, dict)
            and isinstance(v.get("hash"), str)
            and isinstance(v.get("toml"), str)
            and isinstance(v.get("version"), int | str)
            and isinstance(v.get("closed"), bool)
        ):
            return False
        return record.expiration_time <= self.clock() + 2 * SPEC_TTL_S + 2 * MAX_CLOCK_SKEW_S
