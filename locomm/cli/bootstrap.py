"""``locomm-peer bootstrap``: a dedicated DHT node (and relay) that trains nothing (:mod:`locomm.peer.bootstrap`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from locomm.cli.options import PRESETS, check_swarm_key, fail, load_spec, swarm_key_option
from locomm.config import ConfigError


@click.command()
@click.option("--initial-peers", multiple=True, help="Other bootstrap nodes or peers of the swarm (repeatable).")
@click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False),
    help="Run spec (TOML) to publish and keep alive: joiners without --config take it from this node.",
)
@click.option("--preset", type=PRESETS, help="Publish this preset's spec (without --config).")
@click.option(
    "--host-maddrs",
    multiple=True,
    default=["/ip4/0.0.0.0/tcp/31337"],
    show_default=True,
    help="Where p2pd listens (a bootstrap node is there to be dialled: every interface by default).",
)
@click.option("--announce-maddrs", multiple=True, help="Addresses others should dial (a public IP, a forward).")
@click.option(
    "--identity",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Private key file (RSA, created when missing): a stable peer id, so the --initial-peers you hand "
    "out stay valid across restarts.",
)
@swarm_key_option
@click.option("--no-relay", is_flag=True, help="Do not relay for peers behind NAT.")
@click.option("--announce-file", type=click.Path(dir_okay=False, path_type=Path), hidden=True)
@click.option("-v", "--verbose", count=True)
def bootstrap(
    initial_peers: tuple[str, ...],
    config: str | None,
    preset: str | None,
    host_maddrs: tuple[str, ...],
    announce_maddrs: tuple[str, ...],
    identity: Path | None,
    swarm_key: Path | None,
    no_relay: bool,
    announce_file: Path | None,
    verbose: int,
) -> None:
    """Run a bootstrap node: the DHT entry point (and relay) of a swarm, training nothing, until Ctrl-C.

    Peers join with ``--initial-peers <the address it prints>``. With --config/--preset it also publishes
    that run spec; without, the first peer that joins with --config starts the run.
    """
    try:
        spec = load_spec(config, preset) if (config or preset) else None
        key = check_swarm_key(swarm_key)
        from locomm.peer.options import NodeOptions  # noqa: PLC0415

        opts = NodeOptions(
            initial_peers=initial_peers,
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs,
            identity=identity,
            swarm_key=key,
            announce_file=announce_file,
            relay=not no_relay,
        )
    except ConfigError as e:
        fail(str(e))
    from locomm.cli.daemon import setup_logging  # noqa: PLC0415
    from locomm.peer.bootstrap import run_bootstrap  # noqa: PLC0415 - imports hivemind

    setup_logging(verbose)

    def up(peer: str, maddrs: list[str]) -> None:
        click.echo(f"bootstrap node {peer}; peers join with:", err=True)
        for m in maddrs:
            click.echo(f"  --initial-peers {m}", err=True)

    try:
        asyncio.run(run_bootstrap(opts, spec, on_up=up))
    except ConfigError as e:
        fail(str(e))
