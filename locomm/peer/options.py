"""A node's local settings (:class:`NodeOptions`, never part of the shared run spec) and the error a
joiner raises when the swarm's spec is not the one it was given."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from locomm.config import ConfigError

__all__ = ["NodeOptions", "SpecMismatch"]


class SpecMismatch(ConfigError):
    """The swarm runs a different spec or protocol version than this peer was given."""


@dataclass(frozen=True, kw_only=True)
class NodeOptions:
    """Local settings of one node (never part of the shared run spec)."""

    initial_peers: tuple[str, ...] = ()
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity: Path | None = None
    """The libp2p identity file (RSA; created when missing); None: a fresh one in a private temp folder."""
    swarm_key: Path | None = None
    """A closed swarm's key file (>= 32 random bytes, a list of allowed peer ids, or a founder's admission
    certificate); None: an open swarm."""
    swarm_id: str | None = None
    """``join --swarm ID``: the founder's swarm id the certificate in ``swarm_key`` must be of; the spec is then
    read from the members' copies under the swarm's key, through any DHT node."""
    device: str = "auto"
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 5
    """Rounds between checkpoints (and one at shutdown)."""
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    """Address the metrics server binds (0.0.0.0: every interface, e.g. in a container)."""
    log_file: Path | None = None
    tensorboard: Path | None = None
    """TensorBoard's log folder: scalars of every round under ``<run id>/<peer id>`` (peer/trackers.py)."""
    wandb: str | None = None
    """A W&B project: this peer's run, grouped by the swarm's run id (peer/trackers.py)."""
    rounds: int | None = None
    """Stop after this many rounds (default: the rounds spec.train.steps allows)."""
    wait_for_peers: int = 0
    """Before the first round, wait (up to a minute) until this many peers, self included, are admitted."""
    until_round: int | None = None
    """Stop when the swarm's round counter reaches this (all peers of a local swarm end together)."""
    shard: tuple[int, int] | None = None
    """(index, count) of this node's data shard; default: derived from the peer id."""
    overlap: bool = True
    announce_file: Path | None = None
    """Write this node's multiaddrs here once it is up (used by `locomm-peer swarm`)."""
    final_weights: Path | None = None
    """Write the final outer weights here (safetensors) on a clean finish."""
    attack: str | None = None
    """Benchmarks only: this peer sends an attacker's updates (``protocol/attacks.py``)."""
    spec_from_user: bool = True
    """False when the spec is only a default: a joiner then takes the swarm's without comparing."""
    reporter: Any = None
    """Shows the user what the node is doing (locomm.cli.display.JoinReporter): ``update(status)``
    about twice a second, ``round_done(status)`` after each round, ``finish(summary)`` at exit."""
    relay: bool = True
    """libp2p circuit relays (p2pd ``-relay``, circuit v2): reach a NATed peer through a relay, and (an open
    peer) serve as a relay for others. p2pd runs the relay service whenever relays are on (hivemind has no
    switch for the service alone), so opting out of serving (``--no-relay``) also stops using relays."""
    auto_relay: bool = True
    """When this node is not reachable (AutoNAT says private, or ``reachability="private"``), reserve a slot on
    a relay and announce the relayed ``/p2p-circuit`` address (p2pd ``-autoRelay``); peers that reach us through
    it then try hole punching (DCUtR, on with hivemind's AutoNAT). No effect on a reachable node."""
    relays: tuple[str, ...] = ()
    """Relays to reserve on (full multiaddrs with ``/p2p/<id>``); empty: the initial peers, then DHT peers."""
    reachability: str | None = None
    """``"public"`` or ``"private"``: skip AutoNAT's guess (it needs a few dial-backs first); None: AutoNAT."""
    averager_port: int = 0
    """DiLoCo only: the TCP port of the averager's own p2pd (bound on the host addresses' IPs, and announced on
    the announce addresses' IPs when not 0; 0: any free port, announced as bound)."""

    max_memory_gb: float | None = None
    """The memory the inner step may use (``join --max-memory``); None: the device's free memory. It picks the
    micro-batch, gradient accumulation, bf16 autocast and activation checkpointing (``locomm/train/plan.py``);
    the numerics stay the run spec's."""
    max_upload_mbit: float | None = None
    """Cap on this peer's upload over every locomm stream and service (a token bucket in the exchange layer)."""
    max_download_mbit: float | None = None
    """Cap on this peer's download, the same way."""
    eval_every: int | None = None
    """Rounds between validation evaluations (0: only at start and end); None: from spec.train.eval_interval."""
    control: bool = True
    """Serve ``locomm-peer pause``/``resume`` on a local socket next to the checkpoint folder (owner only)."""
    island: str | None = None
    """``join --island NAME``: train with the peers of the same island name as one worker, SCAPE every step
    (``peer/island/member.py``); None: a peer on its own."""
    island_size: int = 2
    island_key: Path | None = None
    """Closes the island (a secret of >= 32 bytes, or a list of peer ids, as ``--swarm-key``); None: open."""
    """How many peers the island has (it forms when that many have announced the name)."""
    island_digest: bool = False
    """Tests only (``LOCOMM_ISLAND_DIGEST=1``): log a hash of the weights after every island step."""

    def __post_init__(self) -> None:
        for name in ("max_upload_mbit", "max_download_mbit", "max_memory_gb"):
            if (v := getattr(self, name)) is not None and not v > 0:
                raise ConfigError(f"{name}: must be > 0, got {v}")
        if self.island is not None and not (0 < len(self.island) <= 64 and 2 <= self.island_size <= 64):
            raise ConfigError(f"island: a name of 1-64 characters and a size in [2, 64], got {self.island!r}")
        if self.eval_every is not None and self.eval_every < 0:
            raise ConfigError(f"eval_every: must be >= 0, got {self.eval_every}")
        if self.reachability not in (None, "public", "private"):
            raise ConfigError(f"reachability: 'public', 'private' or None, got {self.reachability!r}")
        if self.relays and not (self.relay and self.auto_relay):
            raise ConfigError("relays need relay and auto_relay on")
        if bad := [m for m in self.relays if "/p2p/" not in m]:  # p2pd would panic at start-up
            raise ConfigError(f"a relay needs its peer id (/p2p/<id>): {', '.join(bad)}")

    def p2p_kwargs(self, initial_peers: Sequence[str] = ()) -> dict[str, Any]:
        """The node's ``hivemind.P2P.create`` arguments: its addresses and :meth:`nat_kwargs`."""
        announce = list(self.announce_maddrs) or None
        return {"host_maddrs": list(self.host_maddrs), "announce_maddrs": announce, **self.nat_kwargs(initial_peers)}

    def nat_kwargs(self, initial_peers: Sequence[str] = ()) -> dict[str, Any]:
        """The NAT-traversal arguments of ``hivemind.P2P.create`` (the node's, and the DiLoCo averager's DHT's):
        relays, auto-relay with its trusted relays (``relays``, else ``initial_peers``), reachability."""
        auto = self.relay and self.auto_relay
        relays = [m for m in (self.relays or initial_peers) if "/p2p/" in m] if auto else []
        kw: dict[str, Any] = {"use_relay": self.relay, "use_auto_relay": auto, "force_reachability": self.reachability}
        return {**kw, "trusted_relays": relays} if relays else kw


def local_defaults(argv: Sequence[str]) -> list[str]:
    """What a test's or local swarm's ``join`` adds to ``argv``: loopback, any port, unless it says where to
    listen (``join`` listens on every interface on a fixed port by default); ``--new-swarm`` for the first
    peer (no ``--initial-peers``, nothing resumed)."""
    extra = [] if "--host-maddrs" in argv else ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    if not any(a in argv for a in ("--initial-peers", "--new-swarm", "--resume-from", "--plan")):
        extra.append("--new-swarm")
    return extra
