"""Atomic file writes: readers see the old file or the new one, never a torn one; no torch imported.

A temporary file beside the target (``.<name>.XXXXXXXX.tmp``, tempfile.mkstemp's pattern), fsynced, renamed
over the target, and the folder fsynced. A kill leaves only the temporary file, which the owner of the
folder sweeps at start (``locomm.checkpoint.sweep_temp_files`` for checkpoints). Every file the project
writes for the user goes through :func:`atomic_path`; ``locomm.checkpoint.save_tensors_atomic`` adds
safetensors.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def fsync_dir(directory: Path) -> None:
    """Make renames in ``directory`` durable (a no-op where a folder cannot be opened or fsynced)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


PRIVATE_DIR_MODE = 0o700
"""Folders locomm creates for the user's files (a checkpoint folder): only the user may list or read them."""


def private_dir(folder: Path) -> None:
    """Create ``folder`` (and its parents) if it is missing, the last one 0700: the user's alone. A folder that
    exists is left as it is (its owner chose its mode)."""
    if not folder.exists():
        folder.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)


def check_private(path: Path, what: str) -> None:
    """Refuse a secret (an identity key, a swarm secret) that others than its owner can read, saying how to fix
    it (ssh does the same for its keys). Raises ``ValueError`` with the message; callers turn it into their
    own error type."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # a missing file is reported by whoever reads it
    if mode & 0o077:
        raise ValueError(
            f"{what} {path} is readable by others (mode {mode & 0o777:04o}): it is a secret; run chmod 600 {path}"
        )


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; what the body writes there replaces ``path`` whole on exit.

    The temporary file is fsynced before the rename and the folder after it; on an error it is removed,
    and a kill leaves it for its folder's owner to sweep (``locomm.checkpoint.sweep_temp_files``).
    Parent folders are created (the last one 0700). The file is 0600 (``mkstemp``'s mode).
    """
    path = Path(path)
    private_dir(path.parent)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, nothing between."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: Path, text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)
