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
        "swarm.key) shared by its peers, or a list of allowed peer ids, one a line. Records without it are refused.",
    )(f)


def check_swarm_key(path: Path | None) -> Path | None:
    """The absolute path of a usable --swarm-key file (ConfigError when it is not one), or None."""
    if path is None:
        return None
    from locomm.peer.transport.records import SwarmKey  # noqa: PLC0415 - imports hivemind

    SwarmKey.load(path)
    return path.resolve()


def load_spec(config: str | None, preset: str | None) -> RunSpec:
    """The run spec from --config (TOML) or --preset; the two together: preset sizes, then the file."""
    if config:
        spec = RunSpec.load(config)
        if preset and preset != spec.model.preset:
            raise ConfigError(f"--preset {preset} conflicts with model.preset={spec.model.preset!r} in {config}")
        return spec
    return RunSpec.preset(preset or os.environ.get("LOCOMM_PRESET", "tiny"))


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
