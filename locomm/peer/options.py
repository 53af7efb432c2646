"""A node's local settings (:class:`NodeOptions`, never part of the shared run spec) and the error a
joiner raises when the swarm's spec is not the one it was given."""

from __future__ import annotations

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
    """A closed swarm's key file (>= 32 random bytes, or a list of allowed peer ids); None: an open swarm."""
    device: str = "auto"
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 5
    """Rounds between checkpoints (and one at shutdown)."""
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    """Address the metrics server binds (0.0.0.0: every interface, e.g. in a container)."""
    log_file: Path | None = None
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
