"""``locomm-peer admit``: a founder admits members to a swarm (admission certificates; docs/security.md).

locomm-peer admit --new-founder founder.key                      # once: the founder's key (0600), the swarm id
locomm-peer admit --show-id --identity member.key                # a member: its peer id (key made if missing)
locomm-peer admit --founder-key founder.key --peer QmID --days 30 --out member.cert
locomm-peer join --identity member.key --swarm-key member.cert ...
locomm-peer join --identity member.key --swarm-key member.cert --swarm ID --initial-peers ANY_DHT_NODE
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from locomm.cli.options import emit_json, fail
from locomm.config import ConfigError


@click.command()
@click.option(
    "--new-founder",
    type=click.Path(path_type=Path),
    help="Create a founder key at this path (never overwrites one) and print its id.",
)
@click.option("--founder-key", type=click.Path(path_type=Path), help="The founder key that signs certificates.")
@click.option("--peer", help="The peer id to admit (Qm...; the member prints it with --show-id).")
@click.option(
    "--days",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="How long the certificate is valid.",
)
@click.option("--out", type=click.Path(path_type=Path), help="Where to write the certificate.")
@click.option("--show-id", is_flag=True, help="Print the peer id of --identity (creating that key file if missing).")
@click.option("--identity", type=click.Path(path_type=Path), help="With --show-id: the member's identity file.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def admit(
    new_founder: Path | None,
    founder_key: Path | None,
    peer: str | None,
    days: float,
    out: Path | None,
    show_id: bool,
    identity: Path | None,
    as_json: bool,
) -> None:
    """Admission certificates: make a founder key, sign a member's peer id, or print a member's peer id."""
    from locomm.peer.transport.admission import Certificate, founder_id, load_founder
    from locomm.peer.transport.admission import new_founder as make
    from locomm.peer.transport.records import is_peer_id, load_identity, peer_id_of, public_der

    modes = sum(x for x in (new_founder is not None, founder_key is not None, show_id))
    if modes != 1:
        fail("give one of --new-founder FILE, --founder-key FILE --peer ID --out FILE, or --show-id --identity FILE")
    try:
        if new_founder is not None:
            pub = make(new_founder)
            result = {"founder_key": str(new_founder), "swarm_id": founder_id(pub), "public_key": pub.hex()}
        elif show_id:
            if identity is None:
                fail("--show-id needs --identity FILE (the key the member joins with; made here if missing)")
            if not identity.exists():
                from hivemind.p2p import P2P  # noqa: PLC0415

                identity.parent.mkdir(parents=True, exist_ok=True)
                P2P.generate_identity(str(identity))  # mode 0400
            result = {"identity": str(identity), "peer_id": peer_id_of(public_der(load_identity(identity)))}
        else:
            if not peer or out is None:
                fail("--founder-key needs --peer ID (the member's, from admit --show-id) and --out FILE")
            if not is_peer_id(peer):
                fail(f"--peer {peer[:60]!r} is not a peer id (Qm... or 12D3KooW...)")
            key = load_founder(founder_key)
            cert = Certificate.issue(key, peer, time.time() + days * 86400)
            from locomm.atomic import atomic_write_bytes  # noqa: PLC0415

            atomic_write_bytes(out, cert.encode())
            result = {
                "certificate": str(out),
                "peer_id": peer,
                "swarm_id": founder_id(cert.founder),
                "expires": cert.expires,
            }
    except ConfigError as e:
        fail(str(e))
    if as_json:
        emit_json(result)
    else:
        for k, v in result.items():
            click.echo(f"{k}: {v}")
