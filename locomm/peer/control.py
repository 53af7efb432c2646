"""The local control socket: ``locomm-peer pause``, ``resume`` and ``control-status`` talk to a running peer.

Notable:
- A Unix socket in the peer's checkpoint folder (``control.sock``), created owner-only: the folder's
  permissions are not trusted (the socket is made under a umask of 0o177, then checked), and the server
  checks every caller's uid (``SO_PEERCRED``) against its own, so another user on the machine can neither
  pause a volunteer's peer nor read it.
- One request per connection: one JSON line ``{"cmd": "pause"}`` in (at most ``MAX_REQUEST`` bytes, read
  under a deadline), one JSON line out (``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``). An
  unknown command or garbage is answered with an error, never raised.
- A stale socket of a killed peer is replaced; a live one (another peer on the same folder) is an error,
  since two peers on one checkpoint folder would overwrite each other's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from locomm.atomic import private_dir
from locomm.config import ConfigError

__all__ = ["CONTROL_NAME", "ControlError", "ControlServer", "control_path", "control_request"]

log = logging.getLogger(__name__)
CONTROL_NAME = "control.sock"
MAX_REQUEST = 4096
REQUEST_TIMEOUT_S = 5.0
_MAX_UNIX_PATH = 107  # sun_path is 108 bytes on Linux, NUL included

Handler = Callable[[], Awaitable[Mapping[str, Any]]]


class ControlError(ConfigError):
    """The control socket cannot be made or reached (the CLI prints it and exits 2)."""


def control_path(checkpoint_dir: Path) -> Path:
    """Where a peer with this checkpoint folder serves its control socket."""
    path = Path(checkpoint_dir).absolute() / CONTROL_NAME
    if len(os.fsencode(path)) > _MAX_UNIX_PATH:
        raise ControlError(f"{path}: too long for a Unix socket ({_MAX_UNIX_PATH} bytes); use a shorter folder")
    return path


def _peer_uid(sock: socket.socket) -> int | None:
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return struct.unpack("3i", creds)[1]


class ControlServer:
    """Serves ``handlers`` (command name -> async function returning a JSON-able mapping) on ``path``."""

    def __init__(self, path: Path, handlers: Mapping[str, Handler]) -> None:
        self.path = Path(path)
        self.handlers = dict(handlers)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        private_dir(self.path.parent)  # the checkpoint folder: the user's alone
        if self.path.exists() or self.path.is_symlink():
            if _answers(self.path):
                raise ControlError(f"{self.path}: another peer is running on this checkpoint folder")
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # born owner-only; no await while the process-wide umask is changed
        try:
            sock.bind(str(self.path))
        except OSError as e:
            sock.close()
            raise ControlError(f"{self.path}: cannot serve the control socket: {e}") from None
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._server = await asyncio.start_unix_server(self._serve, sock=sock)

    async def serve(self) -> None:
        """Serve until cancelled (a task of the host's), then remove the socket."""
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            await self.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            if sock is None or _peer_uid(sock) != os.getuid():
                await self._answer(writer, {"ok": False, "error": "not the peer's owner"})
                return
            try:
                line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)
                if len(line) > MAX_REQUEST:
                    raise ValueError("request too long")
                request = json.loads(line)
                cmd = request["cmd"] if isinstance(request, dict) else None
            except (TimeoutError, ValueError, KeyError, RecursionError, asyncio.LimitOverrunError) as e:
                await self._answer(writer, {"ok": False, "error": f"bad request: {e}"})
                return
            handler = self.handlers.get(cmd) if isinstance(cmd, str) else None
            if handler is None:
                await self._answer(writer, {"ok": False, "error": f"unknown command {cmd!r}; {sorted(self.handlers)}"})
                return
            try:
                answer = {"ok": True, **(await handler())}
            except ControlError as e:
                answer = {"ok": False, "error": str(e)}
            await self._answer(writer, answer)
        except (ConnectionError, OSError) as e:
            log.debug("control connection: %s", e)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, answer: Mapping[str, Any]) -> None:
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def control_request(checkpoint_dir: Path, cmd: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one command to the peer serving ``checkpoint_dir`` and return its answer (blocking; for the CLI).

    Raises:
        ControlError: no peer answers there, or it answered garbage.
    """
    path = control_path(checkpoint_dir)
    if not path.exists():
        raise ControlError(f"no running peer has {checkpoint_dir} as its checkpoint folder ({path} is missing)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
            s.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n") and len(data) <= MAX_REQUEST:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        except OSError as e:
            raise ControlError(f"{path}: the peer does not answer ({e}); is it still running?") from None
    try:
        answer = json.loads(data)
    except ValueError:
        raise ControlError(f"{path}: the peer answered garbage: {data[:80]!r}") from None
    if not isinstance(answer, dict):
        raise ControlError(f"{path}: the peer answered garbage: {data[:80]!r}")
    return answer
