"""What every ``locomm-peer`` command shares: the run spec from --config/--preset, one-line errors, the JSON line.

Light on purpose (click and the config only): every command module imports it, and ``--help`` must stay
instant.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from locomm.config import MODEL_PRESETS, ConfigError, RunSpec

PRESETS = click.Choice(sorted(MODEL_PRESETS))
F = TypeVar("F", bound=Callable[..., Any])


def swarm_key_option(f: F) -> F:
    """``--swarm-key FILE``: the key of a closed swarm (join, swarm and status share it)."""
    return click.option(
        "--swarm-key",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Closed swarm: a file of >= 32 random bytes (head -c 32 /dev/urandom > swarm.key; chmod 600 "
        "swarm.key) shared by its peers, a list of allowed peer ids, one a line, or this peer's admission "
        "certificate (locomm-peer admit; with the --identity it names). Records without it are refused.",
    )(f)


def check_swarm_id(swarm_id: str, swarm_key: Path | None) -> None:
    """``join --swarm ID``: the --swarm-key must be an admission certificate of that founder (ConfigError with
    the fix otherwise), checked before p2pd starts; the host checks the same again (``peer/spec_sync.py``)."""
    from locomm.peer.transport.records import SwarmKey, check_swarm_id  # noqa: PLC0415 - imports hivemind

    check_swarm_id(swarm_id, SwarmKey.load(swarm_key) if swarm_key is not None else None)


def check_swarm_key(path: Path | None) -> Path | None:
    """The absolute path of a usable --swarm-key file (ConfigError when it is not one), or None."""
    if path is None:
        return None
    from locomm.peer.transport.records import SwarmKey  # noqa: PLC0415 - imports hivemind

    SwarmKey.load(path)
    return path.resolve()


def load_spec(config: str | None, preset: str | None) -> RunSpec:
    """The run spec from --config (TOML) or --preset (else $LOCOMM_PRESET, else DEFAULT_PRESET); the two together:
    preset sizes, then the file."""
    if config:
        spec = RunSpec.load(config)
        if preset and preset != spec.model.preset:
            raise ConfigError(f"--preset {preset} conflicts with model.preset={spec.model.preset!r} in {config}")
        return spec
    return RunSpec.preset(preset or os.environ.get("LOCOMM_PRESET") or DEFAULT_PRESET)


DEFAULT_PRESET = "nano"
"""The preset every command uses without --preset or --config (or $LOCOMM_PRESET): one default, the one a 2-core
laptop trains in a minute."""


DEFAULT_PORT = 31337
"""The TCP port ``join`` and ``doctor`` listen on by default, on every interface (``--port`` changes it)."""


def listen_options(f: F) -> F:
    """``--host-maddrs``, ``--port``, ``--public-ip``, ``--announce-maddrs``: where a peer listens and what it
    announces (join and doctor share them, so doctor checks exactly what join would run)."""
    f = click.option("--announce-maddrs", multiple=True, help="Addresses others should dial (NAT, port forward).")(f)
    f = click.option(
        "--public-ip",
        help="This machine's public IP (a forwarded port): announces /ip4/IP/tcp/PORT for others to dial.",
    )(f)
    f = click.option(
        "--port",
        type=click.IntRange(0, 65535),
        default=DEFAULT_PORT,
        show_default=True,
        help="TCP port to listen on, every interface (0: any free port).",
    )(f)
    return click.option(
        "--host-maddrs",
        multiple=True,
        help="Where p2pd listens, as multiaddrs (overrides --port), e.g. /ip4/127.0.0.1/tcp/0 for this machine only.",
    )(f)


def listen_addrs(
    host_maddrs: tuple[str, ...], port: int, public_ip: str | None, announce_maddrs: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(host_maddrs, announce_maddrs) from the listen options: every interface on ``port`` unless
    ``--host-maddrs`` says otherwise; ``--public-ip`` adds /ip4/IP/tcp/PORT to what is announced."""
    hosts = tuple(host_maddrs) or (f"/ip4/0.0.0.0/tcp/{port}",)
    announce = tuple(announce_maddrs)
    if public_ip:
        import ipaddress  # noqa: PLC0415

        try:
            ip = ipaddress.ip_address(public_ip)
        except ValueError:
            raise ConfigError(f"--public-ip: not an IP address: {public_ip!r}") from None
        if port == 0:
            raise ConfigError("--public-ip needs a fixed --port (others dial IP:PORT), not 0")
        announce += (f"/ip{ip.version}/{ip}/tcp/{port}",)
    return hosts, announce


class MemorySize(click.ParamType):
    """A memory size as accelerate and Petals write it: ``8GiB``, ``8GB``, ``512MiB``, or a bare number of GiB;
    the value is in GiB (what the memory plan takes)."""

    name = "size"
    UNITS = {"": 1.0, "g": 1.0, "gib": 1.0, "gb": 1e9 / 2**30, "m": 1 / 1024, "mib": 1 / 1024, "mb": 1e6 / 2**30}
    UNITS |= {"t": 1024.0, "tib": 1024.0, "tb": 1e12 / 2**30}

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, int | float):
            return float(value)
        text = str(value).strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num) :]
        try:
            gib = float(num) * self.UNITS[unit]
        except (ValueError, KeyError):
            self.fail(f"{value!r}: a size such as 8GiB, 8GB, 512MiB or 8 (GiB)", param, ctx)
        return gib


def fail(msg: str) -> None:
    """A user's error: one line on stderr, exit status 2 (never a traceback)."""
    click.echo(f"error: {msg}", err=True)
    sys.exit(2)


def emit_json(obj: dict[str, Any]) -> None:
    """The last line of stdout: one JSON object."""
    click.echo(json.dumps(obj, sort_keys=True))


def parse_pipeline(text: str) -> tuple[int, int]:
    """(stages, replicas) from ``--pipeline SxR``."""
    try:
        s, r = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--pipeline: expected STAGESxREPLICAS such as 2x2, got {text!r}") from None
    if s < 2 or not 1 <= r <= 16:
        raise ConfigError(f"--pipeline: need at least 2 stages and 1-16 replicas, got {text!r}")
    return s, r


def parse_islands(text: str) -> tuple[int, int]:
    """(islands, size) from ``--islands KxN``."""
    try:
        k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--islands: expected ISLANDSxSIZE such as 2x2, got {text!r}") from None
    if not 1 <= k <= 16 or not 2 <= n <= 16:
        raise ConfigError(f"--islands: need 1-16 islands of 2-16 peers, got {text!r}")
    return k, n


def parse_shard(text: str) -> tuple[int, int]:
    """(index, count) from ``--shard INDEX/COUNT``."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard: expected INDEX/COUNT, got {text!r}") from None
    if not 0 <= i < n:
        raise ConfigError(f"--shard: index {i} not in [0, {n})")
    return i, n
