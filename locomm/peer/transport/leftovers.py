"""What hivemind's p2pd leaves behind when a peer is killed: its two unix sockets in the temp folder.

hivemind names them ``hivemind-p2pd-<uid>.sock`` and ``hivemind-p2pclient-<uid>.sock`` (``P2P.create``) and
removes them in ``P2P.shutdown``; a kill (SIGKILL, OOM, power) skips that, and a long-lived machine gathers
them (82 in one chaos run). A peer records its own daemon's two socket paths in a file named by its process
id as p2pd is spawned (:func:`record_spawn`, from peer/lifeline.py's hook) and once it runs (:func:`record`),
removes them and the record on exit (:func:`forget`), and at every start removes what
the records of processes no longer alive name (:func:`sweep`). Only recorded paths that match hivemind's
names are ever removed: never another program's socket, nor a live peer's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from locomm.atomic import private_dir

log = logging.getLogger(__name__)

SOCKET_NAME = re.compile(r"hivemind-p2p(d|client)-[A-Za-z0-9_-]{1,64}\.sock")
"""hivemind's socket names (``P2P._UNIX_SOCKET_PREFIX`` + ``p2pd-`` / ``p2pclient-`` + a random token)."""


def records_dir() -> Path:
    """Where the records live: ``$XDG_RUNTIME_DIR`` (cleared at logout) or the temp folder, per user."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"locomm-{os.getuid()}" / "p2pd"


def sockets_of(p2p: Any) -> list[str]:
    """The unix socket paths of ``p2p``'s daemon and client (none for a daemon we did not start)."""
    out = []
    for attr in ("_daemon_listen_maddr", "_client_listen_maddr"):
        with contextlib.suppress(Exception):
            path = getattr(p2p, attr)["unix"]
            if SOCKET_NAME.fullmatch(Path(path).name):
                out.append(path)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def record_spawn(listen: object, where: Path | None = None) -> Path | None:
    """Note the sockets of a p2pd about to start, from its ``listen`` multiaddr (``_make_process_args``'s
    argument): before p2pd exists, so a kill while ``P2P.create`` waits for it leaves a record too (23 of 25
    sockets left in the 60-minute chaos run came from peers killed there). :func:`record` names the same file."""
    try:
        daemon = Path(str(listen).removeprefix("/unix"))
    except Exception:  # noqa: BLE001 - an argument we do not know: nothing to note
        return None
    if not SOCKET_NAME.fullmatch(daemon.name) or "-p2pd-" not in daemon.name:
        return None
    client = daemon.with_name(daemon.name.replace("-p2pd-", "-p2pclient-", 1))
    return _write(where, [str(daemon), str(client)])


def record(p2p: Any, where: Path | None = None) -> Path | None:
    """Note ``p2p``'s sockets under this process's id; the record's path (None if it cannot be written)."""
    return _write(where, sockets_of(p2p))


def _write(where: Path | None, paths: list[str]) -> Path | None:
    if not paths:
        return None
    folder = where or records_dir()
    try:
        private_dir(folder)
        path = _record_path(folder, paths)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:  # as every file we write
            f.write(json.dumps({"pid": os.getpid(), "sockets": paths}))
    except OSError as e:  # a full or read-only disk: the sockets may be left, nothing else
        log.debug("cannot record p2pd's sockets: %s", e)
        return None
    return path


def _record_path(folder: Path, paths: list[str]) -> Path:
    return folder / f"{os.getpid()}-{Path(paths[0]).stem.rsplit('-', 1)[-1]}.json"


def forget(rec: Path | None, p2p: Any) -> None:
    """On exit: remove ``p2p``'s sockets if they are still there, and the record (``rec``; None: the one
    :func:`record_spawn` wrote as it started, for a p2pd that never answered)."""
    paths = sockets_of(p2p)
    for path in paths:
        with contextlib.suppress(OSError):
            os.remove(path)
    if rec is None and paths:
        rec = _record_path(records_dir(), paths)
    if rec is not None:
        with contextlib.suppress(OSError):
            rec.unlink()


def sweep(where: Path | None = None) -> int:
    """Remove the sockets that records of dead processes name, and those records; how many sockets went."""
    folder = where or records_dir()
    removed = 0
    try:
        records = list(folder.glob("*.json"))
    except OSError:
        return 0
    for rec in records:
        try:
            data = json.loads(rec.read_text())
            pid, paths = int(data["pid"]), [str(p) for p in data["sockets"]]
        except (OSError, ValueError, KeyError, TypeError):
            with contextlib.suppress(OSError):
                rec.unlink()  # a torn record (a kill while writing it) names nothing we can trust
            continue
        if _alive(pid):
            continue
        for path in paths:
            if SOCKET_NAME.fullmatch(Path(path).name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                    removed += 1
        with contextlib.suppress(OSError):
            rec.unlink()
    if removed:
        log.info("removed %d socket(s) that killed peers' p2pd left", removed)
    return removed
