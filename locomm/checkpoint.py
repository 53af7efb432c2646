"""Atomic checkpoints in safetensors: model, optimizer state, step, run-spec hash.

Notable:
- One file, written to a temporary name in the same folder, fsynced, then renamed
  over the old one (and the folder fsynced): a crash at any point leaves either
  the old checkpoint or the new one, never a torn file.
- Optimizer state is flattened to ``optim/{param index}/{key}`` tensors; the
  rest (param groups, step, sampler RNG state, spec hash) is JSON in the
  safetensors metadata, so the file stays loadable without pickle.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

CHECKPOINT_NAME = "checkpoint.safetensors"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: corrupt, or from a different run spec."""


@dataclass
class Checkpoint:
    step: int
    spec_hash: str
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    """Other named tensors, e.g. an outer algorithm's state."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, nothing between."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
    atomic_write_bytes(path, st_save(tensors, metadata={"locomm": json.dumps(meta)}))


def load_checkpoint(path: Path) -> Checkpoint:
    try:
        raw = path.read_bytes()
        tensors = st_load(raw)
        from safetensors import safe_open  # noqa: PLC0415

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})["locomm"])
    except Exception as e:  # safetensors raises its own error type on a torn or foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None
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
        step=int(meta["step"]),
        spec_hash=meta["spec_hash"],
        model=model,
        optimizer=optimizer,
        extra=meta.get("extra", {}),
        aux=aux,
    )
