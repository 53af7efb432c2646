"""The control socket (pause/resume), a checkpoint's own run spec (restart from checkpoints), and the paused
heartbeat in the members rule."""

from __future__ import annotations

import asyncio
import socket
import stat

import pytest
import torch

from locomm.checkpoint import SPEC_KEY, Checkpoint, CheckpointError, checkpoint_spec, save_checkpoint
from locomm.config import RunSpec
from locomm.peer.control import ControlError, ControlServer, control_path, control_request
from locomm.protocol.membership import Heartbeat, members_for_round, swarm_round


async def _serving(tmp_path, handlers):
    server = ControlServer(control_path(tmp_path), handlers)
    await server.start()
    return server, asyncio.ensure_future(server.serve())


async def test_commands_answer_and_socket_is_owner_only(tmp_path):
    calls = []

    async def pause():
        calls.append("pause")
        return {"paused": True}

    server, task = await _serving(tmp_path, {"pause": pause})
    try:
        mode = stat.S_IMODE((tmp_path / "control.sock").stat().st_mode)
        assert mode == 0o600
        ok = await asyncio.to_thread(control_request, tmp_path, "pause")
        assert ok == {"ok": True, "paused": True} and calls == ["pause"]
        unknown = await asyncio.to_thread(control_request, tmp_path, "format-disk")
        assert not unknown["ok"] and "unknown command" in unknown["error"]

        def garbage() -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(tmp_path / "control.sock"))
                s.sendall(b"\xff{not json\n")
                return s.recv(4096)

        assert b'"ok": false' in await asyncio.to_thread(garbage)

        def nested() -> bytes:  # json's recursion limit: an error answer, not an unhandled exception
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(tmp_path / "control.sock"))
                s.sendall(b"[" * 4000 + b"\n")
                return s.recv(4096)

        assert b'"ok": false' in await asyncio.to_thread(nested)
        # A second peer on the same folder is refused while the first one serves.
        with pytest.raises(ControlError, match="another peer"):
            await ControlServer(control_path(tmp_path), {}).start()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert not (tmp_path / "control.sock").exists()
    with pytest.raises(ControlError, match="no running peer"):
        control_request(tmp_path, "pause")


async def test_stale_socket_is_replaced(tmp_path):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "control.sock"))  # a killed peer's: bound, nobody listening
    stale.close()

    async def status():
        return {"phase": "training"}

    server, task = await _serving(tmp_path, {"status": status})
    try:
        assert (await asyncio.to_thread(control_request, tmp_path, "status"))["phase"] == "training"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_long_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ControlError, match="too long"):
        control_path(tmp_path / ("x" * 120))


def _save(tmp_path, spec: RunSpec, *, carry: bool = True) -> None:
    extra = {"round": 3, SPEC_KEY: spec.to_toml()} if carry else {"round": 3}
    ckpt = Checkpoint(step=30, spec_hash=spec.hash(), model={"w": torch.zeros(2)}, extra=extra)
    save_checkpoint(tmp_path / "checkpoint.safetensors", ckpt)


def test_checkpoint_carries_its_spec(tmp_path):
    spec = RunSpec.preset("nano").replace("outer", inner_steps=7)
    _save(tmp_path, spec)
    assert checkpoint_spec(tmp_path).hash() == spec.hash()
    assert checkpoint_spec(tmp_path, spec).hash() == spec.hash()
    with pytest.raises(CheckpointError, match="another spec"):
        checkpoint_spec(tmp_path, RunSpec.preset("nano"))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint_spec(tmp_path / "empty")


def test_older_checkpoint_needs_the_config(tmp_path):
    spec = RunSpec.preset("nano")
    _save(tmp_path, spec, carry=False)
    with pytest.raises(CheckpointError, match="pass the run's --config"):
        checkpoint_spec(tmp_path)
    assert checkpoint_spec(tmp_path, spec).hash() == spec.hash()
    with pytest.raises(CheckpointError, match="another run spec"):
        checkpoint_spec(tmp_path, spec.replace("outer", inner_steps=3))


def test_a_paused_peer_is_a_member_of_no_round_from_its_own():
    beats = [
        Heartbeat(peer="a", round=5),
        Heartbeat(peer="b", round=5),
        Heartbeat(peer="c", round=5, paused=True),
    ]
    assert members_for_round(beats, 4, "a") == ["a", "b", "c"]
    assert members_for_round(beats, 5, "a") == ["a", "b"]
    parsed = Heartbeat.parse("c", {**beats[2].record(), "eta_s": 1.5})
    assert parsed is not None and parsed.paused and parsed.eta_s == 1.5
    assert Heartbeat.parse("c", {**beats[2].record(), "paused": "yes"}) is None
    assert Heartbeat.parse("c", {**beats[2].record(), "eta_s": -1.0}) is None


def test_paused_peers_do_not_hold_the_swarm_round_back():
    """Two of three paused at round 5, one live at 100: a joiner (or a resuming peer) takes 100, not 5."""
    beats = [Heartbeat(peer="a", round=5, paused=True), Heartbeat(peer="b", round=5, paused=True)]
    assert swarm_round([*beats, Heartbeat(peer="c", round=100)]) == 100
