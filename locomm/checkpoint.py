"""Atomic checkpoints in safetensors: model, optimizer state, step, run-spec hash.

Notable:
- One file, written to a temporary name in the same folder, fsynced, then renamed
  over the old one (and the folder fsynced): a crash at any point leaves either
  the old checkpoint or the new one, never a torn file. Every file the project
  writes for the user goes through :func:`locomm.atomic.atomic_path` (``atomic_write_text``,
  ``atomic_write_bytes``: torch-free, re-exported here) or :func:`save_tensors_atomic`.
- A kill mid-write leaves only a temporary file (``.checkpoint.safetensors.XXXXXXXX.tmp``);
  :func:`open_checkpoint`, the resume path, sweeps those (our pattern only, in the
  checkpoint folder) before it reads.
- A checkpoint that cannot be read (truncated, garbage) is renamed aside
  (``checkpoint.safetensors.corrupt-<time>``, never deleted: it is the user's work) and
  resuming goes on without it; one of a different run spec or format stays an error
  the user sorts out (:class:`CheckpointError`, a :class:`~locomm.config.ConfigError`:
  the CLI prints one line and exits 2).
- Optimizer state is flattened to ``optim/{param index}/{key}`` tensors; the
  rest (param groups, step, sampler RNG state, spec hash) is JSON in the
  safetensors metadata, so the file stays loadable without pickle.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from locomm.atomic import TEMP_SUFFIX
from locomm.atomic import atomic_path as atomic_path  # re-exported (local_swarm.py imports them from here)
from locomm.atomic import atomic_write_bytes as atomic_write_bytes
from locomm.atomic import atomic_write_text as atomic_write_text
from locomm.atomic import fsync_dir as _fsync_dir
from locomm.config import ConfigError, RunSpec

log = logging.getLogger(__name__)
CHECKPOINT_NAME = "checkpoint.safetensors"
FORMAT_VERSION = 1
CORRUPT_INFIX = ".corrupt-"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: from a different run spec, format or stage (the user's to sort out)."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file that cannot be read (truncated, garbage, unreadable): set aside, not fatal."""


@dataclass
class Checkpoint:
    step: int
    spec_hash: str
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    """Other named tensors, e.g. an outer algorithm's state."""


@dataclass(frozen=True)
class SetAside:
    """An unreadable checkpoint that the resume path renamed aside (kept, not read again)."""

    moved_to: Path
    error: str

    def event(self) -> dict[str, str]:
        """Fields for the node's event log: ``events.write("checkpoint_set_aside", **aside.event())``."""
        return {"moved_to": str(self.moved_to), "error": self.error}


# -- atomic writes -----------------------------------------------------------------------


def save_tensors_atomic(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file`` made atomic; tensors are moved to the CPU and made contiguous.

    Serialized in memory, then written by :func:`atomic_write_bytes`: safetensors' own ``save_file`` writes
    through a temporary ``.tmpXXXXXX`` of its own, which a kill would leave under a name nobody can sweep.
    """
    flat = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    atomic_write_bytes(path, st_save(flat, metadata=metadata))


def _temp_pattern(name: str) -> re.Pattern[str]:
    # tempfile.mkstemp's names: the prefix, 8 characters of [a-z0-9_], the suffix.
    return re.compile(rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}{re.escape(TEMP_SUFFIX)}")


def sweep_temp_files(directory: Path, name: str = CHECKPOINT_NAME) -> list[Path]:
    """Remove what killed writes of ``directory/name`` left (our temp-file pattern only); returns them.

    Call it before this process writes there: a write in flight has a temp file of the same pattern.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    pattern = _temp_pattern(name)
    swept = [p for p in directory.iterdir() if pattern.fullmatch(p.name) and p.is_file()]
    for p in swept:
        p.unlink(missing_ok=True)
    if swept:
        log.info(
            "removed %d temporary file(s) that interrupted writes of %s left in %s: %s",
            len(swept),
            name,
            directory,
            ", ".join(p.name for p in swept),
        )
    return swept


def set_aside(path: Path) -> Path:
    """Rename ``path`` to ``<name>.corrupt-<UTC time>`` (a fresh name: nothing is overwritten); returns it."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}{CORRUPT_INFIX}{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}{CORRUPT_INFIX}{stamp}-{n}")
        n += 1
    os.rename(path, target)
    _fsync_dir(path.parent)
    return target


# -- checkpoints -------------------------------------------------------------------------


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict on CPU with tied weights once (safetensors rejects shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().cpu().contiguous()
    return out


def load_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy saved tensors into ``model``; only tied aliases of saved tensors may be absent."""
    expected = model.state_dict()
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"checkpoint has tensors the model lacks: {unexpected[:5]}")
    saved_ptrs = {expected[k].data_ptr() for k in tensors}
    missing = [k for k in expected if k not in tensors and expected[k].data_ptr() not in saved_ptrs]
    if missing:
        raise CheckpointError(f"checkpoint lacks model tensors: {missing[:5]}")
    for k, v in tensors.items():
        if expected[k].shape != v.shape:
            raise CheckpointError(f"{k}: checkpoint shape {tuple(v.shape)} != model {tuple(expected[k].shape)}")
    model.load_state_dict(tensors, strict=False)


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    tensors = {f"model/{k}": v.detach().cpu().contiguous() for k, v in ckpt.model.items()}
    tensors.update({f"aux/{k}": v.detach().cpu().contiguous().clone() for k, v in ckpt.aux.items()})
    meta: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "step": ckpt.step,
        "spec_hash": ckpt.spec_hash,
        "extra": ckpt.extra,
    }
    if ckpt.optimizer is not None:
        scalars: dict[str, dict[str, Any]] = {}
        for idx, state in ckpt.optimizer["state"].items():
            for k, v in state.items():
                if torch.is_tensor(v):
                    tensors[f"optim/{idx}/{k}"] = v.detach().cpu().contiguous()
                else:
                    scalars.setdefault(str(idx), {})[k] = v
        meta["optim_groups"] = ckpt.optimizer["param_groups"]
        meta["optim_scalars"] = scalars
    save_tensors_atomic(path, tensors, metadata={"locomm": json.dumps(meta)})


