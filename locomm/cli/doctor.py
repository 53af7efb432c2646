"""``locomm-peer doctor``: a preflight a volunteer runs before ``join`` (see docs/doctor.md).

Exit status: 0 when no check FAILs (WARNs included), 1 when one does, 2 on bad input.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from locomm.cli.options import (
    PRESETS,
    check_swarm_key,
    fail,
    listen_addrs,
    listen_options,
    load_spec,
    swarm_key_option,
)
from locomm.config import ConfigError


@click.command()
@click.option(
    "--initial-peers",
    multiple=True,
    help="Multiaddr of a swarm peer, ending in /p2p/<peer id> (repeatable). Without it the swarm checks "
    "(dial-back, clock, throughput) are skipped.",
)
@swarm_key_option
@listen_options  # exactly join's: the port must be free, so run doctor before join, not beside it
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where join will checkpoint (default: the free space of the current folder is checked).",
)
@click.option("--device", default=lambda: os.environ.get("LOCOMM_DEVICE", "auto"), show_default="auto")
@click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False),
    help="Run spec (TOML) for the model size (default: the swarm's spec, else --preset).",
)
@click.option("--preset", type=PRESETS, help="Model preset for the size checks (default nano).")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as one JSON object.")
def doctor(
    initial_peers: tuple[str, ...],
    swarm_key: Path | None,
    host_maddrs: tuple[str, ...],
    port: int,
    public_ip: str | None,
    announce_maddrs: tuple[str, ...],
    checkpoint_dir: Path | None,
    device: str,
    config: str | None,
    preset: str | None,
    as_json: bool,
) -> None:
    """Check this machine and its link to a swarm before joining: OK / WARN / FAIL, each with its fix.

    Exit status 0 when nothing FAILs, 1 otherwise (2: bad input).
    """
    try:
        host_maddrs, announce_maddrs = listen_addrs(host_maddrs, port, public_ip, announce_maddrs)
        spec = load_spec(config, preset)
        key = check_swarm_key(swarm_key)
        if any("/p2p/" not in m for m in initial_peers):
            raise ConfigError("--initial-peers must name the peer: a multiaddr ending in /p2p/<peer id>")
        if any(_port(m) == "0" for m in announce_maddrs):
            raise ConfigError("--announce-maddrs needs the real port, not 0")
        for m in (*initial_peers, *host_maddrs, *announce_maddrs):
            _check_maddr(m)
    except ConfigError as e:
        fail(str(e))
    from locomm.doctor.machine import Check, local_checks, render, report  # noqa: PLC0415 - imports torch

    if initial_peers:
        from locomm.doctor.swarm import run_swarm_checks  # noqa: PLC0415 - imports hivemind

        checks, info = run_swarm_checks(
            list(initial_peers), swarm_key=key, host_maddrs=list(host_maddrs), announce_maddrs=list(announce_maddrs)
        )
        if config is None and preset is None and "spec" in info:
            spec = info["spec"]  # size the disk and memory checks by the model the swarm trains
    else:
        checks = [Check("swarm", "SKIP", None, "", "no --initial-peers: dial-back, clock and throughput not checked")]
    checks += local_checks(spec, checkpoint_dir=checkpoint_dir, device=device)
    out = report(checks)
    click.echo(json.dumps(out, sort_keys=True) if as_json else render(checks))
    sys.exit(0 if out["ok"] else 1)


def _check_maddr(m: str) -> None:
    from hivemind.utils.multiaddr import Multiaddr  # noqa: PLC0415

    try:
        Multiaddr(m)
    except Exception as e:  # noqa: BLE001 - multiaddr raises several kinds
        raise ConfigError(f"not a multiaddr: {m!r} ({e})") from None


def _port(m: str) -> str | None:
    parts = m.split("/")
    return next((v for p, v in zip(parts, parts[1:]) if p in ("tcp", "udp")), None)
