"""``locomm-peer doctor``: the checks of this machine (disk, device, torch build) and the report.

The swarm checks are in :mod:`locomm.doctor.swarm`. Every check gives one :class:`Check`: a status
(OK / WARN / FAIL / SKIP), the number it measured, one line of detail and, when not OK, the fix. The
sizes are estimates from the run spec's model: fp32 weights, AdamW's two moments and the outer
algorithm's state (its outer point and momentum) make ``CKPT_BYTES_PER_PARAM``; training adds the
gradients and the activations of one batch.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CKPT_BYTES_PER_PARAM = 4 * (1 + 2 + 2)
"""fp32 weights, two AdamW moments, the outer point and the outer momentum."""
TRAIN_BYTES_PER_PARAM = CKPT_BYTES_PER_PARAM + 4
"""... plus the gradients."""
DISK_COPIES = 2
"""An atomic checkpoint write holds the old file and the new one at once."""


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: str
    """OK, WARN, FAIL or SKIP."""
    value: float | None
    """The number measured (None when there is none)."""
    unit: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f"\n{'':7}fix: {self.fix}" if self.fix and self.status != "OK" else ""
        return f"{self.status:<5}{self.name:<11}{self.detail}{fix}"


def num_parameters(spec: Any) -> int:
    """The model's parameter count, from a model built on the meta device (no memory, no init)."""
    import torch  # noqa: PLC0415

    from locomm.model.llama import LlamaModel  # noqa: PLC0415

    with torch.device("meta"):
        return LlamaModel(spec.model, seed=0).num_parameters()


def activation_bytes(spec: Any) -> int:
    """A rough fp32 activation footprint of one training batch (the backward keeps every layer's)."""
    m, d = spec.model, spec.data
    tokens = d.batch_size * d.seq_len
    per_layer = 4 * tokens * (12 * m.d_model + 3 * m.d_ff) + 4 * d.batch_size * m.n_heads * d.seq_len**2 * 2
    return m.n_layers * per_layer + 3 * 4 * tokens * m.vocab_size  # logits, their softmax and its grad


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def disk_check(checkpoint_dir: Path | None, ckpt_bytes: int) -> Check:
    where = (checkpoint_dir or Path.cwd()).absolute()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the folder is created at the first checkpoint: check the disk it will be on
    free = shutil.disk_usage(probe).free
    need = DISK_COPIES * ckpt_bytes
    note = "" if checkpoint_dir else " (no --checkpoint-dir: checked the current folder)"
    detail = f"{_gb(free)} free at {probe}{note}; a checkpoint is ~{_gb(ckpt_bytes)}, {DISK_COPIES} at once"
    if free < need:
        return Check(
            "disk", "FAIL", free, "bytes", detail, f"free {_gb(need - free)} or point --checkpoint-dir at a bigger disk"
        )
    if free < 5 * need:
        return Check("disk", "WARN", free, "bytes", detail, "little headroom: logs and data share this disk")
    return Check("disk", "OK", free, "bytes", detail)


def _host_memory() -> tuple[int, int]:
    """(total, available) RAM in bytes."""
    try:
        info = dict(re.findall(r"^(\w+):\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M))
        return int(info["MemTotal"]) * 1024, int(info.get("MemAvailable", info["MemFree"])) * 1024
    except (OSError, KeyError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def device_check(device: str, train_bytes: int) -> Check:
    import torch  # noqa: PLC0415

    want = device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        return Check("device", "FAIL", None, "bytes", f"--device {want}: {e}", "use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return Check(
                "device",
                "FAIL",
                None,
                "bytes",
                f"--device {want}, but torch sees no CUDA device",
                "see the torch check; or --device cpu",
            )
        free, total = torch.cuda.mem_get_info(dev)
        name = torch.cuda.get_device_name(dev)
    elif dev.type == "mps":
        total, free = _host_memory()  # unified memory: what the system has is what the GPU can get
        name = "Apple GPU (mps)"
    else:
        total, free = _host_memory()
        name = f"CPU, {os.cpu_count()} cores"
    detail = f"{name}: {_gb(free)} free of {_gb(total)}; training needs ~{_gb(train_bytes)}"
    if free < train_bytes:
        return Check(
            "device",
            "FAIL",
            free,
            "bytes",
            detail,
            "a smaller --preset, a smaller batch, or close what holds the memory",
        )
    if free < 1.5 * train_bytes:
        return Check("device", "WARN", free, "bytes", detail, "little headroom: other programs may push it out")
    return Check("device", "OK", free, "bytes", detail)


def _nvidia_driver() -> str | None:
    """The NVIDIA kernel driver's version, when one is loaded (or nvidia-smi is on PATH), else None."""
    try:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", Path("/proc/driver/nvidia/version").read_text())
        return m.group(1) if m else "?"
    except OSError:
        return "?" if shutil.which("nvidia-smi") else None


def torch_check() -> Check:
    import torch  # noqa: PLC0415

    cuda, driver = torch.version.cuda, _nvidia_driver()
    build = f"torch {torch.__version__} ({f'CUDA {cuda}' if cuda else 'CPU build'})"
    gpu = f"NVIDIA driver {driver}" if driver else "no NVIDIA GPU visible"
    detail = f"{build}; {gpu}"
    if cuda and driver:
        if torch.cuda.is_available():
            return Check("torch", "OK", torch.cuda.device_count(), "gpus", f"{detail}; {torch.cuda.device_count()} GPU")
        return Check(
            "torch",
            "FAIL",
            0,
            "gpus",
            f"{detail}, but torch cannot use it",
            f"the driver may be older than CUDA {cuda} needs: update it, or install a torch wheel for an "
            "older CUDA (pip install torch --index-url https://download.pytorch.org/whl/cu118)",
        )
    if driver and not cuda:
        return Check(
            "torch",
            "WARN",
            0,
            "gpus",
            detail,
            "this torch cannot use the GPU: pip install torch "
            "--index-url https://download.pytorch.org/whl/cu124 (or the CUDA your driver supports)",
        )
    if cuda and not driver:
        return Check("torch", "OK", 0, "gpus", f"{detail}: trains on the CPU (a CPU wheel is a smaller install)")
    return Check("torch", "OK", 0, "gpus", detail)


def local_checks(spec: Any, *, checkpoint_dir: Path | None, device: str) -> list[Check]:
    n = num_parameters(spec)
    return [
        Check("model", "OK", n, "params", f"{spec.model.preset}: {n / 1e6:.2f} M parameters"),
        disk_check(checkpoint_dir, n * CKPT_BYTES_PER_PARAM),
        device_check(device, n * TRAIN_BYTES_PER_PARAM + activation_bytes(spec)),
        torch_check(),
    ]


def report(checks: list[Check]) -> dict[str, Any]:
    """The JSON form: every check, and ``ok`` (no FAIL: exit status 0)."""
    return {"ok": not any(c.status == "FAIL" for c in checks), "checks": [asdict(c) for c in checks]}


def render(checks: list[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in ("OK", "WARN", "FAIL")}
    tail = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return "\n".join([*(c.line() for c in checks), f"-- {tail}: {'ready' if not counts['FAIL'] else 'fix FAIL'}"])