def _metadata(raw: bytes) -> dict[str, Any]:
    """Our JSON from a safetensors file's header (8-byte little-endian length, then the JSON header)."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(json.loads(raw[8 : 8 + n])["__metadata__"]["locomm"])


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint; :class:`CorruptCheckpoint` when the file cannot be read or parsed."""
    try:
        raw = Path(path).read_bytes()  # one read: tensors and metadata come from the same file
        tensors = st_load(raw)
        meta = _metadata(raw)
        step, spec_hash = int(meta["step"]), str(meta["spec_hash"])
    except Exception as e:  # safetensors raises its own error type on a torn or foreign file
        raise CorruptCheckpoint(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {meta.get('format')!r}")
    model = {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}
    aux = {k[len("aux/") :]: v for k, v in tensors.items() if k.startswith("aux/")}
    optimizer = None
    if "optim_groups" in meta:
        state: dict[int, dict[str, Any]] = {}
        for k, v in tensors.items():
            if k.startswith("optim/"):
                _, idx, key = k.split("/", 2)
                state.setdefault(int(idx), {})[key] = v
        for idx, sc in meta["optim_scalars"].items():
            state.setdefault(int(idx), {}).update(sc)
        optimizer = {"state": state, "param_groups": meta["optim_groups"]}
    return Checkpoint(
        step=step, spec_hash=spec_hash, model=model, optimizer=optimizer, extra=meta.get("extra", {}), aux=aux
    )


def open_checkpoint(
    directory: Path, spec_hash: str, name: str = CHECKPOINT_NAME
) -> tuple[Checkpoint | None, SetAside | None]:
    """The resume path: sweep stale temp files, read ``directory/name``, set an unreadable one aside.

    Returns the checkpoint (None when there is none, or it was set aside) and what was set aside.
    Raises:
        CheckpointError: the checkpoint comes from a different run spec or format.
    """
    directory = Path(directory)
    sweep_temp_files(directory, name)
    path = directory / name
    if not path.exists():
        return None, None
    try:
        ckpt = load_checkpoint(path)
    except CorruptCheckpoint as e:
        try:
            moved = set_aside(path)
        except OSError as err:
            raise CheckpointError(f"{e}; and it cannot be moved aside: {err}") from None
        log.warning("%s; moved it to %s and going on without it", e, moved.name)
        return None, SetAside(moved, str(e))
    if ckpt.spec_hash != spec_hash:
        raise CheckpointError(
            f"{path} was written by a different run spec (hash {ckpt.spec_hash[:12]}, "
            f"this run {spec_hash[:12]}); use another --checkpoint-dir"
        )
    return ckpt, None


SPEC_KEY = "spec_toml"
"""``Checkpoint.extra`` key of the run spec's TOML (written by the peers since the volunteer wave), so a checkpoint
folder alone restarts a stopped swarm (``join --resume-from``) or exports its model."""


def checkpoint_spec(directory: Path, given: RunSpec | None = None, name: str = CHECKPOINT_NAME) -> RunSpec:
    """The run spec ``directory``'s checkpoint was trained under: the TOML it carries (checked against its spec
    hash), else ``given`` when its hash matches (a checkpoint of an older version carries none).

    Raises:
        CheckpointError: no readable checkpoint there, its spec is unreadable or does not match its hash, it
            carries none and ``given`` is missing or of another spec.
    """
    path = Path(directory) / name
    if not path.is_file():
        raise CheckpointError(f"{directory}: no checkpoint ({name}) in that folder")
    ckpt = load_checkpoint(path)
    text = ckpt.extra.get(SPEC_KEY)
    if isinstance(text, str):
        try:
            spec = RunSpec.from_toml(text)
        except ConfigError as e:
            raise CheckpointError(f"{path}: the run spec it carries does not parse: {e}") from None
        if spec.hash() != ckpt.spec_hash:
            raise CheckpointError(f"{path}: the run spec it carries does not match its spec hash")
        if given is not None and given.hash() != spec.hash():
            raise CheckpointError(
                f"{path} was trained under another spec (hash {spec.hash()[:12]}) than --config "
                f"(hash {given.hash()[:12]}); drop --config to take the checkpoint's"
            )
        return spec
    if given is None:
        raise CheckpointError(f"{path} carries no run spec (an older locomm wrote it): pass the run's --config")
    if given.hash() != ckpt.spec_hash:
        raise CheckpointError(f"{path} was written by another run spec than --config (hash {ckpt.spec_hash[:12]})")
    return given
