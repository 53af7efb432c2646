"""``locomm-peer pause`` and ``resume``: a volunteer's controls of a running peer, through its control socket
(``locomm/peer/control.py``, in the peer's ``--checkpoint-dir``, owner only)."""

from __future__ import annotations

from pathlib import Path

import click

from locomm.cli.options import emit_json, fail
from locomm.config import ConfigError

_DIR = click.option(
    "--checkpoint-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The running peer's --checkpoint-dir (its control socket is there).",
)
_JSON = click.option("--json", "as_json", is_flag=True, help="Print the peer's answer as one JSON object.")


def _ask(checkpoint_dir: Path, cmd: str, as_json: bool) -> None:
    from locomm.peer.control import control_request  # noqa: PLC0415

    try:
        answer = control_request(checkpoint_dir, cmd)
    except ConfigError as e:
        fail(str(e))
    if as_json:
        emit_json(answer)
    if not answer.get("ok"):
        fail(str(answer.get("error", "the peer refused")))
    if not as_json:
        state = "paused" if answer.get("paused") else answer.get("phase", "?")
        click.echo(f"peer: {state} at round {answer.get('round')} (step {answer.get('step')})")


@click.command()
@_DIR
@_JSON
def pause(checkpoint_dir: Path, as_json: bool) -> None:
    """Pause a running peer: it stops training at the next step, keeps serving its state and stays in the
    swarm marked paused (nobody waits for it). ``locomm-peer resume`` goes on."""
    _ask(checkpoint_dir, "pause", as_json)


@click.command()
@_DIR
@_JSON
def resume(checkpoint_dir: Path, as_json: bool) -> None:
    """Resume a paused peer: it enters the swarm again (with the swarm's state if the swarm moved on)."""
    _ask(checkpoint_dir, "resume", as_json)
