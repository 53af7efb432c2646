"""Shared plumbing of the scripts in benchmarks/: flags, results paths, atomic JSON, resume, metadata.

Every script imports it as a sibling module (``python benchmarks/x.py`` puts benchmarks/ on
``sys.path``; locomm itself is installed editable, so no script touches ``sys.path``)::

    import _harness

    ap = _harness.parser(__doc__, out="algorithms.json", quick=True, resume=True)
    ap.add_argument("--workers", type=int, default=8)   # the script's own flags
    args = ap.parse_args()
    done = _harness.Entries(args.out, resume=args.resume)
    for name in names:
        if name in done:                                 # resumed: already on disk
            continue
        done.add(name, measure(name))                    # rewritten atomically after each entry

The conventions:

- **Results path.** Results live in ``benchmarks/results/`` (:data:`RESULTS`); a script names its
  default file relative to it (:func:`results_path`), and ``--out`` overrides it.
- **Atomic JSON.** :func:`write_json` writes a temporary file beside the target, fsyncs it and
  renames it over the target, so a killed run leaves the old file or the new one, never half of one.
- **Platform metadata.** Every JSON written through :func:`write_json` carries a ``"platform"`` key
  (:func:`platform_info`: python, torch, hivemind and locomm versions, the git commit, the CPU
  count; no hostname). A dict gets the key added; a list is wrapped as
  ``{"platform": ..., "rows": [...]}``; :func:`read_json` undoes the wrapping.
- **Resume.** ``--resume`` keeps what a previous run wrote: :class:`Entries` loads the entries of
  the existing file and the script skips those (one file, many entries); scripts that write one
  file per run skip files that exist (:func:`done`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from locomm.atomic import atomic_write_text

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
"""Where benchmark results go: ``benchmarks/results/``."""

PLATFORM_KEY = "platform"


def results_path(name: str | Path) -> Path:
    """The path of a results file: ``name`` relative to :data:`RESULTS` (absolute paths pass through)."""
    return RESULTS / name


def parser(
    doc: str | None,
    *,
    out: str | Path | None | bool = None,
    out_help: str | None = None,
    resume: bool = False,
    quick: bool = False,
    quick_help: str = "The quickest settings: a smoke run, not a measurement",
    summary: bool = False,
) -> argparse.ArgumentParser:
    """An ArgumentParser with the common flags; the script adds its own.

    Args:
        doc: The script's module docstring (the description; shown raw, so its examples keep
            their line breaks).
        out: Default results file, relative to :data:`RESULTS`; ``None`` means ``--out`` is optional
            and defaults to ``None`` (the script writes no file unless asked); ``False`` means no
            ``--out`` at all (scripts that write one file per run under a fixed folder).
        out_help: Help text for ``--out`` (a default one names the default path).
        resume: Add ``--resume`` (keep and skip the entries a previous run wrote).
        quick: Add ``--quick`` (the script's quickest settings).
        quick_help: Help text for ``--quick``.
        summary: Use only the first line of ``doc`` as the description.
    """
    desc = (doc or "").strip()
    if summary:
        desc = desc.splitlines()[0] if desc else ""
    ap = argparse.ArgumentParser(description=desc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if out is not False:
        default = results_path(out) if out is not None and out is not True else None
        if out_help is None:
            out_help = f"Results JSON (default {_show(default)})" if default else "Also write the results JSON here"
        ap.add_argument("--out", type=Path, default=default, help=out_help)
    if resume:
        ap.add_argument("--resume", action="store_true", help="Keep the results already on disk and skip them")
    if quick:
        ap.add_argument("--quick", action="store_true", help=quick_help)
    return ap


def _show(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _git() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def platform_info() -> dict[str, Any]:
    """What ran the benchmark, with no hostname: versions, the git commit, the machine's size.

    Versions come from the installed distributions, so this imports neither torch nor hivemind;
    the torch thread count and GPU are added only when the script has imported torch itself.
    """
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "system": platform.system(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": _version("torch"),
        "hivemind": _version("hivemind"),
        "locomm": _version("locomm"),
        **_git(),
        "argv": [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv else [],
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


def write_json(
    path: str | Path,
    obj: Any,
    *,
    indent: int | None = 1,
    sort_keys: bool = False,
    default: Any = None,
    meta: bool = True,
) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (temporary file, fsync, rename); returns the path.

    With ``meta`` (the default) a dict gets a fresh ``"platform"`` key (:func:`platform_info`; one
    read back from an earlier file is replaced) and a list is wrapped as ``{"platform": ..., "rows": obj}``.
    Parent folders are created.
    """
    path = Path(path)
    if meta:
        if isinstance(obj, dict):
            obj = {**obj, PLATFORM_KEY: platform_info()}
        elif isinstance(obj, list):
            obj = {PLATFORM_KEY: platform_info(), "rows": obj}
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default) + "\n"
    atomic_write_text(path, text)
    return path


def read_json(path: str | Path) -> Any:
    """Read a JSON file; a list that :func:`write_json` wrapped comes back as the list."""
    obj = json.loads(Path(path).read_text())
    if isinstance(obj, dict) and set(obj) == {PLATFORM_KEY, "rows"}:
        return obj["rows"]
    return obj


def done(path: str | Path, resume: bool = True) -> bool:
    """Whether a one-file-per-run result is already on disk (and ``resume`` says to keep it)."""
    return resume and Path(path).exists()


def claim(path: str | Path) -> bool:
    """Claim a one-file-per-run result for this process, so several processes can share one sweep: True if
    the result is not on disk and no live process holds ``<path>.claim`` (a dead holder's claim is taken
    over). The claim is removed by :func:`release` or when the result is written and the holder exits."""
    path = Path(path)
    if path.exists():
        return False
    lock = path.with_name(path.name + ".claim")
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = int(lock.read_text() or "0")
                os.kill(holder, 0)
                return False  # a live process runs it
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)  # its holder died: take it over
                continue
            except PermissionError:
                return False
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def release(path: str | Path) -> None:
    """Drop this process's claim on ``path`` (after writing it, or on failure)."""
    Path(path).with_name(Path(path).name + ".claim").unlink(missing_ok=True)


class Entries:
    """Named results in one JSON file, ``{"entries": {name: result}, "platform": ...}``.

    With ``resume`` the entries of an existing file are loaded, and ``name in entries`` tells the
    script to skip that one; each :meth:`add` rewrites the file atomically, so a killed run loses at
    most the entry it was measuring.
    """

    def __init__(self, path: str | Path, *, resume: bool = False, **extra: Any) -> None:
        """Args: path: the JSON file; resume: keep its entries; extra: other top-level keys to write."""
        self.path = Path(path)
        self.extra = extra
        self.entries: dict[str, Any] = {}
        if resume and self.path.exists():
            self.entries = dict(json.loads(self.path.read_text()).get("entries", {}))

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> Any:
        return self.entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, name: str, result: Any) -> None:
        """Record one entry and rewrite the file."""
        self.entries[name] = result
        self.save()

    def save(self) -> Path:
        """Rewrite the file (atomically), with fresh platform metadata."""
        return write_json(self.path, {**self.extra, "entries": self.entries})
