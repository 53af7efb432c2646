"""Admission certificates: a swarm whose members a founder admits, one peer id at a time, with no server.

The founder holds an Ed25519 key (``locomm-peer admit --new-founder founder.key``). For each member it signs
(peer id, expiry) with that key: a :class:`Certificate` (``locomm-peer admit --founder-key founder.key --peer
QmID --days 30 --out member.cert``). The member passes its certificate as ``--swarm-key member.cert`` together
with the ``--identity`` the certificate names. Every record it writes carries the certificate in its trailer
(:mod:`locomm.peer.transport.records`), and every node refuses a record whose signer holds no valid certificate
of the same founder, so a stream, which a peer serves only to identities with a valid heartbeat record, needs one
too. Minting identities then needs the founder's key: what the secret-key mode (anyone holding the shared secret
can mint) and the open mode (anyone can) do not give.

File formats: a certificate file is ``LCA1`` + msgpack [peer id, expiry (unix s), founder public key (32 B),
signature (64 B)]; the founder key is an unencrypted PKCS#8 PEM, created 0600 and refused when others can read it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from locomm.atomic import atomic_write_bytes, check_private
from locomm.config import ConfigError

__all__ = ["CERT_MAGIC", "Certificate", "founder_id", "load_founder", "new_founder"]

CERT_MAGIC = b"LCA1"
MAX_CERT_BYTES = 512
_DOMAIN = b"locomm admission v1\x00"


def _signed_bytes(peer: str, expires: float, founder: bytes) -> bytes:
    return _DOMAIN + msgpack.packb([peer, float(expires), founder])


def founder_id(public: bytes) -> str:
    """A founder's swarm id, to share like a magnet link (``join --swarm ID``): the first 32 hex digits (128
    bits) of its public key's sha256, so that grinding a second founder key to the same id is out of reach."""
    import hashlib  # noqa: PLC0415

    return hashlib.sha256(public).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class Certificate:
    """The founder's signature on (peer id, expiry)."""

    peer: str
    expires: float
    founder: bytes
    """The founder's raw Ed25519 public key (32 bytes)."""
    signature: bytes

    @classmethod
    def issue(cls, key: Ed25519PrivateKey, peer: str, expires: float) -> Certificate:
        founder = _raw_public(key)
        return cls(peer, float(expires), founder, key.sign(_signed_bytes(peer, expires, founder)))

    def encode(self) -> bytes:
        return CERT_MAGIC + msgpack.packb([self.peer, self.expires, self.founder, self.signature])

    @classmethod
    def decode(cls, data: bytes) -> Certificate | None:
        """The certificate in ``data``, or None when it is not a well-formed one (never raises)."""
        if not isinstance(data, bytes | bytearray) or len(data) > MAX_CERT_BYTES or data[:4] != CERT_MAGIC:
            return None
        try:
            f = msgpack.unpackb(bytes(data[4:]), raw=False)
        except Exception:  # noqa: BLE001 - garbage is "no certificate"
            return None
        if not (
            isinstance(f, list)
            and len(f) == 4
            and isinstance(f[0], str)
            and isinstance(f[1], float)
            and isinstance(f[2], bytes)
            and len(f[2]) == 32
            and isinstance(f[3], bytes)
            and len(f[3]) == 64
        ):
            return None
        return cls(*f)

    def valid_for(self, signer: str, founder: bytes, now: float | None = None) -> bool:
        """Issued by ``founder`` to ``signer`` and not expired."""
        if self.founder != founder or self.peer != signer or self.expires <= (time.time() if now is None else now):
            return False
        try:
            Ed25519PublicKey.from_public_bytes(founder).verify(
                self.signature, _signed_bytes(self.peer, self.expires, self.founder)
            )
        except (InvalidSignature, ValueError):
            return False
        return True

    @classmethod
    def load(cls, path: str | Path) -> Certificate:
        data = Path(path).read_bytes()
        cert = cls.decode(data)
        if cert is None:
            raise ConfigError(f"{path}: not a locomm admission certificate")
        return cert


def _raw_public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def new_founder(path: str | Path) -> bytes:
    """Create a founder key at ``path`` (0600; an existing file is never overwritten); its public key."""
    path = Path(path)
    if path.exists():
        raise ConfigError(f"{path} exists already: a founder key is never overwritten (use --founder-key {path})")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    atomic_write_bytes(path, pem)  # 0600, as every file locomm writes
    return _raw_public(key)


def load_founder(path: str | Path) -> Ed25519PrivateKey:
    """The founder key at ``path`` (ConfigError, with the fix, when missing, readable by others or not one)."""
    path = Path(path)
    try:
        check_private(path, "--founder-key")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as e:
        raise ConfigError(f"--founder-key {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"--founder-key {path}: not a PEM private key ({e})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"--founder-key {path}: not an Ed25519 key (make one with admit --new-founder FILE)")
    return key
